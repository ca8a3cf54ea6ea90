"""Routing on real Redis and RabbitMQ with a real worker and PostgreSQL: a message routed to a
durable queue by exchange and routing key, by task_routes, by a topic binding or by a Queue object
is stored in the sender's transaction, lands in that queue, and its consumer keeps its envelope in
the inbox under the same queue (on RabbitMQ the delivery names only the exchange and routing key)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import event, select

from celery_outbox.signals import message_published

from ..apps import routing_app
from ..brokers import purge
from ..conftest import drop_store, handled_row
from ..services import require, wait_until
from ..workers import WorkerProcess


@pytest.fixture(params=["redis", "rabbitmq"])
def shop(request, postgres_url, table_prefix, tmp_path):
    broker_url = require(request.param)
    suffix = uuid.uuid4().hex[:8]
    shop = routing_app.create(broker_url, postgres_url, table_prefix, suffix)
    shop.outbox.ready()
    env = {"TEST_BROKER_URL": broker_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": table_prefix,
           "TEST_SUFFIX": suffix}
    n = shop.names
    worker = WorkerProcess("tests.apps.routing_app", env, queues=[n["plain"], n["pay"], n["audit"]],
                           log_path=tmp_path / "worker.log").start()
    try:
        worker.wait_ready()
        yield shop
    finally:
        worker.stop(cold=True)
        purge(shop.app, n["plain"], n["pay"], n["audit"])
        _delete_exchanges(shop)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()


def test_messages_routed_every_way_to_a_durable_queue_are_stored_and_kept_in_the_inbox(shop):
    n, app = shop.names, shop.app
    committed: dict[str, str | None] = {}
    published: dict[str, bool] = {}

    def on_published(sender, message, relayed, **_):
        published[message.message_id] = relayed

    sends = {
        "exchange and routing key": (lambda: shop.record.apply_async(("a",), exchange=n["payex"],
                                                                     routing_key=n["paykey"]), n["pay"]),
        "task_routes": (lambda: shop.routed.delay("b"), n["pay"]),
        "topic binding": (lambda: shop.record.apply_async(("c",), exchange=n["events"],
                                                          routing_key="payment.card"), n["audit"]),
        "Queue object": (lambda: shop.record.apply_async(("d",), queue=app.amqp.queues[n["pay"]]), n["pay"]),
    }
    message_published.connect(on_published)
    try:
        with shop.outbox.transaction() as session:
            expected = {send().id: queue for send, queue in sends.values()}

            @event.listens_for(session, "after_commit")
            def read_the_rows(_session):  # committed, not yet published: no consumer can have taken a row
                committed.update({task_id: _outgoing_destination(shop, task_id) for task_id in expected})
    finally:
        message_published.disconnect(on_published)
    assert committed == expected, "each row was committed by the sender's commit, for its durable queue"
    assert published == dict.fromkeys(expected, False), "then the sender published each, not the relay"
    for task_id, queue in expected.items():
        row = wait_until(lambda task_id=task_id, queue=queue: handled_row(shop.outbox.store, task_id, queue),
                         timeout=60, message=f"{task_id} to be handled from {queue}")
        assert row.queue == queue and row.body, "the consumer keeps the envelope, under the durable queue"
    wait_until(lambda: all(_outgoing_destination(shop, task_id) is None for task_id in expected), timeout=30,
               message="the consumer to acknowledge each outgoing row under the queue the sender stored it for")


def _outgoing_destination(shop, message_id: str) -> str | None:
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.engine.connect() as conn:
        return conn.execute(select(table.c.destination).where(table.c.message_id == message_id)).scalar()


def _delete_exchanges(shop) -> None:
    with shop.app.connection_for_write() as connection:
        for exchange in shop.exchanges:
            try:
                exchange(connection.default_channel).delete()
            except Exception:  # noqa: BLE001 - an exchange the broker never had is fine
                pass
