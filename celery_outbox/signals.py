"""Signals celery-outbox sends, in Celery's style (``@message_published.connect``).

* ``message_published(sender=outbox, message=OutgoingMessage, relayed=bool)``: the
  broker accepted the message (after the commit, or later by the relay).
* ``publish_failed(sender=outbox, message=OutgoingMessage, exception=...)``: a
  publish failed; a durable message stays in the outgoing table for the relay.
* ``duplicate_discarded(sender=outbox, message_id, task_name, queue)``: the inbox
  discarded a redelivered copy (acked, state IGNORED).
"""

from celery.utils.dispatch import Signal

__all__ = ["message_published", "publish_failed", "duplicate_discarded"]

message_published = Signal(name="celery_outbox.message_published", providing_args={"message", "relayed"})
publish_failed = Signal(name="celery_outbox.publish_failed", providing_args={"message", "exception"})
duplicate_discarded = Signal(
    name="celery_outbox.duplicate_discarded", providing_args={"message_id", "task_name", "queue"}
)
