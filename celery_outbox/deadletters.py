"""Dead letters: list, show, replay and purge the envelopes that failed for good.

Every dead letter keeps the full envelope (body, headers, routing), so it can be
replayed byte for byte. A replay goes through the outbox: per batch, one
transaction stores the messages in the outgoing table and counts the replay on
each dead letter (``replay_count``, ``replayed_at``); after the commit they are
published. The replayed message keeps its task id and carries the replay number
(header ``celery_outbox_replay``) as part of its attempt, so the inbox runs it
again instead of discarding it as a duplicate of the attempt that died. Replaying
one letter twice at once runs it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

from .envelope import from_row
from .inbox import REPLAY_HEADER
from .publishing import current_unit_of_work
from .store import utcnow

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["DeadLetterFilter", "purge", "replay"]

REPLAY_BATCH = 200


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a command applies to; every given criterion must hold."""

    ids: tuple[int, ...] | None = None
    task: str | None = None
    queue: str | None = None
    exception: str | None = None
    reason: str | None = None
    since: datetime | None = None
    failed_before: datetime | None = None

    def where(self, store: Any):
        return store.dead_letter_filter(
            ids=self.ids, task=self.task, queue=self.queue, exception=self.exception, reason=self.reason,
            since=self.since, failed_before=self.failed_before)


def replay(outbox: "Outbox", which: DeadLetterFilter,
           progress: Callable[[int], None] | None = None) -> list[str]:
    """Re-publish the matching dead letters through the outbox; returns the replayed message ids."""
    store = outbox.ready().store
    where = which.where(store)
    queues = outbox.app.amqp.queues
    replayed: list[str] = []
    last_id = 0
    while True:
        with outbox.transaction() as session:
            conn = session.connection()
            rows = store.lock_dead_letters(conn, where, REPLAY_BATCH, after_id=last_id)
            if not rows:
                break
            last_id = rows[-1].id
            uow = current_unit_of_work()
            assert uow is not None
            uow.add([_replay_message(row, queues) for row in rows])
            store.mark_replayed(conn, [row.id for row in rows], utcnow())
        replayed.extend(row.message_id for row in rows)
        if progress is not None:
            progress(len(rows))
    return replayed


def _replay_message(row: Any, queues: Any):
    message = from_row(row, queues)
    message.row_id = None
    message.headers[REPLAY_HEADER] = (row.replays or 0) + (row.replay_count or 0) + 1
    # a replay is a new attempt, sent now: no broker ETA, no expiry of the original
    message.headers["eta"] = None
    message.headers["expires"] = None
    message.deliver_at = message.expires_at = None
    return message


def purge(outbox: "Outbox", which: DeadLetterFilter, batch_size: int | None = None,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete the matching dead letters in batches, each its own transaction; returns how many."""
    store = outbox.ready().store
    where = which.where(store)
    batch = batch_size or outbox.settings.cleanup_batch_size
    deleted = 0
    while True:
        with store.begin() as conn:
            ids = [row.id for row in store.lock_dead_letters(conn, where, batch, full=False)]
            count = store.delete_dead_letters(conn, ids)
        deleted += count
        if progress is not None and count:
            progress(count)
        if count < batch:
            return deleted
