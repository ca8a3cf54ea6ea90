"""Async units of work against real services: PostgreSQL through psycopg's async mode and through
asyncpg, with Redis and with RabbitMQ as the broker.

The fast checks (aiosqlite, memory://) are in tests/unit/producer/test_async_unit_of_work.py; the
fault drills of an async producer in tests/faults/test_async_producer.py.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from celery_outbox.errors import TransactionAborted

from ..apps.factory import make_shop
from ..brokers import nothing_more, purge, receive
from ..conftest import drop_store, outgoing_rows
from ..services import require


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request) -> str:
    return require(request.param)


@pytest.fixture(params=["psycopg", "asyncpg"])
def shop(request, broker_url, postgres_url, table_prefix):
    conf = {"outbox_async_database_url": postgres_url.replace("+psycopg", "+asyncpg")} \
        if request.param == "asyncpg" else {}
    shop = make_shop(broker_url, postgres_url, table_prefix, **conf)
    shop.outbox.ready()
    yield shop
    purge(shop.app, shop.plain_queue, shop.durable_queue)
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {table_prefix}orders"))
    drop_store(shop.outbox.store)
    shop.outbox.engine.dispose()


@pytest.fixture(params=["session", "connection"])
def unit(request):
    return lambda shop: shop.outbox.atransaction() if request.param == "session" else shop.outbox.abegin()


def orders_table(shop) -> str:
    name = f"{shop.outbox.settings.table_prefix}orders"
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {name} (id INTEGER PRIMARY KEY)"))
    return name


def test_the_durable_row_commits_with_the_units_writes_and_everything_is_published_after(shop, unit):
    orders = orders_table(shop)

    async def place() -> list[str]:
        async with unit(shop) as conn_or_session:
            await conn_or_session.execute(text(f"INSERT INTO {orders} VALUES (1)"))
            ids = [shop.durable.delay(1).id, shop.plain.delay(2).id, shop.durable.delay(3).id]
            await conn_or_session.execute(text("SELECT 1"))  # after the sends: still nothing stored
            assert outgoing_rows(shop.outbox.store) == (0, 0), "another connection sees no row before the commit"
            assert nothing_more(shop.app, shop.durable_queue)
        return ids

    first, plain, third = asyncio.run(place())
    assert [m.id for m in receive(shop.app, shop.durable_queue, 2)] == [first, third]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [plain]
    assert outgoing_rows(shop.outbox.store) == (2, 0), "stored marked sent, kept until an inbox acknowledges them"
    with shop.outbox.engine.connect() as conn:
        assert conn.execute(text(f"SELECT id FROM {orders}")).scalars().all() == [1]


def test_a_rolled_back_unit_leaves_no_row_and_no_message(shop, unit):
    orders = orders_table(shop)

    async def fail() -> None:
        async with unit(shop) as conn_or_session:
            await conn_or_session.execute(text(f"INSERT INTO {orders} VALUES (1)"))
            shop.durable.delay(1)
            shop.plain.delay(2)
            raise RuntimeError("the request fails")

    with pytest.raises(RuntimeError):
        asyncio.run(fail())
    assert outgoing_rows(shop.outbox.store) == (0, 0)
    assert nothing_more(shop.app, shop.durable_queue) and nothing_more(shop.app, shop.plain_queue)


def test_a_transaction_the_database_aborted_is_refused_not_published(shop, unit):
    """A statement failed and the caller went on without a savepoint: PostgreSQL would answer the
    COMMIT with a ROLLBACK, the driver raising nothing (psycopg and asyncpg alike). The unit
    raises ``TransactionAborted`` naming the statement, and publishes nothing."""

    async def go_on_after_an_error() -> None:
        async with unit(shop) as conn_or_session:
            shop.plain.delay(1)
            shop.durable.delay(2)
            with pytest.raises(DBAPIError):
                await conn_or_session.execute(text("SELECT 1 / 0"))

    with pytest.raises(TransactionAborted, match="division by zero"):
        asyncio.run(go_on_after_an_error())
    assert outgoing_rows(shop.outbox.store) == (0, 0)
    assert nothing_more(shop.app, shop.durable_queue) and nothing_more(shop.app, shop.plain_queue)


def test_a_savepoint_rolled_back_after_an_error_keeps_the_unit_committable(shop):
    async def recover_in_a_savepoint() -> None:
        async with shop.outbox.atransaction() as session:
            shop.durable.delay(1)
            with pytest.raises(DBAPIError):
                async with session.begin_nested():
                    await session.execute(text("SELECT 1 / 0"))
            await session.execute(text("SELECT 1"))

    asyncio.run(recover_in_a_savepoint())
    assert [m.args for m in receive(shop.app, shop.durable_queue, 1)] == [[1]]


def test_a_cancellation_during_the_commit_still_publishes_what_committed(shop, unit):
    """The COMMIT takes half a second (a deferred trigger sleeps in it) and the task is cancelled
    in the middle: the unit waits for the COMMIT's answer, publishes at once what committed (no
    redelivery needed: it is ten minutes away), then raises the cancellation."""
    orders = orders_table(shop)
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"CREATE OR REPLACE FUNCTION {orders}_slow() RETURNS trigger AS "
                          "$$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$ LANGUAGE plpgsql"))
        conn.execute(text(f"CREATE CONSTRAINT TRIGGER {orders}_slow AFTER INSERT ON {orders} "
                          f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {orders}_slow()"))

    async def place_and_cancel() -> tuple[str, str]:
        ids: list[str] = []

        async def place() -> None:
            async with unit(shop) as conn_or_session:
                await conn_or_session.execute(text(f"INSERT INTO {orders} VALUES (7)"))
                ids.extend([shop.durable.delay(7).id, shop.plain.delay(8).id])
                asyncio.get_running_loop().call_later(0.2, task.cancel)  # the COMMIT is under way then

        task = asyncio.ensure_future(place())
        with pytest.raises(asyncio.CancelledError):
            await task
        return ids[0], ids[1]

    durable, plain = asyncio.run(place_and_cancel())
    with shop.outbox.engine.connect() as conn:
        assert conn.execute(text(f"SELECT id FROM {orders}")).scalars().all() == [7], "the COMMIT went through"
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [plain], "the plain message was not lost"
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"DROP FUNCTION {orders}_slow() CASCADE"))


def test_units_in_successive_event_loops_and_concurrent_units_in_one(shop):
    async def place_many(start: int) -> list[str]:
        async def place(n: int) -> str:
            async with shop.outbox.atransaction() as session:
                await session.execute(text("SELECT 1"))
                return shop.durable.delay(n).id

        return await asyncio.gather(*(place(n) for n in range(start, start + 10)))

    ids = asyncio.run(place_many(0)) + asyncio.run(place_many(10))
    assert sorted(m.id for m in receive(shop.app, shop.durable_queue, 20)) == sorted(ids)


def test_a_connection_terminated_during_the_commit_commits_and_publishes_nothing(shop, unit):
    """The server ends the unit's session while its COMMIT runs (a deferred trigger sleeps in it):
    the unit raises the driver's error, nothing is committed, stored or published."""
    orders = orders_table(shop)
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"CREATE OR REPLACE FUNCTION {orders}_slow() RETURNS trigger AS "
                          "$$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$ LANGUAGE plpgsql"))
        conn.execute(text(f"CREATE CONSTRAINT TRIGGER {orders}_slow AFTER INSERT ON {orders} "
                          f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {orders}_slow()"))

    def terminate(pid: int) -> None:
        with shop.outbox.engine.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

    async def place() -> None:
        async with unit(shop) as conn_or_session:
            await conn_or_session.execute(text(f"INSERT INTO {orders} VALUES (9)"))
            pid = (await conn_or_session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            shop.durable.delay(9)
            shop.plain.delay(10)
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, lambda: loop.run_in_executor(None, terminate, pid))  # the COMMIT runs then

    with pytest.raises(DBAPIError):
        asyncio.run(place())
    with shop.outbox.engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {orders}")).scalar_one() == 0
    assert outgoing_rows(shop.outbox.store) == (0, 0)
    assert nothing_more(shop.app, shop.durable_queue) and nothing_more(shop.app, shop.plain_queue)
    with shop.outbox.engine.begin() as conn:
        conn.execute(text(f"DROP FUNCTION {orders}_slow() CASCADE"))


def test_the_durable_insert_is_awaited_never_sent_through_the_blocking_one_message_path(shop, monkeypatch):
    """The store sends a sync unit's INSERT through libpq in one message, waiting on the socket in
    ``select``: on the loop's thread that would block the event loop. An async unit's INSERT goes
    through the driver's own awaited execute."""
    from celery_outbox.store.one_message import OneMessage

    sent_in_one_message = []
    real = OneMessage._send_one_message

    def recording(self, conn, *args, **kwargs):
        sent_in_one_message.append(conn.dialect.is_async)
        return real(self, conn, *args, **kwargs)

    monkeypatch.setattr(OneMessage, "_send_one_message", recording)

    async def place() -> None:
        async with shop.outbox.atransaction():
            shop.durable.delay(1)
        async with shop.outbox.abegin():
            shop.durable.delay(2)

    asyncio.run(place())
    assert True not in sent_in_one_message
    assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 2)) == [1, 2]
