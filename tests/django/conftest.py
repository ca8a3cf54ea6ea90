"""Fixtures for celery-outbox inside Django (pytest-django, ``tests/django_project``): each test
runs on both Django databases of the project, SQLite (``default``) and PostgreSQL (``pg``)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_outbox import IdempotentTask, Outbox

from ..brokers import purge
from ..services import require

ALIASES = ["default", "pg"]


@pytest.fixture(params=ALIASES)
def using(request) -> str:
    """The Django database of the test; PostgreSQL must answer (or the test skips, or fails under
    ``CELERY_OUTBOX_REQUIRE_SERVICES=1``)."""
    if request.param == "pg":
        require("postgres")
    return request.param


@pytest.fixture
def shop(using, redis_url):
    """A Celery app configured from Django's settings, with the outbox on Django database ``using``,
    a durable queue, a plain queue and one task on each."""
    from django.conf import settings

    suffix = uuid.uuid4().hex[:8]
    durable, plain = f"dj_payments_{suffix}", f"dj_emails_{suffix}"
    app = Celery(f"djshop_{suffix}", broker=redis_url, set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    app.conf.update(task_routes={"shop.pay": {"queue": durable}, "shop.email": {"queue": plain}},
                    task_default_queue=plain)
    outbox = Outbox(app, django_database=using, durable_queues=[durable])

    @app.task(name="shop.pay", base=IdempotentTask, bind=True, shared=False)
    def pay(self, order_id):
        return order_id

    @app.task(name="shop.email", shared=False)
    def email(order_id):
        return order_id

    app.amqp.queues.select_add(durable)
    app.amqp.queues.select_add(plain)
    store = outbox.ready().store
    with store.engine.begin() as conn:  # the tables outlive a test: its rows must not
        for table in store.tables.all():
            conn.execute(table.delete())
    yield SimpleNamespace(app=app, outbox=outbox, pay=pay, email=email, durable=durable, plain=plain, using=using)
    purge(app, durable, plain)
    outbox.node.deregister()  # its heartbeat and liveness connections, as a worker's shutdown ends them
    outbox.engine.dispose()  # its connections would keep the test database from being dropped
