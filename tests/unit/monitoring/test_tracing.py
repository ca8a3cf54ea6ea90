"""Traces, fast: the no-op without OpenTelemetry or a tracer provider, the context a message
carries (injected once, stored with its row, kept by the inbox's envelope) and the spans of
the relay, on SQLite and kombu's in-memory transport."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from celery_outbox.consumer.delivery import envelope_of
from celery_outbox.monitoring import tracing
from celery_outbox.monitoring.tracing import Step

from ... import traces
from ...apps.factory import make_shop, outgoing, strand
from ...brokers import receive
from ...services import free_port

spans = traces.spans

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def message(headers=None):
    return SimpleNamespace(message_id="m-1", task_name="shop.pay", destination="q", headers=headers or {})


def delivery():
    return SimpleNamespace(message_id="m-1", task_name="shop.pay", queue="q", attempt=(0, 0, 1), redelivered=0)


def test_without_opentelemetry_every_call_is_a_no_op(monkeypatch):
    monkeypatch.setattr(tracing, "trace", None)
    headers = {"id": "m-1"}
    tracing.inject(headers)
    assert headers == {"id": "m-1"}
    assert tracing.carried(SimpleNamespace(traceparent=TRACEPARENT)) == {}
    assert type(tracing.delivery_span(Step.CLAIM, delivery())).__name__ == "nullcontext"
    publishes = tracing.PublishSpans(Step.PUBLISH)
    publishes.start(message())
    assert not publishes
    assert type(tracing.delivery_context(delivery(), SimpleNamespace())).__name__ == "nullcontext"
    tracing.publish_failed(Step.PUBLISH, [message()], ConnectionError("down"))


def test_with_no_tracer_provider_no_span_is_made(monkeypatch, spans):
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    with spans.tracer.start_as_current_span("request"):
        headers = {}
        tracing.inject(headers)
        with tracing.messages_span(Step.STORE, [message()]), tracing.delivery_span(Step.CLAIM, delivery()):
            publishes = tracing.PublishSpans(Step.PUBLISH)
            publishes.start(message())
        tracing.publish_failed(Step.PUBLISH, [message()], ConnectionError("down"))
    assert headers == {} and not publishes
    assert [span.name for span in spans.all()] == ["request"]


def test_inject_adds_the_current_context_only_to_headers_that_carry_none(spans):
    with spans.tracer.start_as_current_span("request") as request:
        fresh, carried = {}, {"traceparent": TRACEPARENT}
        tracing.inject(fresh)
        tracing.inject(carried)
    context = request.get_span_context()
    assert fresh["traceparent"].split("-")[1:3] == [f"{context.trace_id:032x}", f"{context.span_id:016x}"]
    assert carried == {"traceparent": TRACEPARENT}


def test_the_envelope_of_a_delivery_keeps_the_trace_context_of_its_message(spans):
    request = SimpleNamespace(id="m-1", retries=0, root_id=None, parent_id=None, group=None, eta=None, expires=None,
                              delivery_info={}, reply_to=None, traceparent=TRACEPARENT, tracestate="vendor=1")
    task = SimpleNamespace(name="shop.pay", serializer="json", app=None, request=request)
    headers = json.loads(envelope_of(task, (), {})["headers"])
    assert (headers["traceparent"], headers["tracestate"]) == (TRACEPARENT, "vendor=1")


def test_a_failed_publish_ends_its_span_with_the_error(spans):
    publishes = tracing.PublishSpans(Step.RELAY)
    failing, fine = message({"traceparent": TRACEPARENT}), message({"retries": 2, "celery_outbox_redelivery": 1})
    publishes.start(failing)
    publishes.start(fine)
    publishes.end({id(failing): ConnectionError("broker gone")})
    failed, published = spans.all()
    assert (failed.status.status_code, failed.status.description) == (StatusCode.ERROR, "ConnectionError: broker gone")
    assert [event.name for event in failed.events] == ["exception"]
    assert f"{failed.context.trace_id:032x}" == TRACEPARENT.split("-")[1], "a child of the context it carries"
    assert published.status.status_code == StatusCode.UNSET
    assert (published.attributes["celery_outbox.attempt"], published.attributes["celery_outbox.redelivery"]) == (
        "0.0.2", 1)


@pytest.mark.parametrize("headers", [{"traceparent": 7}, {"traceparent": ["00-x"]}, {"traceparent": "garbage"},
                                     ["traceparent"]])
def test_a_hostile_trace_header_makes_a_publish_span_of_the_current_trace(spans, headers):
    with spans.tracer.start_as_current_span("relay pass") as relay_pass:
        publishes = tracing.PublishSpans(Step.RELAY)
        publishes.start(SimpleNamespace(message_id="m-1", task_name="t", destination="q", headers=headers))
        publishes.end({})
    assert traces.parent_of(spans.one(Step.RELAY)) == relay_pass.get_span_context().span_id


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


def test_a_stored_message_keeps_the_callers_context_and_the_relay_publishes_it_in_that_trace(shop, spans):
    with spans.tracer.start_as_current_span("request") as request:
        (sent,) = strand(shop, "later")
    stored = json.loads(outgoing_headers(shop))["traceparent"]
    assert stored.split("-")[1] == f"{request.get_span_context().trace_id:032x}"
    assert shop.outbox.relay().published == 1
    (received,) = receive(shop.app, shop.durable_queue, 1)
    relayed, store = spans.one(Step.RELAY), spans.one(Step.STORE)
    assert ids_in(received.headers["traceparent"]) == ids_of(relayed), "the copy carries its publish's context"
    assert json.loads(outgoing_headers(shop))["traceparent"] == stored, "the row keeps the caller's"
    assert traces.parent_of(relayed) == traces.parent_of(store) == request.get_span_context().span_id
    assert (relayed.name, relayed.kind, relayed.links) == (f"publish {shop.durable_queue}", SpanKind.PRODUCER, ())
    message_attributes = {
        "messaging.system": "celery", "messaging.message.id": sent.id, "celery.task_name": "shop.durable",
        "messaging.destination.name": shop.durable_queue, "celery_outbox.attempt": "0.0.0"}
    assert dict(relayed.attributes) == {**message_attributes, "messaging.operation.name": "publish",
                                        "messaging.operation.type": "send", "celery_outbox.step": "relay"}
    assert (store.name, store.kind) == (f"store {shop.durable_queue}", SpanKind.PRODUCER)
    assert dict(store.attributes) == {**message_attributes, "messaging.batch.message_count": 1,
                                      "messaging.operation.name": "store", "messaging.operation.type": "create",
                                      "celery_outbox.step": "store"}


def outgoing_headers(shop):
    (row,) = outgoing(shop)
    return row.headers


def ids_of(span):
    """The trace and span ids of ``span``, as a ``traceparent`` header writes them."""
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def ids_in(traceparent):
    return tuple(traceparent.split("-")[1:3])


@pytest.mark.parametrize(("step", "name", "operation", "kind"), [
    (Step.PUBLISH, "publish q", ("publish", "send"), SpanKind.PRODUCER),
    (Step.RELAY, "publish q", ("publish", "send"), SpanKind.PRODUCER),
    (Step.REDELIVER, "publish q", ("publish", "send"), SpanKind.PRODUCER),
    (Step.RECOVER, "publish q", ("publish", "send"), SpanKind.PRODUCER),
])
def test_each_publish_is_a_producer_span_named_by_its_operation_and_queue(spans, step, name, operation, kind):
    publishes = tracing.PublishSpans(step)
    publishes.start(message())
    publishes.end({})
    span = spans.one(step)
    assert (span.name, span.kind) == (name, kind)
    assert (span.attributes["messaging.operation.name"], span.attributes["messaging.operation.type"]) == operation


@pytest.mark.parametrize(("step", "name", "operation", "kind"), [
    (Step.CLAIM, "claim q", ("claim", "process"), SpanKind.INTERNAL),
    (Step.DISCARD, "discard q", ("discard", "settle"), SpanKind.INTERNAL),
])
def test_the_inbox_steps_are_spans_named_by_their_operation_and_queue(spans, step, name, operation, kind):
    with tracing.delivery_span(step, delivery()):
        pass
    span = spans.one(step)
    assert (span.name, span.kind) == (name, kind)
    assert (span.attributes["messaging.operation.name"], span.attributes["messaging.operation.type"]) == operation


def test_a_stored_batch_to_several_queues_is_named_by_its_operation_alone(spans):
    other = SimpleNamespace(message_id="m-2", task_name="shop.pay", destination="r", headers={})
    with tracing.messages_span(Step.STORE, [message(), other]):
        pass
    store = spans.one(Step.STORE)
    assert store.name == "store"
    assert "messaging.destination.name" not in store.attributes
    assert store.attributes["messaging.batch.message_count"] == 2


def request_carrying(traceparent):
    return SimpleNamespace(traceparent=traceparent)


def test_a_delivery_is_a_consumer_span_child_of_the_publish_that_sent_it(spans):
    with tracing.delivery_context(delivery(), request_carrying(TRACEPARENT)):
        with tracing.delivery_span(Step.CLAIM, delivery()):
            pass
    process, claim = spans.one(Step.PROCESS), spans.one(Step.CLAIM)
    assert (process.name, process.kind) == ("process q", SpanKind.CONSUMER)
    assert (f"{process.context.trace_id:032x}", f"{traces.parent_of(process):016x}") == ids_in(TRACEPARENT)
    assert traces.parent_of(claim) == process.context.span_id
    assert (process.attributes["messaging.operation.name"], process.attributes["messaging.operation.type"]) == (
        "process", "process")
    assert process.status.status_code == StatusCode.UNSET


def test_a_failing_delivery_ends_its_consumer_span_with_the_error_but_celerys_control_exceptions_do_not(spans):
    from celery.exceptions import Ignore, Reject, Retry

    with pytest.raises(ValueError):
        with tracing.delivery_context(delivery(), request_carrying(TRACEPARENT)):
            raise ValueError("bad order")
    for control in (Ignore(), Reject("back", requeue=True), Retry("again")):
        with pytest.raises(type(control)):
            with tracing.delivery_context(delivery(), request_carrying(TRACEPARENT)):
                raise control
    failed, *controlled = spans.named(Step.PROCESS)
    assert (failed.status.status_code, failed.attributes["error.type"]) == (StatusCode.ERROR, "ValueError")
    assert [span.status.status_code for span in controlled] == [StatusCode.UNSET] * 3


def test_inside_a_current_span_a_delivery_opens_no_second_consumer_span(spans):
    with spans.tracer.start_as_current_span("run/shop.pay", kind=SpanKind.CONSUMER):
        with tracing.delivery_context(delivery(), request_carrying(TRACEPARENT)):
            pass
    assert spans.named(Step.PROCESS) == []


def test_a_durable_publish_given_up_at_the_commit_because_the_broker_is_down_ends_its_span_with_the_error(
        sqlite_url, table_prefix, spans):
    shop = make_shop(f"amqp://guest:guest@127.0.0.1:{free_port()}//", sqlite_url, table_prefix)
    shop.outbox.ready()
    with spans.tracer.start_as_current_span("request") as request:
        with shop.outbox.transaction():
            sent = shop.durable.delay("later")
    failed = spans.one(Step.PUBLISH)
    assert (failed.name, failed.status.status_code) == (f"publish {shop.durable_queue}", StatusCode.ERROR)
    assert failed.attributes["messaging.message.id"] == sent.id
    assert failed.attributes["error.type"] == "OperationalError"
    assert traces.parent_of(failed) == request.get_span_context().span_id
    assert [row.message_id for row in outgoing(shop)] == [sent.id], "the row waits for the relay"
