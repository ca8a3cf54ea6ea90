"""Whether a received task message can be run and stored, and the dead-letter row of one that cannot.

Pure functions, no transaction, no I/O: its headers (``malformed_reason``), the store's limits
(``store_limits_reason``), its body (``body_reason``), and the dead-letter row
(``dead_letter_row_of``).
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import NotRegistered

from ..store import utcnow
from ..vocabulary import REDELIVERY_HEADER, REPLAY_HEADER, DeadLetterReason
from .dead_letter_rows import ID_SIZE, dead_letter_row, is_storable_id, stored_text

__all__ = ["MalformedMessage", "body_reason", "dead_letter_row_of", "is_protocol_one", "malformed_reason", "shown",
           "store_limits_reason"]

_OPTIONAL_STRINGS = ("root_id", "parent_id", "group", "eta", "expires", "shadow", "argsrepr", "kwargsrepr",
                     "origin", "lang")
# the counters celery-outbox reads besides Celery's: a dead-letter replay's number, delivery tracking's
_COUNTER_HEADERS = (REPLAY_HEADER, REDELIVERY_HEADER)
_OPTIONAL_INTEGERS = ("retries", "replaced_task_nesting", "group_index", *_COUNTER_HEADERS)
_STORED_INTEGER_MAX = 2**31 - 1  # the store's attempt columns (retries, nesting, replays)
_MALFORMED = DeadLetterReason.MALFORMED


def malformed_reason(headers: Any, known_tasks: Any) -> tuple[DeadLetterReason, str] | None:
    """(reason, description) when a protocol-2 task message cannot be run as is, else None."""
    if not isinstance(headers, dict):
        return _MALFORMED, f"headers are a {type(headers).__name__}, not a mapping"
    task = headers.get("task")
    if not isinstance(task, str) or not task:
        return _MALFORMED, f"header 'task' is {shown(task)}: a task name is required"
    message_id = headers.get("id")
    if not isinstance(message_id, str) or not message_id:
        return _MALFORMED, f"header 'id' is {shown(message_id)}: a task id is required"
    if task not in known_tasks:  # before the other headers, as Celery: its caller is told NotRegistered
        return DeadLetterReason.UNKNOWN_TASK, f"task {shown(task)} is not registered in this worker"
    for name in _OPTIONAL_STRINGS:
        value = headers.get(name)
        if value is not None and not isinstance(value, str):
            return _MALFORMED, f"header {name!r} is {shown(value)}: expected a string or null"
    for name in _OPTIONAL_INTEGERS:
        value = headers.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return _MALFORMED, f"header {name!r} is {shown(value)}: expected a whole number or null"
    timelimit = headers.get("timelimit")
    if timelimit is not None and (not isinstance(timelimit, (list, tuple)) or len(timelimit) != 2
                                  or any(t is not None and not isinstance(t, (int, float)) for t in timelimit)):
        return _MALFORMED, f"header 'timelimit' is {shown(timelimit)}: expected [soft, hard] seconds or nulls"
    return None


def store_limits_reason(headers: dict[str, Any]) -> tuple[DeadLetterReason, str] | None:
    """(reason, description) when the store cannot record the attempt of a message whose headers
    passed ``malformed_reason`` (its id or task name too long or not storable text, a count
    beyond the store's columns), else None. Applies to messages that go through the inbox."""
    for name in ("id", "task"):
        value = headers[name]
        if len(value) > ID_SIZE:
            return _MALFORMED, f"header {name!r} is {len(value)} characters, the store holds at most {ID_SIZE}"
        if not is_storable_id(value):
            return _MALFORMED, f"header {name!r} is {shown(value)}: NUL bytes and lone surrogates cannot be stored"
    for name in ("retries", "replaced_task_nesting", *_COUNTER_HEADERS):
        value = headers.get(name)
        if value is not None and value > _STORED_INTEGER_MAX:
            return _MALFORMED, f"header {name!r} is {value}: the store holds at most {_STORED_INTEGER_MAX}"
    return None


def body_reason(message: Any) -> tuple[DeadLetterReason, str] | None:
    """(reason, description) when the body of a protocol-2 message does not decode into
    ``(args, kwargs, embed)``: a list, a mapping with string keys, a mapping or null."""
    try:
        body = message.decode()
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the message's fault
        return _MALFORMED, f"body cannot be decoded ({shown(message.content_type)}): {shown(exc)}"
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return _MALFORMED, f"body is {shown(body)}: expected [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)):
        return _MALFORMED, f"body's args are {shown(args)}: expected a list"
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        return _MALFORMED, f"body's kwargs are {shown(kwargs)}: expected a mapping with string keys"
    if embed is not None and not isinstance(embed, dict):
        return _MALFORMED, f"body's embed is {shown(embed)}: expected a mapping or null"
    return None


def shown(value: Any, size: int = 200) -> str:
    """A value in a description: its repr, cut to ``size`` characters."""
    text = stored_text(value if not isinstance(value, str) else repr(value))
    return text if len(text) <= size else f"{text[:size]}... ({len(text)} characters)"


def dead_letter_row_of(message: Any, reason: DeadLetterReason, description: str,
                       queue: str | None = None) -> dict[str, Any]:
    """The dead-letter row of a received ``message`` (its headers as received), fitted to the table;
    its queue is ``queue`` when resolved, else the delivery's routing key."""
    headers = getattr(message, "received_headers", message.headers)
    mapping = headers if isinstance(headers, dict) else {}
    delivery_info = message.delivery_info
    return dead_letter_row(
        reason=reason, failed_at=utcnow(), message_id=mapping.get("id"), task_name=mapping.get("task"),
        queue=queue if queue is not None else delivery_info.get("routing_key"),
        description=description, retries=mapping.get("retries"),
        nesting=mapping.get("replaced_task_nesting"), exchange=delivery_info.get("exchange"),
        routing_key=delivery_info.get("routing_key"), body=message.body, content_type=message.content_type,
        content_encoding=message.content_encoding, headers=headers, properties=message.properties,
        error=MalformedMessage(description) if reason is _MALFORMED else NotRegistered(description))


class MalformedMessage(Exception):
    """The message cannot be run as it is (its dead letter's exception type)."""


def is_protocol_one(message: Any) -> bool:
    try:
        body = message.decode()
    except Exception:  # noqa: BLE001 - undecodable: not a protocol 1 message
        return False
    return isinstance(body, dict) and isinstance(body.get("task"), str) and isinstance(body.get("id"), str)
