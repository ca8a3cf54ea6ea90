"""A tenant placed in a Django database (``outbox_tenants = {"acme": {"django": "pg"}}``), beside the
default store in Django's ``default`` (SQLite), with a real Redis broker: a send inside
``transaction.atomic(using="pg")`` is the tenant's, stored in the tenant's database in the block's
transaction and published after its commit, never after its rollback; ``outbox.transaction(tenant=)``
and ``using_tenant`` name it too; and the inbox claims the tenant's deliveries in its database, in
the Django transaction of the task's ORM writes."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.db import connections, transaction

from celery_outbox import TENANT_HEADER, IdempotentTask, Outbox, current_tenant, using_tenant

from ..brokers import nothing_more, purge, receive
from ..django_project.shop.models import Order
from ..services import require
from ..waiting import wait_until

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)


@pytest.fixture
def tenant_shop(redis_url):
    """An outbox on Django's ``default`` database with tenant ``acme`` in Django's ``pg``."""
    from django.conf import settings

    require("postgres")
    suffix = uuid.uuid4().hex[:8]
    durable = f"djt_payments_{suffix}"
    app = Celery(f"djtenants_{suffix}", broker=redis_url, set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    app.conf.update(task_default_queue=durable, broker_transport_options={"polling_interval": 0.01})
    outbox = Outbox(app, django_database="default", durable_queues=[durable], tenants={"acme": {"django": "pg"}})

    @app.task(name="shop.pay", base=IdempotentTask, bind=True, shared=False)
    def pay(self, number):
        Order.objects.using("pg" if current_tenant() == "acme" else "default").create(number=f"{number}-paid")
        return number

    app.amqp.queues.select_add(durable)
    for tenant in (None, "acme"):
        with using_tenant(tenant):
            store = outbox.ready().store
            with store.engine.begin() as conn:
                for table in store.tables.all():
                    conn.execute(table.delete())
    yield app, outbox, pay, durable
    purge(app, durable)
    outbox.nodes.deregister()
    for tenant in (None, "acme"):
        with using_tenant(tenant):
            outbox.engine.dispose()


def stored(outbox, tenant) -> list[tuple[str, str | None]]:
    """(message id, tenant header) of each outgoing row of ``tenant``'s store."""
    from kombu.utils.json import loads

    with using_tenant(tenant):
        table = outbox.store.tables.outgoing
        with outbox.engine.connect() as conn:
            return [(row.message_id, loads(row.headers).get(TENANT_HEADER)) for row in conn.execute(table.select())]


def test_a_send_in_the_tenants_atomic_block_is_stored_in_its_database_and_published_after_commit(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = f"t-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using="pg"):
        Order.objects.using("pg").create(number=number)
        pay.apply_async((number,), task_id=f"pay-{number}")
        assert nothing_more(app, durable), "nothing published before the commit"
    (message,) = receive(app, durable, 1)
    assert message.id == f"pay-{number}" and message.headers[TENANT_HEADER] == "acme"
    assert stored(outbox, "acme") == [(f"pay-{number}", "acme")]
    assert stored(outbox, None) == [], "nothing in the default store"
    with connections["pg"].cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {Order._meta.db_table} WHERE number = %s", [number])
        (order_xid,) = cursor.fetchone()
        cursor.execute(f"SELECT xmin::text FROM {outbox.store.tables.outgoing.name} WHERE message_id = %s",
                       [f"pay-{number}"])
        assert cursor.fetchone() == (order_xid,), "the row committed in the order's transaction"


def test_a_rolled_back_tenant_block_publishes_nothing_and_stores_nothing(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = f"t-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError), transaction.atomic(using="pg"):
        Order.objects.using("pg").create(number=number)
        pay.apply_async((number,), task_id=f"pay-{number}")
        raise RuntimeError("the view fails")
    assert stored(outbox, "acme") == [] and stored(outbox, None) == []
    assert nothing_more(app, durable)


def test_a_send_in_the_default_databases_block_stays_the_default_stores(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = f"d-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using="default"):
        Order.objects.using("default").create(number=number)
        pay.apply_async((number,), task_id=f"pay-{number}")
    (message,) = receive(app, durable, 1)
    assert TENANT_HEADER not in message.headers
    assert stored(outbox, None) == [(f"pay-{number}", None)] and stored(outbox, "acme") == []


def test_the_tenants_delivery_is_claimed_and_written_in_its_django_database(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = f"w-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using="pg"):
        Order.objects.using("pg").create(number=number)
        pay.apply_async((number,), task_id=f"pay-{number}")
    with using_tenant("acme"):
        store = outbox.store

    def handled() -> bool:
        row = store.get_incoming(f"pay-{number}")
        return row is not None and row.status == "handled"

    with start_worker(app, pool="solo", perform_ping_check=False, queues=[durable]):
        wait_until(handled, timeout=30, message="the tenant's claim handled")
    assert Order.objects.using("pg").filter(number=f"{number}-paid").exists(), "written in the tenant's database"
    assert not Order.objects.using("default").filter(number=f"{number}-paid").exists()
    assert outbox.runtime.default_store.get_incoming(f"pay-{number}") is None, "no claim in the default store"
