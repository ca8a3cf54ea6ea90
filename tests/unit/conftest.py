"""Fixtures of the unit tests."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery


@pytest.fixture
def app():
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker="memory://", backend="disabled://", set_as_current=False)
    app.conf.task_default_queue = name  # the memory transport's queues are shared by the process
    yield app
    app.close()
