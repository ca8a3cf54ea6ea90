"""The result Celery would store for a message that ends as a dead letter instead of running.

Transaction boundary: none of its own; ``store_dead_letter_results`` is called after the dead
letter committed (the guard, the relay, recovery) and writes to the result backend only.
Guarantee: the caller's ``AsyncResult`` ends as plain Celery's would, with the state, the chord,
chain and errbacks Celery's worker would give it (per reason, in docs/operations.md, Dead letters);
a result backend that fails is logged, message by message, and the dead letter stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from celery.app.task import Context
from celery.backends.base import DisabledBackend
from celery.exceptions import NotRegistered, WorkerLostError
from celery.utils.objects import Bunch
from kombu.serialization import loads as kombu_loads
from kombu.serialization import prepare_accept_content
from kombu.utils import json as kombu_json

from ..core import log_fields
from ..vocabulary import DeadLetterReason
from .celery_internals import STORE_ERRORS_READS_THE_MESSAGE

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["EndedMessage", "store_dead_letter_results"]

logger = logging.getLogger("celery_outbox.results")

EXPIRED_REASON = "expired"  # the reason Celery's worker gives an expired message's REVOKED state


@dataclass(frozen=True)
class EndedMessage:
    """A message that ended in dead letters, as its result needs it: its id and task name, its
    headers and properties as sent (mappings, or stored JSON text, or None), for ``poison`` the
    error its publish failed with, and its body as sent (with its content type and encoding),
    which carries its chord, chain and errbacks."""

    message_id: str
    task_name: str
    headers: Any = None
    properties: Any = None
    error: BaseException | None = None
    body: bytes | None = None
    content_type: str | None = None
    content_encoding: str | None = None

    @classmethod
    def of_row(cls, row: Any, error: BaseException | None = None) -> "EndedMessage":
        """The message of a stored row (an outgoing row, an inbox envelope)."""
        return cls(row.message_id, row.task_name, row.headers, row.properties, error, row.body, row.content_type,
                   row.content_encoding)


def store_dead_letter_results(app: "Celery", reason: DeadLetterReason, messages: Iterable[EndedMessage]) -> int:
    """Store the result Celery would for each of ``messages``, dead-lettered for ``reason``
    (see the module docstring). Returns how many results were written. Never raises for a
    result backend that fails: each failure is logged. After a failure to reach the backend
    (its connection errors, OSError) the rest of ``messages`` is logged, not tried: a backend
    that is down holds up the caller (a relay batch) once, not once per message."""
    reason = DeadLetterReason(reason)
    if reason not in _WRITERS:
        return 0
    written = 0
    unreachable: BaseException | None = None
    for message in messages:
        if not message.message_id:
            continue  # no id to store a result under (a reduced dead letter)
        if unreachable is None:
            try:
                written += _WRITERS[reason](app, message)
                continue
            except Exception as exc:  # noqa: BLE001 - the result backend's fault: the dead letter is kept
                error: BaseException = exc
                if isinstance(exc, _connection_errors(app)):
                    unreachable = exc
        else:
            error = unreachable
        logger.error("celery-outbox: %s[%s] is dead-lettered (%s), but its result could not be stored in the "
                     "result backend; its caller is not told: %r", message.task_name, message.message_id,
                     reason.value, error, **log_fields.fields(message.message_id, message.task_name, None))
    return written


def _connection_errors(app: "Celery") -> tuple[type[BaseException], ...]:
    return (OSError, *getattr(app.backend, "connection_errors", ()))


def _unknown_task(app: "Celery", message: EndedMessage) -> int:
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        return 0
    headers, properties = _mapping(message.headers), _mapping(message.properties)
    request = Bunch(name=message.task_name, chord=None, root_id=headers.get("root_id"),
                    correlation_id=properties.get("correlation_id"), reply_to=properties.get("reply_to"),
                    errbacks=None)
    backend.mark_as_failure(message.message_id, NotRegistered(message.task_name), request=request)
    return 1


def _worker_lost(app: "Celery", message: EndedMessage) -> int:
    error = WorkerLostError(f"Worker exited prematurely: the worker running it was lost; "
                            f"recovery gave up on {message.task_name}[{message.message_id}].")
    return _failure(app, message, error)


def _poison(app: "Celery", message: EndedMessage) -> int:
    error = message.error or RuntimeError("the relay could not publish it")
    return _failure(app, message, error)


def _failure(app: "Celery", message: EndedMessage, error: BaseException) -> int:
    backend, store, request = _target(app, message)
    if backend is None or not (store or _linked(request)):
        return 0
    backend.mark_as_failure(message.message_id, error, request=request, store_result=store)
    return int(store)


def _expired(app: "Celery", message: EndedMessage) -> int:
    backend, store, request = _target(app, message)
    if backend is None or not (store or request.chord):
        return 0
    backend.mark_as_revoked(message.message_id, EXPIRED_REASON, request=request, store_result=store)
    return int(store)


def _linked(request: Context) -> bool:
    """Whether a failure of ``request`` has a chord, a chain or errbacks to tell."""
    return bool(request.chord or request.chain or request.errbacks)


def _target(app: "Celery", message: EndedMessage) -> tuple[Any, bool, Context]:
    """The task's result backend (None when disabled), whether its errors are stored (Celery's
    ``Request.store_errors``), and the request the backend writes with (``_request``)."""
    task = app.tasks.get(message.task_name)
    backend = task.backend if task is not None else app.backend
    if isinstance(backend, DisabledBackend):
        return None, False, Context()
    headers = _mapping(message.headers)
    ignore_result = headers.get("ignore_result") if STORE_ERRORS_READS_THE_MESSAGE else None
    if ignore_result is None:
        ignore_result = task.ignore_result if task is not None else False
    store = not ignore_result or bool(task is not None and task.store_errors_even_if_ignored)
    return backend, store, _request(app, message, headers)


def _request(app: "Celery", message: EndedMessage, headers: Mapping[str, Any]) -> Context:
    """The request Celery's worker gives the message's task: its headers (protocol 2), its
    properties' ``correlation_id`` and ``reply_to``, and the chord, chain and errbacks its body
    embeds (``_links``)."""
    properties = _mapping(message.properties)
    fields = {key: value for key, value in headers.items() if isinstance(key, str)}
    fields.update(id=message.message_id, task=message.task_name, name=message.task_name,
                  correlation_id=properties.get("correlation_id") or message.message_id,
                  reply_to=properties.get("reply_to"), delivery_info={}, is_eager=False,
                  **_links(app, message))
    return Context(fields)


#: the links of a message that its body embeds, and the shape each must have
_LINK_SHAPES: dict[str, type] = {"chord": Mapping, "chain": list, "errbacks": list}


def _links(app: "Celery", message: EndedMessage) -> dict[str, Any]:
    """The chord (a signature), chain and errbacks (lists of signatures) that the message's body
    embeds (protocol 2: ``[args, kwargs, embed]``), each None when absent. An unreadable body,
    or one whose links do not have those shapes, gives none: the result is stored without them
    and a warning names the message."""
    links: dict[str, Any] = dict.fromkeys(_LINK_SHAPES)
    if message.body is None:
        return links
    try:
        body = kombu_loads(message.body, message.content_type, message.content_encoding,
                           accept=prepare_accept_content(app.conf.accept_content))
        embed = body[2] if isinstance(body, (list, tuple)) and len(body) == 3 else {}
        if not isinstance(embed, Mapping):
            raise ValueError(f"its embedded links are a {type(embed).__name__}, not a mapping")
        for name, shape in _LINK_SHAPES.items():
            value = embed.get(name)
            if value is not None and not (isinstance(value, shape)
                                          and (shape is Mapping or all(isinstance(v, Mapping) for v in value))):
                raise ValueError(f"its {name!r} is not a {'signature' if shape is Mapping else 'list of signatures'}")
            links[name] = value or None
    except Exception as exc:  # noqa: BLE001 - the dead letter keeps the message; its result is still stored
        logger.warning("celery-outbox: the body of %s[%s] cannot be read (%s): its chord, chain and errbacks are not "
                       "told that it ended", message.task_name, message.message_id, exc,
                       **log_fields.fields(message.message_id, message.task_name, None))
        return dict.fromkeys(_LINK_SHAPES)
    return links


def _mapping(value: Any) -> Mapping[str, Any]:
    """Headers or properties as a mapping: as given, decoded from stored JSON, or empty."""
    if isinstance(value, (str, bytes)):
        try:
            value = kombu_json.loads(value)
        except Exception:  # noqa: BLE001 - unreadable stored JSON: no fields to copy
            return {}
    return value if isinstance(value, Mapping) else {}


_WRITERS = {
    DeadLetterReason.UNKNOWN_TASK: _unknown_task,
    DeadLetterReason.WORKER_LOST: _worker_lost,
    DeadLetterReason.EXPIRED: _expired,
    DeadLetterReason.POISON: _poison,
}
