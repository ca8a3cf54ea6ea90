"""Recording the spans a test makes: OpenTelemetry's SDK with its in-memory exporter.

The SDK's tracer provider is set once per process (OpenTelemetry allows no other); a test
records only while its ``spans`` fixture is open, so the tests after it export nothing."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_outbox.monitoring.tracing import Step

from .services import wait_until


class _Recorder(SpanProcessor):
    """Hands each ended span to the exporter of the test recording now, if any."""

    exporter: InMemorySpanExporter | None = None

    def on_end(self, span: ReadableSpan) -> None:
        if self.exporter is not None:
            self.exporter.export((span,))


_recorder = _Recorder()


def _provider() -> TracerProvider:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_celery_outbox_recorder", False):
        provider.add_span_processor(_recorder)
        provider._celery_outbox_recorder = True
    return provider


class Spans:
    """The spans ended while a test records."""

    def __init__(self, exporter: InMemorySpanExporter):
        self.exporter = exporter
        self.tracer = _provider().get_tracer("tests")

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str | Step) -> list[ReadableSpan]:
        """The spans called ``name``, or those of the outbox's step ``name`` (``celery_outbox.step``)."""
        if isinstance(name, Step):
            return [span for span in self.all() if (span.attributes or {}).get("celery_outbox.step") == name.value]
        return [span for span in self.all() if span.name == name]

    def wait_for(self, name: str | Step, count: int = 1, timeout: float = 20.0) -> list[ReadableSpan]:
        """The spans ``named(name)`` once ``count`` of them ended."""
        return wait_until(lambda: len(self.named(name)) >= count and self.named(name), timeout=timeout,
                          message=f"{count} span(s) {name!r}; ended: {[s.name for s in self.all()]}")

    def one(self, name: str | Step) -> ReadableSpan:
        (span,) = self.named(name)
        return span


def parent_of(span: ReadableSpan) -> Any:
    """The span id of ``span``'s parent, or None for a root."""
    return span.parent.span_id if span.parent is not None else None


@pytest.fixture
def spans():
    """Record the spans ended during the test."""
    exporter = InMemorySpanExporter()
    spans = Spans(exporter)
    _recorder.exporter = exporter
    try:
        yield spans
    finally:
        _recorder.exporter = None
