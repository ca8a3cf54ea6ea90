"""A worker app whose ``traced.note`` task (an ``IdempotentTask`` on a durable queue) opens a
``body`` span, traced by docs/monitoring.md's own prefork snippet (run from its Markdown): the
tracer provider set in each pool process at ``worker_process_init``, ``your_exporter`` the
SDK's console exporter writing each span, a JSON document a line, to TEST_SPANS_FILE for the
test process to read. With TEST_INSTRUMENT=1, Celery's instrumentation is on in each pool
process too.

Built from the environment (TEST_BROKER_URL, TEST_DATABASE_URL, TEST_TABLE_PREFIX, TEST_QUEUE,
TEST_SPANS_FILE, TEST_INSTRUMENT) by the worker; a test builds the same app with ``create(...)``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from celery import Celery
from celery.signals import worker_process_init
from opentelemetry import trace

from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str) -> SimpleNamespace:
    app = Celery("traced_app", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, worker_hijack_root_logger=False, outbox_database_url=database_url,
                    outbox_table_prefix=prefix, outbox_durable_queues=[queue],
                    broker_connection_retry_on_startup=False)
    outbox = Outbox(app)

    @app.task(base=IdempotentTask, name="traced.note", shared=False)
    def note(text: str) -> str:
        with trace.get_tracer("traced_app").start_as_current_span("body"):
            return text

    return SimpleNamespace(app=app, outbox=outbox, note=note)


def trace_as_the_docs_say(spans_file: str) -> None:
    """Run the Python block of docs/monitoring.md's "Traces" section here, its ``your_exporter``
    writing to ``spans_file``: it connects its receiver to ``worker_process_init``."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from tests.markdown import blocks

    (snippet,) = [block for block in blocks("docs/monitoring.md", "Traces")
                  if block.language == "python" and "worker_process_init" in block.code]
    out = open(spans_file, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    your_exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    exec(compile(snippet.code, "docs/monitoring.md", "exec"), {"your_exporter": your_exporter})


def instrument_each_pool_process() -> None:
    @worker_process_init.connect(weak=False)
    def instrument(**_: object) -> None:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()


if "TEST_QUEUE" in os.environ:
    _env = os.environ
    _built = create(_env["TEST_BROKER_URL"], _env["TEST_DATABASE_URL"], _env["TEST_TABLE_PREFIX"], _env["TEST_QUEUE"])
    app = _built.app
    outbox = _built.outbox
    trace_as_the_docs_say(_env["TEST_SPANS_FILE"])
    if _env.get("TEST_INSTRUMENT") == "1":
        instrument_each_pool_process()
