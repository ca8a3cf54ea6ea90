"""The relay: publish outgoing rows nobody published after their commit, and redeliver sent ones.

Transaction boundary: one short transaction per batch, whose commit does not wait for the WAL
flush: its rows are locked (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, the write lock on SQLite),
published with one producer, and marked sent, counted or dead-lettered before the commit; the
dead letters' results are stored after it. Guarantee: at least once, never by two relays at once;
a crash after a publish and before the commit sends the row again on the next pass, and the
receiving inbox discards the copy. A broker outage counts no attempt: the rows wait for the next
pass. See docs/publishing.md (The relay) and docs/operations.md (Durability on celery beat).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..core import log_fields
from ..core.runtime import Runtime
from ..message.dead_letter_rows import stored_dead_letter_row
from ..message.envelope import OutgoingMessage, from_row
from ..message.results import EndedMessage, store_dead_letter_results
from ..monitoring import tracing
from ..producer.broker import outlet
from ..signals import announce_dead_letters, message_published, message_redelivered, publish_failed
from ..store import as_utc, utcnow
from ..vocabulary import REDELIVERY_HEADER, DeadLetterReason, RedeliveryReason

__all__ = ["RelayResult", "redeliver", "relay"]

logger = logging.getLogger("celery_outbox.relay")


@dataclass
class RelayResult:
    published: int = 0
    failed: int = 0
    dead_lettered: int = 0
    expired: int = 0
    batches: int = 0
    broker_error: str | None = None

    def __str__(self) -> str:
        text = (f"relay: published {self.published}, failed {self.failed}, "
                f"dead-lettered {self.dead_lettered} (expired {self.expired}), in {self.batches} batch(es)")
        if self.broker_error:
            text += f"; broker unavailable: {self.broker_error}"
        return text


def relay(runtime: Runtime, max_batches: int | None = None) -> RelayResult:
    """Publish pending outgoing rows, in bounded batches; what each recover pass (beat) and
    ``outbox relay`` run."""
    store = runtime.ready().store
    settings = runtime.settings
    app = runtime.app
    result = RelayResult()
    limit = max_batches or settings.max_batches_per_run
    with outlet(app) as out:
        broker_error = out.unreachable()
        if broker_error:
            result.broker_error = broker_error
            logger.warning("celery-outbox relay: broker unavailable, nothing relayed: %s", broker_error)
            return result
        last_id = 0  # one pass walks the table once: a failing row is tried once per pass
        while result.batches < limit:
            with store.begin(durable=False) as conn:  # lost in a crash, the rows are only sent again
                store.limit_lock_holding(conn, settings.outbox_stale_time)
                now = utcnow()
                rows = store.lock_pending_outgoing(conn, settings.relay_batch_size, settings.release_before(now),
                                                   after_id=last_id)
                if not rows:
                    break
                result.batches += 1
                last_id = rows[-1].id
                expired, live = _split_expired(rows, now)
                done = out.publish_each([(row, with_eta(from_row(row, out.queues))) for row in live],
                                        crash_point="during_relay", step=tracing.Step.RELAY)
                poisoned: list[tuple[Any, BaseException]] = []
                for row, message, exc in done.failed:
                    result.failed += 1
                    publish_failed.send(sender=runtime.owner, message=message, exception=exc)
                    if store.record_outgoing_failure(conn, row.id, f"{type(exc).__name__}: {exc}") \
                            >= settings.relay_max_attempts:
                        poisoned.append((row, exc))
                if done.broker_error is not None:  # the rows not sent wait for the next pass
                    result.broker_error = done.broker_error_text
                    for _, message in done.not_sent:
                        publish_failed.send(sender=runtime.owner, message=message, exception=done.broker_error)
                published = [message for _, message in done.published]
                for message in published:
                    result.published += 1
                    _announce(runtime, message)
                dead_letters = [_dead_letter(row, None, DeadLetterReason.EXPIRED) for row in expired] + [
                    _dead_letter(row, exc, DeadLetterReason.POISON) for row, exc in poisoned]
                if dead_letters:
                    store.insert_dead_letters(conn, dead_letters)
                result.expired += len(expired)
                result.dead_lettered += len(dead_letters)
                store.delete_outgoing(conn, [row.id for row, _ in poisoned] + [row.id for row in expired])
                store.finish_sent(conn, [message.row_id for message in published], now,
                                  settings.first_redelivery(now), record=runtime.archiver is not None)
                if settings.redeliver_after is not None:
                    store.postpone_redelivery(conn, [
                        {"id": m.row_id, "redeliver_at": settings.first_redelivery(now, m.deliver_at)}
                        for m in published if m.deliver_at is not None and m.deliver_at > now])
            # committed: tell their callers what Celery would (REVOKED "expired"; FAILURE with the publish error)
            announce_dead_letters(runtime.owner, dead_letters)
            store_dead_letter_results(app, DeadLetterReason.EXPIRED, [EndedMessage.of_row(row) for row in expired])
            store_dead_letter_results(app, DeadLetterReason.POISON,
                                      [EndedMessage.of_row(row, exc) for row, exc in poisoned])
            if result.broker_error:
                break
    if result.published or result.failed:
        logger.info("celery-outbox %s", result)
    return result


def redeliver(runtime: Runtime, max_batches: int | None = None) -> tuple[int, str | None]:
    """Publish again the sent durable messages no inbox acknowledged by their ``redeliver_at``
    (the broker lost them, or they wait behind a backlog: the inbox discards a copy). One
    transaction per batch; each redelivery doubles the wait for the next. A message past its
    ``expires`` is not published again (the worker discarded it as expired, as Celery does, or
    it would now): it goes to dead letters, reason ``expired``. Returns how many were
    published and the broker error that stopped the pass, if any."""
    store, settings, app = runtime.ready().store, runtime.settings, runtime.app
    if settings.redeliver_after is None:
        return 0, None
    published = 0
    with outlet(app) as out:
        connected = False
        for _ in range(max_batches or settings.max_batches_per_run):
            with store.begin(durable=False) as conn:
                store.limit_lock_holding(conn, settings.outbox_stale_time)  # an inbox's claim waits on these rows
                now = utcnow()
                rows = store.lock_unacknowledged_outgoing(conn, now, settings.relay_batch_size)
                if not rows:
                    return published, None
                if not connected:
                    error = out.unreachable()
                    if error:
                        return published, error
                    connected = True
                expired, live = _split_expired(rows, now)
                dead_letters = [_dead_letter(row, None, DeadLetterReason.EXPIRED, sent=True) for row in expired]
                if expired:  # the worker discarded it as expired (Celery: revoked): nothing runs it now
                    store.insert_dead_letters(conn, dead_letters)
                    store.delete_outgoing(conn, [row.id for row in expired])
                done = out.publish_each([(row, _redelivery(row, out.queues)) for row in live],
                                        crash_point="during_relay", step=tracing.Step.REDELIVER)
                for row, _, exc in done.failed:  # it waits for its next redelivery
                    logger.error("celery-outbox: cannot redeliver %s[%s]: %r", row.task_name, row.message_id, exc,
                                 **log_fields.of_row(row))
                published += len(done.published)
                store.mark_redelivered(conn, [
                    {"id": row.id, "redeliver_at": settings.next_redelivery(now, row.redeliveries)}
                    for row, *_ in done.published + done.failed])
            announce_dead_letters(runtime.owner, dead_letters)
            for _, message in done.published:
                message_redelivered.send(sender=runtime.owner, message=message, reason=RedeliveryReason.UNACKNOWLEDGED)
            if done.broker_error is not None:
                return published, done.broker_error_text
            if len(rows) < settings.relay_batch_size:
                break
    if published:
        logger.warning("celery-outbox: redelivered %d sent message(s) no inbox had acknowledged", published)
    return published, None


def _redelivery(row: Any, queues: Any) -> OutgoingMessage:
    """The message a redelivery of ``row`` publishes: the inbox counts it as a recovery."""
    message = with_eta(from_row(row, queues))
    message.headers[REDELIVERY_HEADER] = row.redeliveries + 1
    return message


def with_eta(message: OutgoingMessage) -> OutgoingMessage:
    """Put a row's eta back in its headers from ``deliver_at`` when the ``eta`` header is empty (the
    form in which earlier releases stored a scheduled message), so that the worker holds the
    message until then, as it does for any row stored with its eta."""
    if message.deliver_at is not None and message.headers.get("eta") is None and "task" in message.headers:
        message.headers["eta"] = message.deliver_at.isoformat()
    return message


def _announce(runtime: Runtime, message: OutgoingMessage) -> None:
    message_published.send(sender=runtime.owner, message=message, relayed=True)


def _split_expired(rows: Any, now: datetime) -> tuple[list[Any], list[Any]]:
    """The rows past their ``expires`` (dead letters, not published), and the others."""
    expired, live = [], []
    for row in rows:
        (expired if _expired(row, now) else live).append(row)
    return expired, live


def _expired(row: Any, now: datetime) -> bool:
    expires_at = as_utc(row.expires_at)
    return expires_at is not None and expires_at <= now


def _dead_letter(row: Any, exc: BaseException | None, reason: DeadLetterReason, sent: bool = False) -> dict[str, Any]:
    when = "unacknowledged by any inbox" if sent else "before it was published"
    expired = None if exc is not None else f"expired at {as_utc(row.expires_at).isoformat()} {when}"
    return stored_dead_letter_row(row, reason=reason, failed_at=utcnow(), queue=row.destination, error=exc,
                                  description=expired)
