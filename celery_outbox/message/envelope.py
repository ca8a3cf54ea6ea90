"""The fully built message: captured from Celery's sender, stored as a row, published again.

No transaction: the store writes the rows this module builds. ``capture`` runs Celery's own
``send_task_message`` against a recording producer, so routing, headers, properties, signals and
serialisation are exactly Celery's; only the final ``producer.publish`` is recorded instead of
sent. The body is serialised (and compressed) at call time: what is published after the commit is
what the caller passed at the time of the call. Rows hold the body as bytes and headers and
properties as kombu JSON (which keeps datetimes, UUIDs and decimals); nothing is pickled.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from operator import attrgetter, le
from typing import Any, Callable

from kombu import Queue
from kombu.compression import compress
from kombu.serialization import dumps
from kombu.utils import json as kombu_json
from sqlalchemy import Column, Table

from ..errors import UnstorableMessage
from ..store import SEND_ID_SIZE, as_utc, text_problem
from ..vocabulary import SEND_HEADER, header_count
from .celery_internals import without_callback_publish_retry
from .routing import exchange_name
from .sent_events import RecordingDispatcher, SentEvent

__all__ = ["SEND_HEADER", "CapturingProducer", "OutgoingMessage", "capture", "check_storable", "from_row", "json_text",
           "new_send_id", "send_id_of"]

# the arguments ``OutgoingMessage.publish`` gives kombu's ``Producer.publish`` itself
_PUBLISH_ARGUMENTS = frozenset({"body", "content_type", "content_encoding", "exchange", "routing_key", "headers"})


#: ``kombu.utils.json.dumps`` (the same text: datetimes, UUIDs and decimals kept) with one encoder
#: for every call instead of a new one per call, as ``json.dumps`` does for its default arguments
json_text = kombu_json.JSONEncoder().encode

# publish() keywords that are about how to send, not what the message is
_SENDING_OPTIONS = ("retry", "retry_policy", "timeout", "confirm_timeout", "declare")


@dataclass
class OutgoingMessage:
    """One message ready for ``producer.publish``: body bytes plus routing and properties."""

    message_id: str
    task_name: str
    destination: str
    body: bytes
    content_type: str
    content_encoding: str
    exchange: str
    routing_key: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    sending: dict[str, Any] = field(default_factory=dict)  # retry, retry_policy, declare (live entities), timeouts
    durable: bool = False
    survives_rollback: bool = False  # a retry/replace of the running task: Celery already decided it
    row_id: int | None = None
    marked_sent: bool = False  # its row was stored marked sent, for the commit-time publisher to publish
    expires_at: datetime | None = None
    deliver_at: datetime | None = None  # durable scheduling: its eta, held in the store until released
    sent_event: SentEvent | None = None  # the task-sent event of this send, published after it (never stored)
    committed_at: datetime | None = None  # when its unit of work committed (a stored row: when it was stored)

    def make_durable(self) -> None:
        """Mark for the outgoing table: the eta header stays (the worker holds the message until
        then, as in Celery) and is copied to ``deliver_at``, which holds the message in the
        database until ``OutboxSettings.release_before`` releases it; ``expires`` becomes
        ``expires_at``."""
        self.durable = True
        self.deliver_at = _timestamp(self.headers.get("eta"))
        self.expires_at = _timestamp(self.headers.get("expires"))

    def is_due(self, now: datetime) -> bool:
        return self.deliver_at is None or self.deliver_at <= now

    def publish(self, producer, retry: bool | None = None, entities: Any = None) -> None:
        """Publish with ``producer``; ``retry=False`` fails fast (the relay will try again).
        ``entities`` (a ``BoundQueues``) binds the entities to declare once per channel."""
        options = dict(self.sending)
        if retry is not None:
            options["retry"] = retry
        if entities is not None and options.get("declare"):
            options["declare"] = entities.bind(options["declare"])
        # a stored envelope's properties (a dead letter's, a row another writer made) never override
        # what the message says of itself, nor clash with the publish's own arguments
        properties = {key: value for key, value in self.properties.items()
                      if key not in _PUBLISH_ARGUMENTS and key not in options}
        producer.publish(
            self.body,
            content_type=self.content_type,
            content_encoding=self.content_encoding,
            exchange=self.exchange,
            routing_key=self.routing_key,
            headers=dict(self.headers),
            **options,
            **properties,
        )

    def to_row(self, now: datetime) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "task_name": self.task_name,
            "destination": self.destination,
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "body": self.body,
            "content_type": self.content_type,
            "content_encoding": self.content_encoding,
            "headers": json_text(self.headers),
            "properties": json_text(self.properties),
            "send_id": send_id_of(self.headers),
            "nesting": header_count(self.headers.get("replaced_task_nesting")),
            "replays": header_count(self.headers.get("celery_outbox_replay")),
            "retries": header_count(self.headers.get("retries")),
            "created_at": now,
            "expires_at": self.expires_at,
            "deliver_at": self.deliver_at,
        }


#: the text fields of an outgoing row that come from the caller, in the caller's words
_CALLER_FIELDS = {"message_id": "task id", "task_name": "task name", "destination": "queue name",
                  "exchange": "exchange name", "routing_key": "routing key", "content_type": "content type",
                  "content_encoding": "content encoding"}


def check_storable(message: OutgoingMessage, outgoing: Table) -> None:
    """Raise ``UnstorableMessage`` when a text field of ``message`` does not fit its column of the
    ``outgoing`` table, naming the field, the value and the limit."""
    values_of, limits = _caller_limits(outgoing)
    if _plainly_storable(values_of(message), limits):
        return
    for field_name, caller_name, column in _caller_columns(outgoing):
        value = getattr(message, field_name)
        problem = text_problem(column, value)
        if problem is not None:
            shown = value if len(value) <= 80 else f"{value[:80]}..."
            raise UnstorableMessage(
                f"celery-outbox: cannot store the message {message.task_name[:80]!r} for durable queue "
                f"{message.destination[:80]!r}: its {caller_name} {shown!r} cannot be stored: {problem}")


@functools.lru_cache(maxsize=16)
def _caller_columns(outgoing: Table) -> tuple[tuple[str, str, Column], ...]:
    """The fields ``check_storable`` checks, each with its caller's name for it and its column of
    ``outgoing``: looked up once per table, not per message."""
    return tuple((name, caller_name, outgoing.c[name]) for name, caller_name in _CALLER_FIELDS.items())


@functools.lru_cache(maxsize=16)
def _caller_limits(outgoing: Table) -> tuple[Callable[[Any], tuple[Any, ...]], tuple[int, ...]]:
    """A function taking the fields ``check_storable`` checks from a message, and each one's
    length limit in ``outgoing`` (``sys.maxsize`` where the column sets none)."""
    columns = _caller_columns(outgoing)
    limits = tuple(getattr(column.type, "length", None) or sys.maxsize for _, _, column in columns)
    return attrgetter(*(name for name, _, _ in columns)), limits


def _plainly_storable(values: tuple[Any, ...], limits: tuple[int, ...]) -> bool:
    """Whether every value is ASCII text within its limit and without a NUL character, checked at
    once: then ``text_problem`` finds nothing in any of them (nearly every message)."""
    try:
        joined = "".join(values)
    except TypeError:  # a value that is not text: the field-by-field check says what it is
        return False
    return joined.isascii() and "\x00" not in joined and all(map(le, map(len, values), limits))


def new_send_id() -> str:
    """A fresh publish identity: 128 random bits in 32 hex digits."""
    return os.urandom(16).hex()


def send_id_of(headers: Any) -> str:
    """The publish identity a message's headers carry; '' when absent or not one the store can hold
    (a message from a sender without the outbox: its task id alone is its key)."""
    return valid_send_id(headers.get(SEND_HEADER) if isinstance(headers, dict) else None)


def valid_send_id(value: Any) -> str:
    """``value`` when it is a publish identity the store can hold, else ''."""
    if isinstance(value, str) and 0 < len(value) <= SEND_ID_SIZE and value.isascii() and value.isprintable():
        return value
    return ""


def _timestamp(value: Any) -> datetime | None:
    """A header's ``eta``/``expires`` (ISO text or datetime) as an aware UTC datetime."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:  # Celery writes naive times in UTC when enable_utc is on (its default)
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


class CapturingProducer:
    """Given to Celery's ``send_task`` for a send a unit of work captures, in place of a producer
    from the app's pool: Celery hands it to the sender, which ``capture`` runs against a
    ``_RecordingProducer``, so nothing is published through it and no pooled producer is taken
    and given back for the capture (the publish after the commit takes the one it uses).
    ``connection`` is a connection of the app's broker that never connects: Celery's
    ``send_task`` only enters its ``_reraise_as_library_errors()``. Anything else Celery asks of
    it raises, naming what was asked."""

    def __init__(self, connection: Any):
        self.connection = connection

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"celery-outbox: a send captured by a unit of work asked its stand-in producer for "
                             f"{name!r}, which only a pooled producer has")


class _RecordingProducer:
    """Stands in for a kombu Producer while Celery's sender runs: records each publish."""

    def __init__(self, real_producer: Any):
        self.records: list[tuple[Any, dict[str, Any]]] = []
        self._real = real_producer

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.records.append((body, kwargs))

    def __getattr__(self, name: str) -> Any:  # connection, channel, ... of the real producer
        return getattr(self._real, name)


def _serialise(body: Any, kwargs: dict[str, Any]) -> tuple[bytes, str, str]:
    content_type = kwargs.pop("content_type", None)
    content_encoding = kwargs.pop("content_encoding", None)
    serializer = kwargs.pop("serializer", None)
    compression = kwargs.pop("compression", None)
    if not content_type:
        content_type, content_encoding, body = dumps(body, serializer=serializer)
    if isinstance(body, str):
        content_encoding = content_encoding or "utf-8"
        body = body.encode(content_encoding)
    elif not content_encoding:
        content_encoding = "binary"
    if compression:
        body, kwargs.setdefault("headers", {})["compression"] = compress(body, compression)
    return body, content_type, content_encoding


def capture(
    sender: Callable[..., Any],
    producer: Any,
    name: str,
    message: Any,
    options: dict[str, Any],
    event_dispatcher: Callable[[], Any] | None = None,
) -> list[OutgoingMessage]:
    """Run Celery's sender against a recording producer; return the messages it would publish,
    each with its routing key as its destination until a durable queue is found for it.

    The task message comes first. Its ``task-sent`` event, when enabled, is not a message of
    the list: the sender's call to the event dispatcher (the caller's ``event_dispatcher``
    option, else the one ``event_dispatcher()`` returns, Celery's default) is recorded as the
    task message's ``sent_event``, which the publisher sends after it. A message of protocol 1
    takes its id and task name from its body (protocol 2 has them in its headers).
    """
    recorder = _RecordingProducer(producer)
    events = None
    if getattr(message, "sent_event", None) and event_dispatcher is not None:
        events = RecordingDispatcher(options.get("event_dispatcher") or event_dispatcher())
        options = {**options, "event_dispatcher": events}
    with without_callback_publish_retry():  # Celery >= 5.7 retries worker callbacks itself; we defer
        sender(recorder, name, message, **options)
    captured = []
    for body, kwargs in recorder.records:
        kwargs = dict(kwargs)
        payload, content_type, content_encoding = _serialise(body, kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        exchange = exchange_name(kwargs.pop("exchange", ""))
        routing_key = kwargs.pop("routing_key", "") or ""
        sending = {key: kwargs.pop(key) for key in _SENDING_OPTIONS if key in kwargs}
        named = headers if "id" in headers else _protocol_1_body(body) or headers
        captured.append(
            OutgoingMessage(
                message_id=str(named.get("id") or ""),
                task_name=str(named.get("task") or name),
                destination=routing_key,
                body=payload,
                content_type=content_type,
                content_encoding=content_encoding,
                exchange=exchange,
                routing_key=routing_key,
                headers=headers,
                properties=kwargs,
                sending=sending,
            )
        )
    if events is not None and events.events and captured:
        captured[0].sent_event = events.events[0]
    return captured


def _protocol_1_body(body: Any) -> dict[str, Any] | None:
    """The body of a task message of protocol 1 (``task_protocol = 1``), which carries the task's
    id and name itself (its headers are empty), or None."""
    if isinstance(body, dict) and "id" in body and "task" in body:
        return body
    return None


def from_row(row: Any, queues: Any) -> OutgoingMessage:
    """Rebuild a stored message (an outgoing row, a dead letter or an inbox envelope);
    ``queues`` (``app.amqp.queues``) declares its queue."""
    fields = getattr(row, "_fields", None)  # a Row raises and catches an exception for a column it lacks

    def column(name: str) -> Any:
        return getattr(row, name) if fields is None or name in fields else None

    queue = column("queue") or row.destination
    declare: list[Queue] = []
    if queue:
        try:
            declare = [queues[queue]]
        except KeyError:
            declare = []
    return OutgoingMessage(
        message_id=row.message_id,
        task_name=row.task_name,
        destination=queue or "",
        body=bytes(row.body) if row.body is not None else b"",
        content_type=row.content_type or "application/data",
        content_encoding=row.content_encoding or "binary",
        exchange=row.exchange or "",
        routing_key=row.routing_key or "",
        headers=kombu_json.loads(row.headers) if row.headers else {},
        properties=kombu_json.loads(row.properties) if row.properties else {},
        sending={"declare": declare},
        durable=True,
        row_id=column("id"),
        expires_at=as_utc(column("expires_at")),
        deliver_at=as_utc(column("deliver_at")),
        committed_at=as_utc(column("created_at")),
    )
