"""Dead-letter rows: built in one place, fitted to the table so their INSERT cannot fail on content.

Transaction boundary: none here; the row is a plain dict that ``Store.insert_dead_letters`` inserts
in the caller's transaction. Guarantee: whatever a message carried, PostgreSQL and SQLite accept
the row: each text is escaped where the database rejects it (a NUL byte is stored as ``\\x00``, a
lone surrogate as ``\\udxxx``) and cut to its column's size; headers and properties are stored as
ASCII JSON (a value JSON cannot hold as its ``repr``); the body as bytes; each count within the
column's range.
"""

from __future__ import annotations

import traceback as traceback_module
from datetime import datetime
from typing import Any

from kombu.utils import json as kombu_json
from sqlalchemy import String

from ..store import build_tables
from ..vocabulary import DeadLetterReason

__all__ = ["DeadLetterReason", "dead_letter_row", "is_storable_id", "stored_dead_letter_row", "stored_header_text",
           "stored_text"]

_COLUMN_SIZES: dict[str, int] = {
    column.name: column.type.length for column in build_tables().dead_letters.columns
    if isinstance(column.type, String) and column.type.length}
# Text columns are unbounded; these keep a runaway message or traceback from bloating the table.
_TEXT_SIZES = {"exception_message": 4000, "traceback": 20000}
_INTEGER_MAX = 2**31 - 1  # the Integer columns (retries, nesting, replays)
ID_SIZE = _COLUMN_SIZES["message_id"]


def stored_text(value: Any, size: int | None = None) -> str:
    """``value`` as text any database column accepts: NUL and lone surrogates escaped, cut to
    ``size`` characters. A value that is not a string is stored as its ``repr``."""
    text = value if isinstance(value, str) else _repr(value)
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    return text if size is None else text[:size]


def is_storable_id(value: str) -> bool:
    """Whether the store can hold ``value`` as a message id as it is (no escaping, no cut)."""
    return len(value) <= ID_SIZE and stored_text(value) == value


def dead_letter_row(*, reason: DeadLetterReason, failed_at: datetime, message_id: Any = "",
                    task_name: Any = "", queue: Any = "", destination: Any = "", error: BaseException | None = None,
                    description: str | None = None, retries: Any = 0, nesting: Any = 0, replays: Any = 0,
                    exchange: Any = "", routing_key: Any = "", body: Any = None, content_type: Any = None,
                    content_encoding: Any = None, headers: Any = None, properties: Any = None) -> dict[str, Any]:
    """The dead-letter row of one message, every value fitted to its column. ``error`` gives the
    exception type, message and traceback; ``description`` (if given) replaces its message.
    Headers and properties are a mapping (or any value) to store as JSON, or stored JSON text."""
    return {
        "message_id": _identifier(message_id, "message_id"),
        "destination": _identifier(destination, "destination"),
        "task_name": _identifier(task_name, "task_name"),
        "queue": _identifier(queue, "queue"),
        "reason": DeadLetterReason(reason).value,
        **_error_columns(error, description),
        "retries": _count(retries), "nesting": _count(nesting), "replays": _count(replays),
        "exchange": _identifier(exchange, "exchange"),
        "routing_key": _identifier(routing_key, "routing_key"),
        "body": _body(body),
        "content_type": _optional_identifier(content_type, "content_type"),
        "content_encoding": _optional_identifier(content_encoding, "content_encoding"),
        "headers": _json_column(headers), "properties": _json_column(properties),
        "failed_at": failed_at,
    }


def _error_columns(error: BaseException | None, description: str | None) -> dict[str, Any]:
    message = description if description is not None or error is None else _safe_str(error)
    return {
        "exception_type": None if error is None else stored_text(type(error).__name__, _COLUMN_SIZES["exception_type"]),
        "exception_message": None if message is None else stored_text(message, _TEXT_SIZES["exception_message"]),
        "traceback": None if error is None else stored_text(_traceback(error), _TEXT_SIZES["traceback"]),
    }


def stored_dead_letter_row(row: Any, *, reason: DeadLetterReason, failed_at: datetime, **fields: Any,
                           ) -> dict[str, Any]:
    """The dead-letter row of a stored message (an outgoing row, or an inbox row's envelope): its id,
    task, routing and envelope from ``row``; ``fields`` as for ``dead_letter_row``."""
    return dead_letter_row(
        reason=reason, failed_at=failed_at, message_id=row.message_id, task_name=row.task_name,
        exchange=row.exchange, routing_key=row.routing_key, body=row.body, content_type=row.content_type,
        content_encoding=row.content_encoding, headers=row.headers, properties=row.properties, **fields)


def _identifier(value: Any, column: str) -> str:
    """A name column (NOT NULL): a string escaped and cut; anything else is not a name: ''."""
    return stored_text(value, _COLUMN_SIZES[column]) if isinstance(value, str) else ""


def _optional_identifier(value: Any, column: str) -> str | None:
    return stored_text(value, _COLUMN_SIZES[column]) if isinstance(value, str) else None


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return min(max(value, 0), _INTEGER_MAX)


def _body(body: Any) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return _json(body).encode("ascii")


def stored_header_text(name: str, value: str) -> str:
    """The text a letter's stored headers hold for header ``name`` of value ``value`` (as
    ``dead_letter_row`` writes them): what ``Store.dead_letter_filter(headers_containing=...)`` finds."""
    return _json({name: value})[1:-1]


def _json_column(value: Any) -> str | None:
    if value is None:
        return None
    return stored_text(value) if isinstance(value, str) else _json(value)


class _Encoder(kombu_json.JSONEncoder):
    """kombu's JSON (datetimes, UUIDs, decimals, bytes kept), ASCII only; any other value as its ``repr``."""

    def default(self, o: Any) -> Any:
        try:
            return super().default(o)
        except TypeError:
            return _repr(o)


_encode = _Encoder(ensure_ascii=True).encode


def _json(value: Any) -> str:
    """ASCII JSON of ``value``, or the JSON string of its ``repr`` when it cannot be encoded."""
    try:
        return _encode(value)
    except Exception:  # noqa: BLE001 - keys JSON cannot hold, nesting too deep: keep what can be kept
        return _encode(_repr(value))


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails (or recurses too deep) still names the type
        return f"<{type(value).__name__}>"


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - an exception whose str() fails is still named
        return _repr(error)


def _traceback(error: BaseException) -> str:
    try:
        return "".join(traceback_module.format_exception(type(error), error, error.__traceback__))
    except Exception:  # noqa: BLE001 - a traceback that cannot be formatted leaves the type and message
        return f"{type(error).__name__}: {_safe_str(error)}"
