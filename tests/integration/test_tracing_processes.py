"""One trace across real processes: the test process sends (its spans in the SDK's in-memory
exporter) and a prefork ``celery worker`` runs the task, tracing set up in its pool process at
``worker_process_init`` by docs/monitoring.md's own snippet (its spans written by the SDK's console
exporter to a file), on Redis and PostgreSQL, with and without Celery's instrumentation on
both sides."""

from __future__ import annotations

import json
import uuid

import pytest
from celery._state import get_current_app
from opentelemetry.instrumentation.celery import CeleryInstrumentor

from celery_outbox.monitoring.tracing import Step

from .. import traces
from ..apps import traced_app
from ..brokers import purge
from ..conftest import drop_store
from ..services import wait_until
from ..workers import WorkerProcess

spans = traces.spans


@pytest.fixture(params=[False, True], ids=["outbox alone", "with celery's instrumentation"])
def instrument(request):
    return request.param


@pytest.fixture
def traced(redis_url, postgres_url, table_prefix, tmp_path, instrument):
    """The app in this process, and a prefork worker of it writing its spans to a file."""
    queue = f"traced_{uuid.uuid4().hex[:8]}"
    built = traced_app.create(redis_url, postgres_url, table_prefix, queue)
    built.outbox.ready()
    built.spans_file = tmp_path / "worker-spans.jsonl"
    env = {"TEST_BROKER_URL": redis_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": table_prefix,
           "TEST_QUEUE": queue, "TEST_SPANS_FILE": str(built.spans_file), "TEST_INSTRUMENT": "1" if instrument else "0"}
    built.queue = queue
    worker = WorkerProcess("tests.apps.traced_app", env, pool="prefork", concurrency=1, queues=[queue],
                           log_path=tmp_path / "worker.log").start()
    previous = get_current_app()
    if instrument:  # the instrumentation finds a published task in the current app's registry
        built.app.set_current()
        CeleryInstrumentor().instrument()
    try:
        worker.wait_ready()
        yield built
    finally:
        if instrument:
            CeleryInstrumentor().uninstrument()
            previous.set_current()
        worker.stop()
        purge(built.app, queue)
        drop_store(built.outbox.store)
        built.outbox.engine.dispose()


def worker_spans(built) -> list[dict]:
    text = built.spans_file.read_text() if built.spans_file.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def span_id(span) -> str:
    return f"0x{span.context.span_id:016x}"


def test_a_trace_runs_from_the_sender_through_its_publish_to_the_workers_consumer_span(traced, spans, instrument):
    with spans.tracer.start_as_current_span("request") as request:
        with traced.outbox.transaction():
            traced.note.delay("across")
    seen = wait_until(lambda: (found := worker_spans(traced)) and any(s["name"] == "body" for s in found) and found,
                      timeout=60, message=f"the worker's body span in {traced.spans_file}")
    by_name = {span["name"]: span for span in seen}
    publish = spans.one(Step.PUBLISH)
    trace_id = f"0x{request.get_span_context().trace_id:032x}"
    assert {span["context"]["trace_id"] for span in seen} == {trace_id}, "the worker's spans are in the sender's trace"
    consumers = [span for span in seen if span["kind"] == "SpanKind.CONSUMER"]
    assert len(consumers) == 1, [span["name"] for span in seen]
    (consumer,) = consumers
    if instrument:
        assert consumer["name"] == "run/traced.note", "the instrumentation's consumer span, and no second one"
        assert f"process {traced.queue}" not in by_name
    else:
        assert consumer["name"] == f"process {traced.queue}"
        assert consumer["attributes"]["messaging.operation.type"] == "process"
    assert consumer["parent_id"] == span_id(publish), "the consumer is a child of the publish that delivered it"
    claim = by_name[f"claim {traced.queue}"]
    assert claim["parent_id"] == by_name["body"]["parent_id"] == consumer["context"]["span_id"]
    assert claim["attributes"]["messaging.message.id"] == publish.attributes["messaging.message.id"]
