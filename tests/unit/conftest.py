"""Fixtures of the unit tests."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from .doubles import FakeOutlet, FixedClock


@pytest.fixture
def app():
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker="memory://", backend="disabled://", set_as_current=False)
    app.conf.task_default_queue = name  # the memory transport's queues are shared by the process
    yield app
    app.close()


@pytest.fixture
def fake_outlet(monkeypatch) -> FakeOutlet:
    """The broker outlet the package opens, in memory, for the test (``doubles.FakeOutlet``)."""
    return FakeOutlet().install(monkeypatch)


@pytest.fixture
def fixed_clock(monkeypatch) -> FixedClock:
    """The package's clock, standing still until the test moves it (``doubles.FixedClock``)."""
    return FixedClock().install(monkeypatch)
