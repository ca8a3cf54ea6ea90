"""Publishes inside Django's ``transaction.atomic()`` join Django's transaction, on SQLite and
PostgreSQL, with a real Redis broker: durable rows are written through Django's connection in the
same transaction, and every message is published after Django's commit, never after a rollback;
outside an atomic block, behaviour is that of the SQLAlchemy side."""

from __future__ import annotations

import uuid
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import pytest
from celery import chain, group
from django.db import DatabaseError, IntegrityError, OperationalError, connections, transaction
from django.test import Client

from celery_outbox.django.engine import django_engine
from celery_outbox.store.pipeline import prepared_statements

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
    """The durable message's row is written with Django's COMMIT, in the block's transaction (on
    PostgreSQL the row and the order carry the same transaction id), and published after it."""
    number = order_id()
    with transaction.atomic(using=shop.using):
        Order.objects.using(shop.using).create(number=number)
        shop.pay.apply_async((number,), task_id=f"pay-{number}")
        assert outgoing_rows(shop, through_django=True) == [], "written with the COMMIT, not before"
        assert nothing_more(shop.app, shop.durable), "nothing published before the commit"
    (message,) = receive(shop.app, shop.durable, 1)
    assert (message.id, message.args) == (f"pay-{number}", [number])
    assert outgoing_rows(shop) == [f"pay-{number}"]
    assert Order.objects.using(shop.using).filter(number=number).exists()
    if shop.using == "pg":
        with connections[shop.using].cursor() as cursor:
            cursor.execute(f"SELECT xmin::text FROM {Order._meta.db_table} WHERE number = %s", [number])
            (order_xid,) = cursor.fetchone()
            cursor.execute(f"SELECT xmin::text FROM {shop.outbox.store.tables.outgoing.name} WHERE message_id = %s",
                           [f"pay-{number}"])
            assert cursor.fetchone() == (order_xid,), "the row committed in the order's transaction"


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


def test_a_projects_failing_on_commit_callback_does_not_keep_the_messages_from_going_out(shop):
    """A view registers its own ``on_commit`` (a cache invalidation, not robust) before it sends:
    Django stops the block's callbacks at the first that raises, and raises its error to the view,
    but the outbox's callbacks run ahead of the project's."""
    number = order_id()

    def invalidate_cache() -> None:
        raise ConnectionError("the cache is down")

    with pytest.raises(ConnectionError, match="the cache is down"):
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=number)
            transaction.on_commit(invalidate_cache, using=shop.using)
            shop.email.delay(number)
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]


def test_a_block_whose_transaction_the_database_aborted_publishes_nothing(shop):
    """A view catches an error of a raw statement outside a nested ``atomic()``: on PostgreSQL
    the transaction is aborted, and Django's COMMIT would be a silent ROLLBACK. The block raises
    ``DatabaseError`` naming the caught error instead; nothing is published. On SQLite only the
    statement is undone, and the block commits."""
    number = order_id()
    aborts = connections[shop.using].vendor == "postgresql"
    with pytest.raises(DatabaseError, match="aborted this transaction") if aborts else nullcontext():
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=number)
            shop.email.delay(number)
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
            try:
                with connections[shop.using].cursor() as cursor:
                    cursor.execute("SELECT * FROM no_such_table")
            except DatabaseError:
                pass
    if aborts:
        assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)
        assert outgoing_rows(shop) == [] and not Order.objects.using(shop.using).filter(number=number).exists()
    else:
        assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]


def test_a_send_in_a_manual_transaction_is_refused_with_the_reason(shop):
    """``transaction.set_autocommit(False)``: the outbox cannot see the transaction's end (Django's
    ``on_commit`` refuses it as well), so a send there raises instead of going out at once."""
    from celery_outbox.errors import OutboxError

    number = order_id()
    transaction.set_autocommit(False, using=shop.using)
    try:
        Order.objects.using(shop.using).create(number=number)
        with pytest.raises(OutboxError, match=r"set_autocommit\(False\).*transaction.atomic\(\)"):
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
        transaction.rollback(using=shop.using)
    finally:
        transaction.set_autocommit(True, using=shop.using)
    assert nothing_more(shop.app, shop.durable) and outgoing_rows(shop) == []


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
    assert outgoing_rows(shop) == [f"pay-{kept}", f"pay-{after}"]
    assert sorted(m.args[0] for m in receive(shop.app, shop.durable, 2)) == sorted([kept, after])
    assert sorted(m.args[0] for m in receive(shop.app, shop.plain, 2)) == sorted([kept, nested])
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


def test_a_test_case_running_the_callbacks_without_a_commit_gets_every_message(shop):
    """A Django test case never commits: its transaction wraps the test, and
    ``captureOnCommitCallbacks(execute=True)`` runs the callbacks inside it. The durable message,
    whose INSERT waits for a COMMIT that never comes, is inserted by its callback, in the test's
    transaction, and published with the plain one."""
    from django.test import TestCase

    number = order_id()
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=shop.using):  # the test case's transaction
            with TestCase.captureOnCommitCallbacks(using=shop.using, execute=True) as callbacks:
                with transaction.atomic(using=shop.using):  # the code under test
                    Order.objects.using(shop.using).create(number=number)
                    shop.pay.apply_async((number,), task_id=f"pay-{number}")
                    shop.email.delay(number)
            assert len(callbacks) == 1, callbacks
            assert outgoing_rows(shop, through_django=True) == [f"pay-{number}"]
            assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
            assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]
            raise RuntimeError("the test case ends: its transaction rolls back")
    assert outgoing_rows(shop) == []


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


@contextmanager
def django_options(using: str, **options: Any) -> Iterator[None]:
    """Django's connection ``using`` opened afresh with ``options`` added to its ``OPTIONS``
    (psycopg's prepared statements, the isolation level), and afresh without them afterwards."""
    connection = connections[using]
    saved = dict(connection.settings_dict["OPTIONS"])
    connection.close()
    connection.settings_dict["OPTIONS"].update(options)
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = saved


# Django's connection as users configure it: its defaults (the INSERT sent in one libpq
# message, unnamed), psycopg's prepared statements on (prepared between transactions), and an
# isolation level of its own (an INSERT that opens the transaction then goes through
# SQLAlchemy's ``execute``, which sends psycopg's BEGIN with the level)
CONNECTION_OPTIONS = {
    "defaults": {},
    "prepared statements on": {"prepare_threshold": 0},
    "repeatable read": {"isolation_level": 3},  # psycopg.IsolationLevel.REPEATABLE_READ
}


def terminate_djangos_connection(shop) -> None:
    """The server ends Django's connection's session (``pg_terminate_backend``)."""
    connection = connections[shop.using]
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with shop.outbox.engine.connect() as other:
        assert other.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one()


@pytest.mark.parametrize("alone", [False, True], ids=["after the ORM's write", "alone in the block"])
@pytest.mark.parametrize("options", list(CONNECTION_OPTIONS.values()), ids=list(CONNECTION_OPTIONS))
def test_a_connection_lost_under_the_durable_insert_raises_djangos_error_and_keeps_nothing(shop, options, alone):
    """Django's connection killed by the server inside the block: the durable message's INSERT,
    sent with the block's COMMIT (alone in the block: with its BEGIN too), raises Django's
    ``OperationalError`` from the block, as the ORM raises it, caused by psycopg's (Django rolls
    back: no order, no row, nothing published), and the next block, on a new connection, commits
    and publishes as usual."""
    import psycopg

    if shop.using != "pg":
        pytest.skip("PostgreSQL only: a SQLite connection cannot be killed from outside")
    lost, next_one = order_id(), order_id()
    with django_options(shop.using, **options):
        with pytest.raises(OperationalError) as raised:
            if alone:
                terminate_djangos_connection(shop)
            with transaction.atomic(using=shop.using):
                if not alone:
                    Order.objects.using(shop.using).create(number=lost)
                    terminate_djangos_connection(shop)
                shop.pay.apply_async((lost,), task_id=f"pay-{lost}")
        assert isinstance(raised.value.__cause__, psycopg.OperationalError), repr(raised.value.__cause__)
        assert outgoing_rows(shop) == []
        assert not Order.objects.using(shop.using).filter(number=lost).exists()
        assert nothing_more(shop.app, shop.durable)
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=next_one)
            shop.pay.apply_async((next_one,), task_id=f"pay-{next_one}")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{next_one}"]


def test_a_signal_interrupting_the_insert_at_the_commit_drops_the_connection(shop, monkeypatch):
    """A signal (a soft time limit) interrupts the exchange of the durable INSERT and the COMMIT at
    the block's end: the block raises it, Django's connection is closed (its protocol state is
    unknown) and its callbacks dropped; nothing is committed or published, and the next block
    runs on a new connection."""
    if shop.using != "pg":
        pytest.skip("PostgreSQL only: the INSERT goes with the COMMIT there")
    from celery_outbox.store import pipeline

    from ..integration.test_outbox_publishing import Interrupted, interrupted_exchange

    interrupted, next_one = order_id(), order_id()
    connections[shop.using].ensure_connection()
    first = connections[shop.using].connection
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "pipeline_exchange", interrupted_exchange)
        with pytest.raises(Interrupted):
            with transaction.atomic(using=shop.using):
                Order.objects.using(shop.using).create(number=interrupted)
                shop.pay.apply_async((interrupted,), task_id=f"pay-{interrupted}")
                shop.email.delay(interrupted)
    assert connections[shop.using].connection is not first, "the interrupted connection is not reused"
    assert outgoing_rows(shop) == []
    assert not Order.objects.using(shop.using).filter(number=interrupted).exists()
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)
    with transaction.atomic(using=shop.using):
        Order.objects.using(shop.using).create(number=next_one)
        shop.pay.apply_async((next_one,), task_id=f"pay-{next_one}")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{next_one}"]


def test_a_failing_durable_insert_raises_djangos_error_for_the_drivers(shop):
    """The durable message's INSERT fails inside the block (its table renamed away in the same
    transaction): ``delay`` raises Django's class for the driver's error, as the ORM would, caused
    by the driver's own; the block rolls back (the table is back), nothing is published, and the
    next block commits and publishes."""
    connection = connections[shop.using]
    table = shop.outbox.store.tables.outgoing.name
    failed, next_one = order_id(), order_id()
    with pytest.raises(DatabaseError) as raised:
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=failed)
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
            shop.pay.apply_async((failed,), task_id=f"pay-{failed}")
    assert type(raised.value).__module__ == "django.db.utils", repr(raised.value)
    assert isinstance(raised.value.__cause__, connection.Database.Error), repr(raised.value.__cause__)
    assert table in str(raised.value)
    assert nothing_more(shop.app, shop.durable)
    with transaction.atomic(using=shop.using):
        Order.objects.using(shop.using).create(number=next_one)
        shop.pay.apply_async((next_one,), task_id=f"pay-{next_one}")
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{next_one}"]
    assert not Order.objects.using(shop.using).filter(number=failed).exists()


def test_blocks_with_psycopgs_prepared_statements_on_publish_what_they_commit(shop):
    """Django's connection with psycopg's prepared statements on (``prepare_threshold`` 0: the
    ORM's statements are prepared too, and psycopg deallocates every one on a rollback): blocks
    whose first statement is the durable INSERT, blocks that write with the ORM first, blocks
    rolled back whole and savepoints rolled back by an ``IntegrityError``, taking turns on one
    connection. The store's INSERT comes to be prepared; every committed message is stored and
    published once, in order; nothing rolled back is stored or published."""
    if shop.using != "pg":
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    orders = Order.objects.using(shop.using)

    def pay(number: str) -> str:
        return shop.pay.apply_async((number,), task_id=f"pay-{number}").id

    committed: list[str] = []
    with django_options(shop.using, prepare_threshold=0):
        for _ in range(4):
            first, second, gone, third = (order_id() for _ in range(4))
            with transaction.atomic(using=shop.using):  # the INSERT opens the transaction
                committed.append(pay(first))
                orders.create(number=first)
            with transaction.atomic(using=shop.using):  # the INSERT inside the ORM's transaction
                orders.create(number=second)
                committed.append(pay(second))
            with pytest.raises(RuntimeError):
                with transaction.atomic(using=shop.using):
                    orders.create(number=gone)
                    pay(gone)
                    raise RuntimeError("the block rolls back")
            with transaction.atomic(using=shop.using):
                orders.create(number=third)
                with pytest.raises(IntegrityError):
                    with transaction.atomic(using=shop.using):  # a savepoint
                        pay(f"{third}-again")
                        orders.create(number=third)
                committed.append(pay(third))
        with django_engine(shop.using).connect() as conn:
            prepared = prepared_statements(conn)[0]
        assert any("insert_outgoing" in name for name in prepared), prepared
    assert outgoing_rows(shop) == committed, "each committed message stored once, nothing rolled back"
    assert [m.id for m in receive(shop.app, shop.durable, len(committed))] == committed
    assert nothing_more(shop.app, shop.durable)


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
        assert prepared_statements(first)[0] is prepared_statements(second)[0], "one record, not one a block"
    prepared = connections[shop.using].connection._prepared  # psycopg's own record
    (followed,) = [cell.cell_contents for cell in prepared.clear.__closure__ if callable(cell.cell_contents)]
    assert getattr(followed, "__self__", None) is prepared, "psycopg's clear followed once, not once a block"
    assert sorted(m.id for m in receive(shop.app, shop.durable, len(numbers))) == sorted(f"pay-{n}" for n in numbers)
    assert nothing_more(shop.app, shop.durable)
