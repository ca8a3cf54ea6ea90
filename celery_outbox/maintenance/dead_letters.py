"""Dead letters, the envelopes that failed for good: the filter a command applies, replay and purge.

Transaction boundary: per batch of letters, ``replay`` locks them and, in one unit of work,
sends their messages through the outbox (durable ones stored) and counts the replay on each
letter; the messages are published after the commit. ``purge`` deletes in batches, each its own
transaction. Guarantee: a replay is a new attempt (header ``celery_outbox_replay``) that the inbox
runs; a letter is checked as the consumer guard checks a new message (a malformed one is refused,
never re-published) and goes where the app routes its task now. See docs/operations.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from kombu.serialization import loads

from ..core.runtime import Runtime
from ..message.checks import malformed_reason
from ..message.envelope import OutgoingMessage, from_row
from ..message.routing import published_route
from ..producer.publishing import Publisher
from ..producer.unit_of_work import current_unit_of_work, transaction
from ..store import utcnow
from ..vocabulary import REPLAY_HEADER, DeadLetterReason

__all__ = ["DeadLetterFilter", "Replayed", "purge", "replay"]

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


@dataclass
class Replayed:
    """What a replay did: the message ids re-published, and the dead letters refused with the reason."""

    message_ids: list[str] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)


def replay(publisher: Publisher, which: DeadLetterFilter,
           progress: Callable[[int], None] | None = None) -> Replayed:
    """Re-publish the matching dead letters through the outbox, each checked as the consumer guard
    checks a new message and routed by its task's current route; a malformed letter is refused
    (left as it is, with the reason in ``Replayed.refused``), never re-published."""
    runtime = publisher.runtime
    store = runtime.ready().store
    where = which.where(store)
    result = Replayed()
    last_id = 0
    while True:
        with transaction(publisher) as session:
            conn = session.connection()
            rows = store.lock_dead_letters(conn, where, REPLAY_BATCH, after_id=last_id)
            if not rows:
                break
            last_id = rows[-1].id
            messages, taken = [], []
            for row in rows:
                message = _replay_message(row, runtime.app)
                if isinstance(message, str):
                    result.refused.append((row.id, message))
                else:
                    messages.append(message)
                    taken.append(row)
            uow = current_unit_of_work()
            assert uow is not None
            uow.add(messages)
            store.mark_replayed(conn, [row.id for row in taken], utcnow())
        result.message_ids.extend(row.message_id for row in taken)
        if progress is not None:
            progress(len(rows))
    return result


def _replay_message(row: Any, app: Any) -> OutgoingMessage | str:
    """The message a dead letter replays as, or the reason it cannot be replayed."""
    try:
        message = from_row(row, app.amqp.queues)
    except ValueError as exc:  # headers or properties that are not JSON
        return f"the stored envelope cannot be read: {exc}"
    verdict = malformed_reason(message.headers, app.tasks)
    if verdict is not None and verdict[0] is not DeadLetterReason.UNKNOWN_TASK:
        return verdict[1]
    try:
        body = loads(message.body, message.content_type, message.content_encoding, accept=None)
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the letter's fault
        return f"body cannot be decoded ({message.content_type}): {exc}"
    if verdict is None:
        _route_now(message, app, body)
    message.row_id = None
    message.headers[REPLAY_HEADER] = (row.replays or 0) + (row.replay_count or 0) + 1
    # a replay is a new attempt, sent now: no broker ETA, no expiry of the original
    message.headers["eta"] = None
    message.headers["expires"] = None
    message.deliver_at = message.expires_at = None
    return message


# the options of a task's own declaration (``@app.task(queue=...)``) that route its messages: its
# ``apply_async`` hands them to the router, under those the call gives (a replay gives none)
ROUTING_OPTIONS = ("queue", "exchange", "routing_key")


def _route_now(message: OutgoingMessage, app: Any, body: Any) -> None:
    """Give a message of a registered task the exchange, routing key and queue that its
    ``apply_async`` would give it now (the task's own routing options, ``task_routes``, routers,
    the default queue), as Celery's sender resolves them (``routing.published_route``)."""
    args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and len(body) == 3 else ((), {})
    task = app.tasks[message.task_name]
    declared = {name: getattr(task, name) for name in ROUTING_OPTIONS if getattr(task, name, None) is not None}
    route = app.amqp.router.route(declared, message.task_name, args, kwargs, task_type=task)
    message.exchange, message.routing_key = published_route(app.amqp, route)
    message.destination = route["queue"].name
    message.sending["declare"] = [route["queue"]]


def purge(runtime: Runtime, which: DeadLetterFilter, batch_size: int | None = None,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete the matching dead letters in batches, each its own transaction; returns how many."""
    store = runtime.ready().store
    where = which.where(store)
    batch = batch_size or runtime.settings.cleanup_batch_size
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
