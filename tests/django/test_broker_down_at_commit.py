"""Side by side: a Django view's order and its payment message, committed while the broker is
down. With Celery's ``delay_on_commit`` the message is lost (the order is committed, its message
never reaches the broker); with celery-outbox it waits in the outgoing table and the relay
publishes it once the broker answers again. On SQLite and PostgreSQL, with a real Redis broker
(down: a port where nothing listens)."""

from __future__ import annotations

import socket
import uuid
from functools import partial

import pytest
from celery import Celery
from celery.contrib.django.task import DjangoTask
from django.conf import settings
from django.db import transaction
from kombu.exceptions import OperationalError

from celery_outbox import IdempotentTask, Outbox

from ..brokers import nothing_more, purge, receive
from ..django_project.shop.models import Order

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)


def closed_port() -> int:
    """A local port where nothing listens: a broker that is down."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_app(broker_url: str, queue: str, outbox_on: str | None) -> tuple[Celery, object]:
    app = Celery(f"dj_{uuid.uuid4().hex[:8]}", broker=broker_url, set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    app.conf.update(task_default_queue=queue, broker_connection_retry=False,
                    task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0})
    app.amqp.queues.select_add(queue)
    if outbox_on is not None:
        Outbox(app, django_database=outbox_on, durable_queues=[queue])

    @app.task(name="shop.pay", base=DjangoTask if outbox_on is None else IdempotentTask, shared=False)
    def pay(order_id):
        return order_id

    return app, pay


def place(using: str, number: str, send) -> None:
    with transaction.atomic(using=using):
        Order.objects.using(using).create(number=number)
        send(number)


def test_delay_on_commit_loses_the_message_of_a_commit_while_the_broker_is_down(using, redis_url):
    queue, number = f"dj_down_{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex[:8]}"
    _, pay = make_app(f"redis://127.0.0.1:{closed_port()}/0", queue, None)
    # what delay_on_commit does, on the database of the block
    send = pay.delay_on_commit if using == "default" else (
        lambda n: transaction.on_commit(partial(pay.delay, n), using=using))
    with pytest.raises(OperationalError):
        place(using, number, send)
    assert Order.objects.using(using).filter(number=number).exists(), "the order committed"
    back, _ = make_app(redis_url, queue, None)  # the broker answers again: nothing comes
    try:
        assert nothing_more(back, queue), "the message of a committed order never reaches the broker"
    finally:
        purge(back, queue)


def test_celery_outbox_keeps_it_and_the_relay_publishes_it_when_the_broker_is_back(using, redis_url):
    queue, number = f"dj_down_{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex[:8]}"
    down, pay = make_app(f"redis://127.0.0.1:{closed_port()}/0", queue, using)
    place(using, number, lambda n: pay.apply_async((n,), task_id=f"pay-{n}"))  # the commit stands
    assert Order.objects.using(using).filter(number=number).exists()
    back, _ = make_app(redis_url, queue, using)  # the same store, the broker answering
    try:
        relayed = Outbox(back).relay()
        assert relayed.published == 1 and relayed.broker_error is None
        (message,) = receive(back, queue, 1)
        assert (message.id, message.args) == (f"pay-{number}", [number])
    finally:
        purge(back, queue)
        for app in (down, back):
            Outbox(app).engine.dispose()
