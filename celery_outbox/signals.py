"""Signals celery-outbox sends, in Celery's style (``@message_published.connect``).

Transaction boundary: none of its own; each signal is sent in the process where its event
happens, once it is true: a store, a dead letter or a claim's release after its transaction
committed (a rolled-back one is never announced), a publish once the broker accepted it.
Guarantee: a receiver that raises is logged by Celery's dispatcher and the message goes on; a
receiver runs on the message's path, so it must be quick. Each signal's arguments are given where
it is defined, and in docs/publishing.md (Signals).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from celery.utils.dispatch import Signal

from .vocabulary import DeadLetterReason

__all__ = ["announce_dead_letters", "claims_released", "duplicate_discarded", "message_dead_lettered",
           "message_handled", "message_published", "message_redelivered", "messages_stored", "publish_failed"]

#: ``messages_stored(sender=outbox, messages=[OutgoingMessage])``: durable messages committed to the
#: outgoing table (once per commit)
messages_stored = Signal(name="celery_outbox.messages_stored", providing_args={"messages"})
#: ``message_published(sender=outbox, message=OutgoingMessage, relayed=bool)``: the broker accepted the
#: message (after the commit, or later by the relay)
message_published = Signal(name="celery_outbox.message_published", providing_args={"message", "relayed"})
#: ``publish_failed(sender=outbox, message=OutgoingMessage, exception=...)``: a publish failed; a
#: durable message stays in the outgoing table for the relay
publish_failed = Signal(name="celery_outbox.publish_failed", providing_args={"message", "exception"})
#: ``message_redelivered(sender=outbox, message=OutgoingMessage, reason=RedeliveryReason)``: a sent
#: message published again: no inbox acknowledged it, or the worker running it was lost
message_redelivered = Signal(name="celery_outbox.message_redelivered", providing_args={"message", "reason"})
#: ``duplicate_discarded(sender=outbox, message_id, task_name, queue)``: the inbox discarded a
#: redelivered copy (acked, state IGNORED)
duplicate_discarded = Signal(
    name="celery_outbox.duplicate_discarded", providing_args={"message_id", "task_name", "queue"}
)
#: ``message_handled(sender=outbox, message_id, task_name, queue, attempt, seconds)``: an attempt's
#: transaction committed behind its inbox claim, ``seconds`` after the claim began
message_handled = Signal(name="celery_outbox.message_handled",
                         providing_args={"message_id", "task_name", "queue", "attempt", "seconds"})
#: ``message_dead_lettered(sender=outbox, message_id, task_name, queue, reason=DeadLetterReason)``: a
#: message was moved to dead letters
message_dead_lettered = Signal(name="celery_outbox.message_dead_lettered",
                               providing_args={"message_id", "task_name", "queue", "reason"})
#: ``claims_released(sender=outbox, count, reason=ClaimRelease)``: recovery released inbox claims so
#: that other workers take them over: their node died, or they were stale
claims_released = Signal(name="celery_outbox.claims_released", providing_args={"count", "reason"})


def announce_dead_letters(sender: Any, rows: Iterable[Mapping[str, Any]]) -> None:
    """Send ``message_dead_lettered`` for each dead-letter row (``dead_letter_rows``) once it committed."""
    if not message_dead_lettered.receivers:
        return
    for row in rows:
        message_dead_lettered.send(sender=sender, message_id=row.get("message_id"), task_name=row.get("task_name"),
                                   queue=row.get("queue"), reason=DeadLetterReason(row["reason"]))
