"""Traces, fast: the no-op without OpenTelemetry or a tracer provider, the context a message
carries (injected once, stored with its row, kept by the inbox's envelope) and the spans of
the relay, on SQLite and kombu's in-memory transport."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from celery_outbox import tracing
from celery_outbox.delivery import envelope_of

from .. import traces
from ..apps.factory import make_shop, strand
from ..brokers import receive
from .test_durability import outgoing

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
    assert type(tracing.delivery_span(tracing.CLAIM, delivery())).__name__ == "nullcontext"
    publishes = tracing.PublishSpans(tracing.PUBLISH)
    publishes.start(message())
    assert not publishes
    assert tracing.in_delivery_context(lambda inbox, task: "ran")(None, None) == "ran"


def test_with_no_tracer_provider_no_span_is_made(monkeypatch, spans):
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    with spans.tracer.start_as_current_span("request"):
        headers = {}
        tracing.inject(headers)
        with tracing.messages_span(tracing.STORE, [message()]), tracing.delivery_span(tracing.CLAIM, delivery()):
            publishes = tracing.PublishSpans(tracing.PUBLISH)
            publishes.start(message())
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
    publishes = tracing.PublishSpans(tracing.RELAY)
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
        publishes = tracing.PublishSpans(tracing.RELAY)
        publishes.start(SimpleNamespace(message_id="m-1", task_name="t", destination="q", headers=headers))
        publishes.end({})
    assert traces.parent_of(spans.one(tracing.RELAY)) == relay_pass.get_span_context().span_id


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


def test_a_stored_message_keeps_the_callers_context_and_the_relay_publishes_it_in_that_trace(shop, spans):
    with spans.tracer.start_as_current_span("request") as request:
        (sent,) = strand(shop, "later")
    (row,) = outgoing(shop)
    stored = json.loads(row.headers)["traceparent"]
    assert stored.split("-")[1] == f"{request.get_span_context().trace_id:032x}"
    assert shop.outbox.relay().published == 1
    (received,) = receive(shop.app, shop.durable_queue, 1)
    assert received.headers["traceparent"] == stored, "published unchanged"
    relayed, store = spans.one(tracing.RELAY), spans.one(tracing.STORE)
    assert traces.parent_of(relayed) == traces.parent_of(store) == request.get_span_context().span_id
    assert relayed.kind == SpanKind.PRODUCER and relayed.links == ()
    assert dict(relayed.attributes) == {
        "messaging.system": "celery", "messaging.message.id": sent.id, "celery.task_name": "shop.durable",
        "messaging.destination.name": shop.durable_queue, "celery_outbox.attempt": "0.0.0"}
    assert dict(store.attributes) == {**relayed.attributes, "messaging.batch.message_count": 1}
