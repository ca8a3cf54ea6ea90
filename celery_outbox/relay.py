"""The relay: publish outgoing rows that nobody published after their commit.

Transaction boundary: one short transaction per batch. The batch's rows are
locked (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, the write lock on SQLite), so two
relays never send the same row; they are published with one producer and the sent
ones deleted with one DELETE before the commit. A row whose publish fails for a
reason of its own counts an attempt and, after ``outbox_relay_max_attempts``, goes to
dead letters (reason ``poison``): one bad row never blocks the others. A broker
outage counts no attempts; the batch stops and the rows wait for the next pass.

Guarantee: at least once. A crash after the publish and before the commit sends
the row again on the next pass; the receiving inbox discards the copy.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .broker import connect_quickly, connection_errors
from .crashpoints import crashpoint
from .envelope import OutgoingMessage, from_row
from .signals import message_published, publish_failed
from .store import utcnow

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["RelayResult", "relay"]

logger = logging.getLogger("celery_outbox.relay")


@dataclass
class RelayResult:
    published: int = 0
    failed: int = 0
    dead_lettered: int = 0
    batches: int = 0
    broker_error: str | None = None

    def __str__(self) -> str:
        text = (f"relay: published {self.published}, failed {self.failed}, "
                f"dead-lettered {self.dead_lettered}, in {self.batches} batch(es)")
        if self.broker_error:
            text += f"; broker unavailable: {self.broker_error}"
        return text


def relay(outbox: "Outbox", max_batches: int | None = None) -> RelayResult:
    """Publish pending outgoing rows, in bounded batches; what beat and ``outbox relay`` run."""
    store = outbox.ready().store
    settings = outbox.settings
    app = outbox.app
    result = RelayResult()
    limit = max_batches or settings.max_batches_per_run
    with app.producer_or_acquire() as producer:
        broker_errors = connection_errors(producer.connection)
        result.broker_error = connect_quickly(producer.connection)
        if result.broker_error:
            logger.warning("celery-outbox relay: broker unavailable, nothing relayed: %s", result.broker_error)
            return result
        queues = app.amqp.queues
        last_id = 0  # one pass walks the table once: a failing row is tried once per pass
        while result.batches < limit:
            with store.begin() as conn:
                rows = store.lock_pending_outgoing(conn, settings.relay_batch_size, utcnow(), after_id=last_id)
                if not rows:
                    break
                result.batches += 1
                last_id = rows[-1].id
                sent: list[int] = []
                poisoned: list[tuple[Any, BaseException]] = []
                for row in rows:
                    message = from_row(row, queues)
                    try:
                        message.publish(producer, retry=False)
                    except broker_errors as exc:
                        result.broker_error = f"{type(exc).__name__}: {exc}"
                        publish_failed.send(sender=outbox, message=message, exception=exc)
                        break
                    except Exception as exc:  # noqa: BLE001 - a row-specific failure, counted per row
                        result.failed += 1
                        publish_failed.send(sender=outbox, message=message, exception=exc)
                        attempts = store.record_outgoing_failure(conn, row.id, f"{type(exc).__name__}: {exc}")
                        if attempts >= settings.relay_max_attempts:
                            poisoned.append((row, exc))
                        continue
                    sent.append(row.id)
                    result.published += 1
                    _announce(outbox, message)
                    crashpoint("during_relay")
                if poisoned:
                    store.insert_dead_letters(conn, [_dead_letter(row, exc) for row, exc in poisoned])
                    result.dead_lettered += len(poisoned)
                store.delete_outgoing(conn, sent + [row.id for row, _ in poisoned])
            if result.broker_error:
                break
    if result.published or result.failed:
        logger.info("celery-outbox %s", result)
    return result


def _announce(outbox: "Outbox", message: OutgoingMessage) -> None:
    message_published.send(sender=outbox, message=message, relayed=True)


def _dead_letter(row: Any, exc: BaseException) -> dict[str, Any]:
    return {
        "message_id": row.message_id,
        "task_name": row.task_name,
        "queue": row.destination,
        "reason": "poison",
        "exception_type": type(exc).__name__,
        "exception_message": str(exc)[:4000],
        "traceback": "".join(traceback.format_exception(exc))[:20000],
        "exchange": row.exchange,
        "routing_key": row.routing_key,
        "body": row.body,
        "content_type": row.content_type,
        "content_encoding": row.content_encoding,
        "headers": row.headers,
        "properties": row.properties,
        "failed_at": utcnow(),
    }
