"""The fields of a log line about one message, given as ``extra``: id, task, queue and attempt.

No transaction. A JSON log formatter gets them as fields of their own, whatever the line's text
says (docs/monitoring.md). ``fields(...)`` builds them; ``of_delivery``, ``of_message`` and
``of_row`` read them from what the caller holds (a delivery the inbox runs, a message being
published, a stored row).
"""

from __future__ import annotations

from typing import Any

from ..vocabulary import Attempt, attempt_of

__all__ = ["fields", "of_delivery", "of_message", "of_row"]


def fields(message_id: Any, task_name: Any, queue: Any, attempt: Attempt | None = None) -> dict[str, Any]:
    """``logger.info(..., **fields(...))``: the message's ``message_id``, ``task_name``, ``queue`` and
    ``attempt`` (``nesting.replays.retries``) as attributes of the log record."""
    return {"extra": {"message_id": message_id, "task_name": task_name, "queue": queue,
                      "attempt": None if attempt is None else str(attempt)}}


def of_delivery(delivery: Any) -> dict[str, Any]:
    """The fields of a delivery the inbox runs (``delivery.Delivery``)."""
    return fields(delivery.message_id, delivery.task_name, delivery.queue, delivery.attempt)


def of_message(message: Any) -> dict[str, Any]:
    """The fields of a message being published (``envelope.OutgoingMessage``)."""
    return fields(message.message_id, message.task_name, message.destination, attempt_of(message.headers))


def of_row(row: Any) -> dict[str, Any]:
    """The fields of a stored row: an inbox row (its counters are columns) or an outgoing one."""
    if "retries" in getattr(row, "_fields", ()):
        attempt = Attempt(row.nesting, row.replays, row.retries)
        return fields(row.message_id, row.task_name, getattr(row, "queue", None) or row.destination, attempt)
    return fields(row.message_id, row.task_name, row.destination)


def of_broker_message(message: Any) -> dict[str, Any]:
    """The fields of a message as the broker delivered it (a kombu ``Message``), however malformed:
    a header that is not text is left out."""
    headers = message.headers if isinstance(getattr(message, "headers", None), dict) else {}
    delivery_info = getattr(message, "delivery_info", None) or {}

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) else None

    return fields(text(headers.get("id")), text(headers.get("task")), text(delivery_info.get("routing_key")),
                  attempt_of(headers))
