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
from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import DeadLetterReason

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


def place_order(pay, alias: str, before_commit=lambda: None) -> str:
    """An order created in ``alias``'s atomic block that sends its payment (task id ``pay-<number>``);
    ``before_commit`` runs last in the block. Its number."""
    number = f"{alias}-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number=number)
        pay.apply_async((number,), task_id=f"pay-{number}")
        before_commit()
    return number


def test_a_send_in_the_tenants_atomic_block_is_stored_in_its_database_and_published_after_commit(tenant_shop):
    app, outbox, pay, durable = tenant_shop

    def nothing_published_yet() -> None:
        assert nothing_more(app, durable), "nothing published before the commit"

    number = place_order(pay, "pg", before_commit=nothing_published_yet)
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

    def the_view_fails() -> None:
        raise RuntimeError("the view fails")

    with pytest.raises(RuntimeError):
        place_order(pay, "pg", before_commit=the_view_fails)
    assert stored(outbox, "acme") == [] and stored(outbox, None) == []
    assert nothing_more(app, durable)


def test_a_send_in_the_default_databases_block_stays_the_default_stores(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = place_order(pay, "default")
    (message,) = receive(app, durable, 1)
    assert TENANT_HEADER not in message.headers
    assert stored(outbox, None) == [(f"pay-{number}", None)] and stored(outbox, "acme") == []


def test_the_tenants_delivery_is_claimed_and_written_in_its_django_database(tenant_shop):
    app, outbox, pay, durable = tenant_shop
    number = place_order(pay, "pg")
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


def add_letter(outbox, tenant, message_id) -> int:
    """A dead letter of ``shop.pay`` in ``tenant``'s store; its id."""
    with using_tenant(tenant):
        store = outbox.store
        with store.begin() as conn:
            store.insert_dead_letters(conn, [dead_letter_row(
                reason=DeadLetterReason.FAILED, failed_at=utcnow(), message_id=message_id, task_name="shop.pay",
                error=ValueError("declined"))])
        (letter,) = [each for each in store.list_dead_letters(store.dead_letter_filter())
                     if each.message_id == message_id]
        return letter.id


@pytest.fixture
def admin_client(django_user_model, client):
    django_user_model.objects.create_superuser("admin", password="celery-outbox")
    client.login(username="admin", password="celery-outbox")
    return client


def test_the_admin_lists_a_tenants_rows_from_its_database_and_only_there(tenant_shop, admin_client):
    _, outbox, _, _ = tenant_shop
    add_letter(outbox, None, "default-letter")
    tenant_letter = add_letter(outbox, "acme", "acme-letter")
    default_page = admin_client.get("/admin/celery_outbox/deadletter/").content.decode()
    tenant_page = admin_client.get("/admin/celery_outbox/deadletter/?tenant=acme").content.decode()
    assert "default-letter" in default_page and "acme-letter" not in default_page
    assert "acme-letter" in tenant_page and "default-letter" not in tenant_page
    assert "acme (pg)" in default_page, "the tenant filter offers the tenant"
    detail = admin_client.get(f"/admin/celery_outbox/deadletter/{tenant_letter}/change/",
                              {"_changelist_filters": "tenant=acme"})
    assert detail.status_code == 200 and "acme-letter" in detail.content.decode()
    assert f"/{tenant_letter}/replay/?tenant=acme" in detail.content.decode(), "its buttons stay in the tenant"
    assert admin_client.get("/admin/celery_outbox/deadletter/?tenant=initech").status_code == 404


def test_the_admin_replays_a_tenants_letter_into_its_database(tenant_shop, admin_client):
    app, outbox, _, durable = tenant_shop
    letter = add_letter(outbox, "acme", "acme-replayed")
    with using_tenant("acme"):  # the letter carries its envelope: a stored message of the tenant
        store = outbox.store
        with store.begin() as conn:
            conn.execute(store.tables.dead_letters.update().values(
                body=b'[["n-1"], {}, {}]', content_type="application/json", content_encoding="utf-8",
                headers='{"id": "acme-replayed", "task": "shop.pay", "celery_outbox_tenant": "acme"}',
                queue=durable, routing_key=durable))
    reply = admin_client.post(f"/admin/celery_outbox/deadletter/{letter}/replay/?tenant=acme")
    assert reply.status_code == 302
    (message,) = receive(app, durable, 1)
    assert message.id == "acme-replayed" and message.headers[TENANT_HEADER] == "acme"
    assert [row[0] for row in stored(outbox, "acme")] == ["acme-replayed"]
    assert stored(outbox, None) == []


def test_the_status_page_shows_each_tenant(tenant_shop, admin_client):
    _, outbox, _, _ = tenant_shop
    add_letter(outbox, "acme", "acme-counted")
    page = admin_client.get("/admin/celery_outbox/status/").content.decode()
    assert 'id="outbox-tenants"' in page
    row = page.split('id="outbox-tenants"', 1)[1]
    assert "<td>acme</td>" in row and "failed 1" in row
