"""Traces with OpenTelemetry: the one module that imports it (the ``otel`` extra).

No transaction: spans and trace context only. A task message carries its caller's context in its
headers (``inject``), kept in its outgoing row; each publish (at the commit, by the relay,
redelivery or recovery) is a PRODUCER span, a child of that context, and a worker's CONSUMER span
(``delivery_context``) is a child of the publish that delivered it. Without ``opentelemetry``, or
with no tracer provider set, each call returns after one check. Spans, attributes and how the
context travels are in docs/monitoring.md (Traces).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from enum import Enum
from typing import Any, ContextManager, Iterator, Mapping, Sequence

from celery.exceptions import Ignore, Reject, Retry

from ..vocabulary import REDELIVERY_HEADER, attempt_of, header_count

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, StatusCode
except ImportError:  # the otel extra is not installed: tracing is off
    trace = None  # type: ignore[assignment]

__all__ = ["PublishSpans", "Step", "carried", "delivery_context", "delivery_span", "inject", "messages_span",
           "publish_failed", "publish_span"]


class Step(Enum):
    """A step of the outbox that makes a span; the value is its ``celery_outbox.step``."""

    STORE = "store"  #: durable messages inserted in the unit of work's transaction (one span per commit)
    PUBLISH = "publish"  #: published after the commit (or a durable message sent outside one)
    RELAY = "relay"  #: a stored message the relay published later
    REDELIVER = "redeliver"  #: a sent message no inbox acknowledged, published again
    RECOVER = "recover"  #: the stored envelope of a delivery stranded by a dead worker, published again
    PROCESS = "process"  #: a delivery handled by the inbox, claim and body (the consumer span)
    CLAIM = "claim"  #: the inbox claims a delivery before its body runs
    DISCARD = "discard"  #: the inbox discards a duplicate delivery


#: each step's ``messaging.operation.name``, ``messaging.operation.type`` and span kind
_PUBLISHING = ("publish", "send", "PRODUCER")
_OPERATIONS = {
    Step.STORE: ("store", "create", "PRODUCER"), Step.PUBLISH: _PUBLISHING, Step.RELAY: _PUBLISHING,
    Step.REDELIVER: _PUBLISHING, Step.RECOVER: _PUBLISHING, Step.PROCESS: ("process", "process", "CONSUMER"),
    Step.CLAIM: ("claim", "process", "INTERNAL"), Step.DISCARD: ("discard", "settle", "INTERNAL"),
}
#: what a task raises to end its run in a way that is no error (Celery's control exceptions)
_NOT_ERRORS = (Ignore, Reject, Retry)

_TRACER_NAME = "celery_outbox"
_provider: Any = None
_tracer: Any = None


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


def delivery_context(delivery: Any, request: Any) -> ContextManager[Any]:
    """The consumer span ``process <queue>`` of ``delivery`` (an ``inbox.Delivery``) received
    with ``request``, current for the block (the claim and the body): a child of the context
    the message carries (the publish that sent it). None when a span is current already:
    Celery's instrumentation opened its ``run/<task>`` consumer span in ``task_prerun``, or the
    task is called inside a span; one consumer span per delivery, never two. The span ends
    with the block's error, unless it is Celery's ``Ignore``, ``Reject`` or ``Retry``."""
    tracer = _active_tracer()
    if tracer is None or trace.get_current_span().get_span_context().is_valid:
        return nullcontext()
    return _delivery_context(tracer, delivery, request)


@contextmanager
def _delivery_context(tracer: Any, delivery: Any, request: Any) -> Iterator[Any]:
    token = otel_context.attach(propagate.extract(request, getter=_GETTER))  # keeps the message's baggage too
    try:
        with _start(tracer, Step.PROCESS, delivery.queue, _delivery_attributes(delivery), current=True) as span:
            try:
                yield span
            except _NOT_ERRORS:
                raise
            except BaseException as error:
                _record(span, error)
                raise
    finally:
        otel_context.detach(token)


def delivery_span(step: Step, delivery: Any) -> ContextManager[Any]:
    """A span of the inbox's ``step`` on ``delivery`` (an ``inbox.Delivery``), current for the block."""
    tracer = _active_tracer()
    if tracer is None:
        return nullcontext()
    return _start(tracer, step, delivery.queue, _delivery_attributes(delivery), current=True, record=True)


def messages_span(step: Step, messages: Sequence[Any]) -> ContextManager[Any]:
    """A span of ``step`` on a batch of ``messages`` (``OutgoingMessage``), current for the block;
    a batch of one names its message, a batch to one queue names the queue."""
    tracer = _active_tracer()
    if tracer is None:
        return nullcontext()
    attributes: dict[str, Any] = {"messaging.batch.message_count": len(messages)}
    if len(messages) == 1:
        attributes.update(_outgoing_attributes(messages[0]))
    queues = {message.destination for message in messages}
    queue = queues.pop() if len(queues) == 1 else None
    if queue is not None:
        attributes["messaging.destination.name"] = queue
    return _start(tracer, step, queue, attributes, current=True, record=True)


class PublishSpans:
    """The spans of one publish loop, one per message (``step``: PUBLISH, RELAY, REDELIVER or
    RECOVER), each ended with the message's outcome once the loop knows it (a batched publish
    is only sent when its batch is flushed).

    A span is a child of the context the message carries (the caller of ``apply_async``), so a
    message's publish is in the caller's trace whenever it happens; the span current in the
    loop (the relay's beat task, say), when of another trace, is linked. The copy published
    carries the span's own context, for the consumer's span to be its child; a stored row
    keeps the caller's."""

    def __init__(self, step: Step):
        self._step = step
        self._tracer = _active_tracer()
        self._spans: list[tuple[Any, Any]] = []

    def start(self, message: Any) -> None:
        """Start the span of ``message``'s publish and put its context into the message's headers."""
        if self._tracer is None:
            return
        span = _start_publish(self._tracer, self._step, message)
        if isinstance(message.headers, dict):
            propagate.get_global_textmap().inject(message.headers, context=trace.set_span_in_context(span))
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
                _record(span, error)
            span.end()
        self._spans = []


def publish_span(step: Step, message: Any) -> ContextManager[None]:
    """The span of one message published alone (one with no row: ``Publisher._publish_plain``),
    ended with its outcome."""
    return nullcontext() if _active_tracer() is None else _publish_span(step, message)


@contextmanager
def _publish_span(step: Step, message: Any) -> Iterator[None]:
    spans = PublishSpans(step)
    spans.start(message)
    try:
        yield
    except BaseException as error:
        spans.end({id(message): error})
        raise
    spans.end({})


def publish_failed(step: Step, messages: Sequence[Any], error: BaseException) -> None:
    """A publish span, ended with ``error``, for each of ``messages`` whose publish was given up
    before it was tried (the broker did not answer)."""
    tracer = _active_tracer()
    if tracer is None:
        return
    for message in messages:
        span = _start_publish(tracer, step, message)
        _record(span, error)
        span.end()


def _start_publish(tracer: Any, step: Step, message: Any) -> Any:
    stored = propagate.extract(message.headers, getter=_GETTER)
    parent = trace.get_current_span(stored).get_span_context()
    current = trace.get_current_span().get_span_context()
    links = [Link(current)] if current.is_valid and current.trace_id != parent.trace_id else None
    return _start(tracer, step, message.destination, _outgoing_attributes(message),
                  context=stored if parent.is_valid else None, links=links)


def _start(tracer: Any, step: Step, queue: str | None, attributes: dict[str, Any], current: bool = False,
           record: bool = False, **options: Any) -> Any:
    """A span of ``step`` on ``queue``, named as the conventions say: ``<operation> <queue>``.
    ``current``: a context manager that makes it current (recording the block's error when
    ``record``); else the started span."""
    name, kind = _OPERATIONS[step][0], _OPERATIONS[step][2]
    attributes = {**attributes, "messaging.operation.name": name, "messaging.operation.type": _OPERATIONS[step][1],
                  "celery_outbox.step": step.value}
    span_name = f"{name} {queue}" if queue else name
    if current:
        return tracer.start_as_current_span(span_name, kind=getattr(SpanKind, kind), attributes=attributes,
                                            record_exception=record, set_status_on_exception=record, **options)
    return tracer.start_span(span_name, kind=getattr(SpanKind, kind), attributes=attributes, **options)


def _record(span: Any, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
    span.set_attribute("error.type", type(error).__qualname__)


def _message_attributes(message_id: str, task_name: str, queue: str) -> dict[str, Any]:
    return {"messaging.system": "celery", "messaging.message.id": message_id, "celery.task_name": task_name,
            "messaging.destination.name": queue}


def _delivery_attributes(delivery: Any) -> dict[str, Any]:
    attributes = {**_message_attributes(delivery.message_id, delivery.task_name, delivery.queue),
                  "celery_outbox.attempt": str(delivery.attempt)}
    if delivery.redelivered:
        attributes["celery_outbox.redelivery"] = delivery.redelivered
    return attributes


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
