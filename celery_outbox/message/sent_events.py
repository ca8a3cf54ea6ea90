"""The ``task-sent`` event of a captured send, published after the commit by Celery's own dispatcher.

Transaction boundary: none; the event is recorded at capture (``RecordingDispatcher``) and sent
with its message after the commit (``SentEvent.send``), by the same call on the dispatcher Celery
would have used, which stamps it when it is published and buffers it when the publish fails.
Guarantee: one event per send, in the process that sent the task, as in Celery; the event is not
stored, so the relay and redelivery never send it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RecordingDispatcher", "SentEvent"]

logger = logging.getLogger("celery_outbox.publishing")


@dataclass
class SentEvent:
    """One recorded ``EventDispatcher.publish`` call: sent after the task message it follows."""

    dispatcher: Any
    type: str
    fields: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)  # retry, retry_policy, as Celery passed them

    def send(self, producer: Any, retry: bool | None = None) -> None:
        """Publish with ``producer`` through Celery's dispatcher; ``retry=False`` (the broker is known
        to be down) skips the retry policy: the dispatcher buffers the event at once. Never raises:
        it runs after the commit; a dispatcher that does not buffer (``buffer_while_offline=False``)
        loses the event, which is logged."""
        options = dict(self.options)
        if retry is not None:
            options["retry"] = retry
        try:
            self.dispatcher.publish(self.type, dict(self.fields), producer, **options)
        except Exception as exc:  # noqa: BLE001 - after the commit: reported, the caller's work stands
            logger.error("celery-outbox: the %s event of %s[%s] could not be published and its dispatcher "
                         "does not buffer it, the event is lost: %r", self.type, self.fields.get("name"),
                         self.fields.get("uuid"), exc)


class RecordingDispatcher:
    """Stands in for the event dispatcher while Celery's sender runs: records each ``publish``."""

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher
        self.events: list[SentEvent] = []

    def publish(self, type: str, fields: dict[str, Any], producer: Any, **options: Any) -> None:
        self.events.append(SentEvent(self.dispatcher, type, dict(fields), options))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)
