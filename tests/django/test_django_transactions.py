"""Publishes inside Django's ``transaction.atomic()`` join Django's transaction, on SQLite and
PostgreSQL, with a real Redis broker: durable rows are written through Django's connection in the
same transaction, and every message is published after Django's commit, never after a rollback;
outside an atomic block, behaviour is that of the SQLAlchemy side."""

from __future__ import annotations

import uuid

import pytest
from celery import chain, group
from django.db import connections, transaction
from django.test import Client
from sqlalchemy.exc import OperationalError

from celery_outbox.django.engine import django_engine
from celery_outbox.store.pipeline import _prepared_statements

from ..brokers import nothing_more, receive
from ..django_project.shop import views
from ..django_project.shop.models import Order

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)


def outgoing_rows(shop, through_django: bool = False) -> list[str]:
    """The message ids in the outgoing table: read through Django's connection (inside its open
    transaction), or through the outbox's own engine (what other connections see)."""
    table = shop.outbox.store.tables.outgoing.name
    if through_django:
        with connections[shop.using].cursor() as cursor:
            cursor.execute(f"SELECT message_id FROM {table} ORDER BY id")
            return [row[0] for row in cursor.fetchall()]
    with shop.outbox.engine.connect() as conn:
        return list(conn.exec_driver_sql(f"SELECT message_id FROM {table} ORDER BY id").scalars())


def order_id() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


def test_a_durable_message_commits_with_the_orm_write_and_is_published_after_it(shop):
    number = order_id()
    with transaction.atomic(using=shop.using):
        Order.objects.using(shop.using).create(number=number)
        shop.pay.apply_async((number,), task_id=f"pay-{number}")
        assert outgoing_rows(shop, through_django=True) == [f"pay-{number}"], "written in Django's transaction"
        if shop.using == "pg":
            assert outgoing_rows(shop) == [], "not visible before Django commits"
        assert nothing_more(shop.app, shop.durable), "nothing published before the commit"
    (message,) = receive(shop.app, shop.durable, 1)
    assert (message.id, message.args) == (f"pay-{number}", [number])
    assert Order.objects.using(shop.using).filter(number=number).exists()


def test_a_rolled_back_block_publishes_nothing_and_keeps_no_row(shop):
    number = order_id()
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=number)
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
            shop.email.delay(number)
            raise RuntimeError("the view fails")
    assert outgoing_rows(shop) == []
    assert not Order.objects.using(shop.using).filter(number=number).exists()
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


def test_a_rolled_back_savepoint_takes_back_only_its_own_messages(shop):
    kept, dropped, nested, after = order_id(), order_id(), order_id(), order_id()
    with transaction.atomic(using=shop.using):
        shop.pay.apply_async((kept,), task_id=f"pay-{kept}")
        shop.email.delay(kept)
        with transaction.atomic(using=shop.using):  # a savepoint that is released
            shop.email.delay(nested)
        with pytest.raises(RuntimeError):
            with transaction.atomic(using=shop.using):  # a savepoint that rolls back
                shop.pay.apply_async((dropped,), task_id=f"pay-{dropped}")
                shop.email.delay(dropped)
                raise RuntimeError("the inner block fails")
        shop.pay.apply_async((after,), task_id=f"pay-{after}")  # the outer block goes on
        assert outgoing_rows(shop, through_django=True) == [f"pay-{kept}", f"pay-{after}"]
    assert sorted(m.args[0] for m in receive(shop.app, shop.durable, 2)) == sorted([kept, after])
    assert sorted(m.args[0] for m in receive(shop.app, shop.plain, 2)) == sorted([kept, nested])
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


def test_plain_queue_messages_canvas_and_send_task_wait_for_the_commit(shop):
    number = order_id()
    with transaction.atomic(using=shop.using):
        shop.email.delay(number)
        chain(shop.email.si(f"{number}-a"), shop.email.si(f"{number}-b")).delay()
        group(shop.email.si(f"{number}-g1"), shop.email.si(f"{number}-g2")).delay()
        shop.app.send_task("shop.pay", (number,), task_id=f"pay-{number}")
        assert nothing_more(shop.app, shop.plain) and nothing_more(shop.app, shop.durable)
    assert sorted(m.args[0] for m in receive(shop.app, shop.plain, 4)) == sorted(
        [number, f"{number}-a", f"{number}-g1", f"{number}-g2"])
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]


def test_outside_an_atomic_block_messages_go_out_at_once(shop):
    number = order_id()
    shop.email.delay(number)
    shop.pay.apply_async((number,), task_id=f"pay-{number}")  # stored, then published: store-and-forward
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]


def test_a_block_on_another_database_is_not_joined(shop):
    """Only atomic blocks on the outbox's Django database hold its messages back."""
    other = "pg" if shop.using == "default" else "default"
    number = order_id()
    with transaction.atomic(using=other):
        shop.email.delay(number)
        assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]


def test_a_view_under_atomic_requests_commits_its_order_and_message_together(shop):
    views.SEND["payment"] = shop.pay
    client = Client()
    placed, failed = order_id(), order_id()
    assert client.get(f"/orders/{placed}/{shop.using}/").status_code == 200
    with pytest.raises(RuntimeError):
        client.get(f"/orders/{failed}/{shop.using}/?fail=1")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{placed}"]
    assert nothing_more(shop.app, shop.durable)
    assert list(Order.objects.using(shop.using).values_list("number", flat=True)) == [placed]


def test_a_connection_lost_under_the_durable_insert_raises_and_keeps_nothing(shop):
    """Django's connection killed by the server inside the block: the durable message's INSERT
    raises SQLAlchemy's ``OperationalError`` (the block then rolls back: no order, no row, nothing
    published), and the next block, on a new connection, commits and publishes as usual."""
    if shop.using != "pg":
        pytest.skip("PostgreSQL only: a SQLite connection cannot be killed from outside")
    lost, next_one = order_id(), order_id()
    with pytest.raises(OperationalError) as raised:
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=lost)
            pid = connections[shop.using].connection.info.backend_pid
            with shop.outbox.engine.connect() as other:
                assert other.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one()
            shop.pay.apply_async((lost,), task_id=f"pay-{lost}")
    assert raised.value.connection_invalidated, raised.value
    assert outgoing_rows(shop) == []
    assert not Order.objects.using(shop.using).filter(number=lost).exists()
    assert nothing_more(shop.app, shop.durable)
    with transaction.atomic(using=shop.using):
        Order.objects.using(shop.using).create(number=next_one)
        shop.pay.apply_async((next_one,), task_id=f"pay-{next_one}")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{next_one}"]


def test_the_stores_record_of_prepared_statements_is_one_per_django_connection(shop):
    """Django's engine hands Django's connection out in a new pool record each time; the store
    keeps its record of the statements it prepared with the psycopg connection itself, so that
    it is made, and psycopg's ``clear`` followed, once per connection however many blocks insert
    through it (each after an ORM write: the INSERT goes inside the open transaction)."""
    if shop.using != "pg":
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    numbers = [order_id() for _ in range(5)]
    for number in numbers:
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=number)
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
    engine = django_engine(shop.using)
    with engine.connect() as first, engine.connect() as second:
        assert first.connection.dbapi_connection is second.connection.dbapi_connection, "Django's one connection"
        assert _prepared_statements(first)[0] is _prepared_statements(second)[0], "one record, not one a block"
    prepared = connections[shop.using].connection._prepared  # psycopg's own record
    (followed,) = [cell.cell_contents for cell in prepared.clear.__closure__ if callable(cell.cell_contents)]
    assert getattr(followed, "__self__", None) is prepared, "psycopg's clear followed once, not once a block"
    assert sorted(m.id for m in receive(shop.app, shop.durable, len(numbers))) == sorted(f"pay-{n}" for n in numbers)
    assert nothing_more(shop.app, shop.durable)
