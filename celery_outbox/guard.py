"""The consumer guard: a malformed message is dead-lettered and acked, never fatal.

A worker consumer bootstep that ``Outbox(app)`` installs. It looks at each task
message before Celery does. A message with no id, with headers of the wrong
types, for an unknown task, or (on a durable queue) with a body that cannot be
decoded is written to dead letters with the reason and acked; the messages around
it are unaffected. Plain Celery drops such messages or, for a missing id,
restarts its consumer until the worker gives up.

Transaction boundary: the dead letter commits before the ack; if the store cannot
be reached the message is handed back to the broker (not acked) instead.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

from celery import bootsteps
from kombu.utils import json as kombu_json

from .inbox import REQUEUE_BACKOFF
from .routing import queue_of
from .store import utcnow

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["MessageGuard", "malformed_reason"]

logger = logging.getLogger("celery_outbox.guard")

_OPTIONAL_STRINGS = ("root_id", "parent_id", "group", "eta", "expires", "shadow", "argsrepr", "kwargsrepr",
                     "origin", "lang")
_OPTIONAL_INTEGERS = ("retries", "replaced_task_nesting", "group_index")


def malformed_reason(headers: Any, known_tasks: Any) -> tuple[str, str] | None:
    """(reason, description) when a protocol-2 task message cannot be run as is, else None."""
    if not isinstance(headers, dict):
        return "malformed", f"headers are a {type(headers).__name__}, not a mapping"
    task = headers.get("task")
    if not isinstance(task, str) or not task:
        return "malformed", f"header 'task' is {task!r}: a task name is required"
    message_id = headers.get("id")
    if not isinstance(message_id, str) or not message_id:
        return "malformed", f"header 'id' is {message_id!r}: a task id is required"
    for name in _OPTIONAL_STRINGS:
        value = headers.get(name)
        if value is not None and not isinstance(value, str):
            return "malformed", f"header {name!r} is {value!r}: expected a string or null"
    for name in _OPTIONAL_INTEGERS:
        value = headers.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return "malformed", f"header {name!r} is {value!r}: expected a whole number or null"
    timelimit = headers.get("timelimit")
    if timelimit is not None and (not isinstance(timelimit, (list, tuple)) or len(timelimit) != 2
                                  or any(t is not None and not isinstance(t, (int, float)) for t in timelimit)):
        return "malformed", f"header 'timelimit' is {timelimit!r}: expected [soft, hard] seconds or nulls"
    if task not in known_tasks:
        return "unknown_task", f"task {task!r} is not registered in this worker"
    return None


def _text(value: Any, limit: int = 255) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _dead_letter(message: Any, reason: str, description: str, now: datetime) -> dict[str, Any]:
    headers = message.headers if isinstance(message.headers, dict) else {}
    delivery_info = message.delivery_info or {}
    queue = delivery_info.get("routing_key") or ""
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8", "replace")
    return {
        "message_id": _text(headers.get("id")), "destination": "", "task_name": _text(headers.get("task")),
        "queue": _text(queue), "reason": reason, "exception_type": "MalformedMessage" if reason == "malformed"
        else "NotRegistered", "exception_message": description[:4000], "traceback": None,
        "exchange": _text(delivery_info.get("exchange")), "routing_key": _text(queue), "body": body,
        "content_type": _text(message.content_type, 128), "content_encoding": _text(message.content_encoding, 64),
        "headers": kombu_json.dumps(message.headers, default=repr) if message.headers is not None else None,
        "properties": kombu_json.dumps(message.properties, default=repr), "failed_at": now,
    }


def _is_protocol_one(message: Any) -> bool:
    try:
        body = message.decode()
    except Exception:  # noqa: BLE001 - undecodable: not a protocol 1 message
        return False
    return isinstance(body, dict) and isinstance(body.get("task"), str) and isinstance(body.get("id"), str)


class MessageGuard(bootsteps.Step):
    """Consumer step: wraps Celery's task message handler with the checks above."""

    def __init__(self, c: Any, **kwargs: Any):
        super().__init__(c, **kwargs)
        outbox: "Outbox | None" = getattr(c.app, "_celery_outbox", None)
        if outbox is None:
            return
        create = c.create_task_handler

        def create_task_handler(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
            handler = create(*args, **kwargs)

            def on_task_received(message: Any) -> Any:
                if self._intercepted(outbox, c, message):
                    return None
                return handler(message)

            return on_task_received

        c.create_task_handler = create_task_handler

    @staticmethod
    def _intercepted(outbox: "Outbox", consumer: Any, message: Any) -> bool:
        headers = message.headers
        if isinstance(headers, dict) and "task" not in headers and _is_protocol_one(message):
            return False  # Celery's own protocol 1 checks apply
        verdict = malformed_reason(headers, consumer.strategies)
        if verdict is None:
            queue = queue_of(message.delivery_info, consumer.app)
            if not outbox.settings.is_durable(queue):
                return False
            try:
                message.decode()
            except Exception as exc:  # noqa: BLE001 - any failure to decode is the message's fault
                verdict = ("malformed", f"body cannot be decoded ({message.content_type}): {exc}")
            else:
                return False
        reason, description = verdict
        try:
            store = outbox.ready().store
            with store.begin() as conn:
                store.insert_dead_letters(conn, [_dead_letter(message, reason, description, utcnow())])
        except Exception as exc:  # noqa: BLE001 - without a dead letter the message must not be acked
            logger.error("celery-outbox: cannot dead-letter a %s message (%s); handing it back to the broker: %s",
                         reason, description, exc)
            time.sleep(REQUEUE_BACKOFF)  # the store is down: do not spin on the message
            message.reject(requeue=True)
            return True
        logger.error("celery-outbox: dead-lettered a %s message from %r: %s", reason,
                     (message.delivery_info or {}).get("routing_key"), description)
        message.ack()
        return True
