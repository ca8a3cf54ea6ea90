"""Traces around a real worker (in this process, so one in-memory exporter sees both sides) on
Redis and PostgreSQL: the caller's trace continues through the commit, the relay and a
redelivery to the delivery's consumer span, its claim and the body, each consumer span a child
of the publish that delivered it; beside Celery's own instrumentation each delivery has one
consumer span."""

from __future__ import annotations

import pytest
from celery._state import get_current_app
from celery.contrib.testing.worker import start_worker
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.trace import SpanKind

from celery_outbox import IdempotentTask
from celery_outbox.monitoring.tracing import Step

from .. import traces
from ..apps.factory import make_shop, publish_failing
from ..brokers import copy_options, purge, receive
from ..conftest import drop_store
from ..services import wait_until
from ..unit.maintenance.test_recover import envelope_row

spans = traces.spans


@pytest.fixture
def make_traced_shop(redis_url, postgres_url, table_prefix, spans):
    """Makes shops whose ``shop.traced`` task (an ``IdempotentTask``) opens a ``body`` span."""
    made = []

    def make(**conf):
        shop = make_shop(redis_url, postgres_url, table_prefix, **conf)
        shop.outbox.ready()
        made.append(shop)

        @shop.app.task(base=IdempotentTask, bind=True, name="shop.traced", shared=False)
        def traced(self, note):
            with spans.tracer.start_as_current_span("body"):
                return note

        shop.traced = traced
        return shop

    yield make
    for shop in made:
        purge(shop.app, shop.durable_queue)
        drop_store(shop.outbox.store)


@pytest.fixture
def shop(make_traced_shop):
    return make_traced_shop()


def worker(shop):
    return start_worker(shop.app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                        queues=[shop.durable_queue])


def send_in_request(shop, spans, note, **options):
    """``apply_async`` in a unit of work inside a ``request`` span; the request span."""
    with spans.tracer.start_as_current_span("request") as request:
        with shop.outbox.transaction():
            shop.traced.apply_async((note,), queue=shop.durable_queue, **options)
    return request


def assert_one_trace(request, *chain):
    trace_id = request.get_span_context().trace_id
    assert [span.context.trace_id for span in chain] == [trace_id] * len(chain), [s.name for s in chain]


def test_a_message_published_at_commit_continues_the_callers_trace_to_the_claim_and_the_body(shop, spans):
    with worker(shop):
        request = send_in_request(shop, spans, "now")
        body = spans.wait_for("body")[0]
    store, publish = spans.one(Step.STORE), spans.one(Step.PUBLISH)
    process, claim = spans.one(Step.PROCESS), spans.one(Step.CLAIM)
    assert_one_trace(request, store, publish, process, claim, body)
    request_id = request.get_span_context().span_id
    assert [traces.parent_of(s) for s in (store, publish)] == [request_id] * 2
    assert traces.parent_of(process) == publish.context.span_id, "the consumer is a child of its producer"
    assert [traces.parent_of(s) for s in (claim, body)] == [process.context.span_id] * 2
    queue = shop.durable_queue
    assert [(s.name, s.kind) for s in (store, publish, process, claim)] == [
        (f"store {queue}", SpanKind.PRODUCER), (f"publish {queue}", SpanKind.PRODUCER),
        (f"process {queue}", SpanKind.CONSUMER), (f"claim {queue}", SpanKind.INTERNAL)]
    assert publish.start_time < process.start_time < claim.start_time < claim.end_time <= body.start_time
    assert body.end_time <= process.end_time
    message_id = claim.attributes["messaging.message.id"]
    assert publish.attributes["messaging.message.id"] == message_id
    delivered = {"messaging.system": "celery", "messaging.message.id": message_id, "celery.task_name": "shop.traced",
                 "messaging.destination.name": queue, "celery_outbox.attempt": "0.0.0"}
    assert dict(process.attributes) == {**delivered, "messaging.operation.name": "process",
                                        "messaging.operation.type": "process", "celery_outbox.step": "process"}
    assert dict(claim.attributes) == {**delivered, "messaging.operation.name": "claim",
                                      "messaging.operation.type": "process", "celery_outbox.step": "claim"}


def test_a_message_the_relay_publishes_later_continues_the_callers_trace(shop, spans, monkeypatch):
    publish_failing(shop, monkeypatch)
    request = send_in_request(shop, spans, "later")
    monkeypatch.undo()
    assert spans.named(Step.PUBLISH) == [], "held back: nothing published at the commit"
    with spans.tracer.start_as_current_span("relay pass") as relay_pass:
        assert shop.outbox.relay().published == 1
    with worker(shop):
        body = spans.wait_for("body")[0]
    relayed, process, claim = spans.one(Step.RELAY), spans.one(Step.PROCESS), spans.one(Step.CLAIM)
    assert_one_trace(request, spans.one(Step.STORE), relayed, process, claim, body)
    assert traces.parent_of(relayed) == request.get_span_context().span_id, "a child of the stored context"
    assert traces.parent_of(process) == relayed.context.span_id, "the relay's publish delivered it"
    assert [link.context.span_id for link in relayed.links] == [relay_pass.get_span_context().span_id]
    assert relayed.attributes["messaging.message.id"] == claim.attributes["messaging.message.id"]


def test_a_redelivered_message_continues_the_callers_trace_and_a_duplicate_is_discarded(make_traced_shop, spans):
    shop = make_traced_shop(outbox_redeliver_after=0.2)
    request = send_in_request(shop, spans, "lost", **copy_options("lost-1"))
    receive(shop.app, shop.durable_queue, 1)  # the broker loses it: no inbox acknowledges it
    wait_until(lambda: shop.outbox.recover().redelivered == 1, message="the redelivery")
    with worker(shop):
        body = spans.wait_for("body")[0]
        copy_request = send_in_request(shop, spans, "copy", **copy_options("lost-1"))  # a copy of the same send
        discard = spans.wait_for(Step.DISCARD)[0]
    redelivered = spans.one(Step.REDELIVER)
    # the copy's claim finds the handled row, in the copy's trace
    claim, copy_claim = sorted(spans.named(Step.CLAIM), key=lambda span: span.start_time)
    process, copy_process = sorted(spans.named(Step.PROCESS), key=lambda span: span.start_time)
    assert_one_trace(request, redelivered, process, claim, body)
    assert traces.parent_of(process) == redelivered.context.span_id
    copy_publish = max(spans.named(Step.PUBLISH), key=lambda span: span.start_time)
    assert traces.parent_of(copy_process) == copy_publish.context.span_id
    assert traces.parent_of(discard) == copy_process.context.span_id
    assert redelivered.attributes["celery_outbox.redelivery"] == 1
    assert claim.attributes["celery_outbox.redelivery"] == 1
    assert_one_trace(copy_request, copy_publish, copy_process, copy_claim, discard)
    assert (discard.name, discard.attributes["messaging.operation.type"]) == (f"discard {shop.durable_queue}", "settle")
    assert discard.attributes["messaging.message.id"] == "lost-1"
    assert len(spans.named("body")) == 1, "the duplicate never ran"


def test_a_recovered_envelope_continues_the_callers_trace(shop, spans):
    """The stored envelope of a delivery whose worker died is published again by recovery, in
    the trace of the code that sent it."""
    with spans.tracer.start_as_current_span("request") as request:
        task_id = envelope_row(shop, "stranded")
    assert shop.outbox.recover().envelopes_republished == 1
    with worker(shop):
        claim = spans.wait_for(Step.CLAIM)[0]
        wait_until(lambda: shop.outbox.store.get_incoming(task_id).status == "handled", message="the recovered run")
    recovered = spans.one(Step.RECOVER)
    assert_one_trace(request, recovered, claim)
    assert traces.parent_of(spans.one(Step.PROCESS)) == recovered.context.span_id
    assert traces.parent_of(recovered) == request.get_span_context().span_id
    assert recovered.attributes["messaging.message.id"] == claim.attributes["messaging.message.id"] == task_id


@pytest.fixture
def instrumented(shop):
    """Celery's instrumentation on, with the shop's app current (the instrumentation finds a
    published task in the current app's registry)."""
    previous = get_current_app()
    shop.app.set_current()
    CeleryInstrumentor().instrument()
    try:
        yield
    finally:
        CeleryInstrumentor().uninstrument()
        previous.set_current()


def test_beside_celerys_instrumentation_each_delivery_has_one_consumer_span_in_one_trace(shop, spans,
                                                                                         instrumented):
    with worker(shop):
        request = send_in_request(shop, spans, "instrumented")
        body = spans.wait_for("body")[0]
        run = spans.wait_for("run/shop.traced")[0]
    (apply_async,) = [s for s in spans.all() if s.name.startswith("apply_async/")]
    consumers = [s for s in spans.all() if s.kind == SpanKind.CONSUMER]
    assert consumers == [run], "one consumer span per delivery: the outbox opened none"
    claim, publish = spans.one(Step.CLAIM), spans.one(Step.PUBLISH)
    assert_one_trace(request, apply_async, publish, run, claim, body)
    assert traces.parent_of(apply_async) == request.get_span_context().span_id
    assert traces.parent_of(publish) == apply_async.context.span_id, "the send, then its publish after the commit"
    assert traces.parent_of(run) == publish.context.span_id, "the instrumentation's consumer, under the publish"
    assert traces.parent_of(claim) == traces.parent_of(body) == run.context.span_id
    assert [s.name for s in spans.all() if s.kind == SpanKind.PRODUCER] == [
        apply_async.name, f"store {shop.durable_queue}", f"publish {shop.durable_queue}"], "no span twice"
