"""Traces with OpenTelemetry: the one module that imports it (the ``otel`` extra).

A task message carries the trace context of the code that called ``apply_async`` in its
headers (``inject``), stored with its outgoing row and published unchanged by the
commit, the relay, redelivery and recovery, so every copy a worker receives continues
the caller's trace. The inbox runs a delivery in that context (``in_delivery_context``)
unless another instrumentation (Celery's own) set one up already. Each of the outbox's
own steps is a span named by its constant below.

Without ``opentelemetry`` installed, or with no tracer provider set, no span is made and
no context is added: each call returns after one check. The context a delivery already
carries is kept for its recovery (``carried``) whenever ``opentelemetry`` is installed.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import wraps
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence, TypeVar

from .envelope import attempt_of, header_count
from .vocabulary import REDELIVERY_HEADER

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, StatusCode
except ImportError:  # the otel extra is not installed: tracing is off
    trace = None  # type: ignore[assignment]

__all__ = ["CLAIM", "DISCARD", "PUBLISH", "RECOVER", "REDELIVER", "RELAY", "STORE", "PublishSpans", "carried",
           "delivery_span", "in_delivery_context", "inject", "messages_span", "publish_span"]

STORE = "celery_outbox.store"  #: durable messages inserted in the unit of work's transaction
PUBLISH = "celery_outbox.publish"  #: published after the commit (or a durable message sent outside one)
RELAY = "celery_outbox.relay"  #: a stored message the relay published later
REDELIVER = "celery_outbox.redeliver"  #: a sent message no inbox acknowledged, published again
RECOVER = "celery_outbox.recover"  #: the stored envelope of a delivery stranded by a dead worker, published again
CLAIM = "celery_outbox.claim"  #: the inbox claims a delivery before its body runs
DISCARD = "celery_outbox.discard"  #: the inbox discards a duplicate delivery

_TRACER_NAME = "celery_outbox"
_provider: Any = None
_tracer: Any = None

F = TypeVar("F", bound=Callable[..., Any])


def _active_tracer() -> Any:
    """The outbox's tracer when a tracer provider is set, else None (then no span is ever made)."""
    global _provider, _tracer
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if provider is not _provider:
        _provider = provider
        no_op = isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
        _tracer = None if no_op else provider.get_tracer(_TRACER_NAME)
    return _tracer


def inject(headers: Any) -> None:
    """Put the current trace context into a task message's ``headers``, unless they carry one
    already (Celery's instrumentation injects its own publish span's context in
    ``before_task_publish``, after this, and replaces it)."""
    if _active_tracer() is None or not isinstance(headers, dict):
        return
    propagator = propagate.get_global_textmap()
    if not any(field in headers for field in propagator.fields):
        propagator.inject(headers)


def carried(request: Any) -> dict[str, str]:
    """The trace context fields a delivered task's ``request`` carries, for a message that
    publishes the delivery again (recovery): the copy continues the same trace."""
    if trace is None:
        return {}
    fields = propagate.get_global_textmap().fields
    return {name: value for name in fields if isinstance(value := getattr(request, name, None), str)}


def in_delivery_context(run: F) -> F:
    """Decorate ``Inbox.run(task, ...)``: the delivery runs in the trace context its message
    carries, unless a span is current already (Celery's instrumentation opened its
    ``run/<task>`` span in ``task_prerun``, or the task is called directly): one consumer
    span per delivery, never two."""

    @wraps(run)
    def traced(inbox: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        if _active_tracer() is None or trace.get_current_span().get_span_context().is_valid:
            return run(inbox, task, *args, **kwargs)
        token = otel_context.attach(propagate.extract(task.request, getter=_GETTER))
        try:
            return run(inbox, task, *args, **kwargs)
        finally:
            otel_context.detach(token)

    return traced  # type: ignore[return-value]


def delivery_span(name: str, delivery: Any) -> ContextManager[Any]:
    """A span of the inbox's step ``name`` on ``delivery`` (an ``inbox.Delivery``), current for the block."""
    tracer = _active_tracer()
    if tracer is None:
        return nullcontext()
    attributes = {**_message_attributes(delivery.message_id, delivery.task_name, delivery.queue),
                  "celery_outbox.attempt": str(delivery.attempt)}
    if delivery.redelivered:
        attributes["celery_outbox.redelivery"] = delivery.redelivered
    return tracer.start_as_current_span(name, attributes=attributes)


def messages_span(name: str, messages: Sequence[Any]) -> ContextManager[Any]:
    """A span of the step ``name`` on a batch of ``messages`` (``OutgoingMessage``), current for the block;
    a batch of one names its message."""
    tracer = _active_tracer()
    if tracer is None:
        return nullcontext()
    attributes: dict[str, Any] = {"messaging.batch.message_count": len(messages)}
    if len(messages) == 1:
        attributes.update(_outgoing_attributes(messages[0]))
    return tracer.start_as_current_span(name, attributes=attributes)


class PublishSpans:
    """The spans of one publish loop, one per message (``step``: PUBLISH, RELAY, REDELIVER or
    RECOVER), each ended with the message's outcome once the loop knows it (a batched publish
    is only sent when its batch is flushed).

    A span is a child of the context the message carries (the caller of ``apply_async``), so a
    message's publish is in the caller's trace whenever it happens; the span current in the
    loop (the relay's beat task, say), when of another trace, is linked."""

    def __init__(self, step: str):
        self._step = step
        self._tracer = _active_tracer()
        self._spans: list[tuple[Any, Any]] = []

    def start(self, message: Any) -> None:
        """Start the span of ``message``'s publish."""
        if self._tracer is None:
            return
        stored = propagate.extract(message.headers, getter=_GETTER)
        parent = trace.get_current_span(stored).get_span_context()
        current = trace.get_current_span().get_span_context()
        links = [Link(current)] if current.is_valid and current.trace_id != parent.trace_id else None
        span = self._tracer.start_span(self._step, context=stored if parent.is_valid else None,
                                       kind=SpanKind.PRODUCER, attributes=_outgoing_attributes(message),
                                       links=links)
        self._spans.append((message, span))

    def __bool__(self) -> bool:
        """Whether any span was started (none when tracing is off)."""
        return bool(self._spans)

    def end(self, errors: Mapping[int, BaseException]) -> None:
        """End every span started, each with its message's error in ``errors`` (keyed by the
        message's ``id()``; absent: published)."""
        for message, span in self._spans:
            error = errors.get(id(message))
            if error is not None:
                span.record_exception(error)
                span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
            span.end()
        self._spans = []


def publish_span(step: str, message: Any) -> ContextManager[None]:
    """The span of one message published alone (one with no row: ``Publisher._publish_plain``),
    ended with its outcome."""
    return nullcontext() if _active_tracer() is None else _publish_span(step, message)


@contextmanager
def _publish_span(step: str, message: Any) -> Iterator[None]:
    spans = PublishSpans(step)
    spans.start(message)
    try:
        yield
    except BaseException as error:
        spans.end({id(message): error})
        raise
    spans.end({})


def _message_attributes(message_id: str, task_name: str, queue: str) -> dict[str, Any]:
    return {"messaging.system": "celery", "messaging.message.id": message_id, "celery.task_name": task_name,
            "messaging.destination.name": queue}


def _outgoing_attributes(message: Any) -> dict[str, Any]:
    headers = message.headers if isinstance(message.headers, dict) else {}
    attributes = {**_message_attributes(message.message_id, message.task_name, message.destination),
                  "celery_outbox.attempt": str(attempt_of(headers))}
    if headers.get(REDELIVERY_HEADER):
        attributes["celery_outbox.redelivery"] = header_count(headers.get(REDELIVERY_HEADER))
    return attributes


class _Getter:
    """Reads the trace fields of a message's headers (a dict), or of a task's request (where
    Celery puts a delivered message's headers); a field that is not text, as any header of a
    hostile message may be, is absent."""

    @staticmethod
    def get(carrier: Any, key: str) -> list[str] | None:
        value = carrier.get(key) if isinstance(carrier, dict) else getattr(carrier, key, None)
        return [value] if isinstance(value, str) else None

    @staticmethod
    def keys(carrier: Any) -> list[str]:
        return []


_GETTER = _Getter()
