"""Async units of work (``outbox.atransaction()``, ``outbox.abegin()``): fast checks on SQLite
(aiosqlite) and kombu's in-memory transport.

The same behaviour, with the crash points, cancellations and connection faults, is checked
against PostgreSQL (psycopg's async mode and asyncpg), Redis and RabbitMQ in
tests/integration/test_async_units_of_work.py and tests/faults/test_async_producer.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from celery_outbox import Outbox
from celery_outbox.errors import ConfigurationError, OutboxError
from celery_outbox.producer.async_unit_of_work import run_to_end
from celery_outbox.store import async_engine as async_engine_module

from ...apps.factory import make_shop
from ...brokers import nothing_more, receive
from ...conftest import outgoing_rows, unsent_rows


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


@pytest.fixture(params=["session", "connection"])
def unit(request):
    """Opens an async unit of work on ``shop``'s outbox: ``atransaction()`` (an AsyncSession) or
    ``abegin()`` (an AsyncConnection)."""
    return lambda shop: shop.outbox.atransaction() if request.param == "session" else shop.outbox.abegin()


def test_a_committed_unit_stores_its_durable_messages_and_publishes_everything_in_call_order(shop, unit):
    async def place() -> list[str]:
        async with unit(shop) as conn_or_session:
            await conn_or_session.execute(text("SELECT 1"))
            ids = [shop.plain.delay(1).id, shop.durable.delay(2).id, shop.plain.delay(3).id]
            assert nothing_more(shop.app, shop.plain_queue), "nothing may reach the broker before the commit"
            assert outgoing_rows(shop.outbox.store) == (0, 0), "the durable row is not committed yet"
        return ids

    plain_first, durable, plain_second = asyncio.run(place())
    assert [m.id for m in receive(shop.app, shop.plain_queue, 2)] == [plain_first, plain_second]
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable]
    assert outgoing_rows(shop.outbox.store) == (1, 0), "the durable row committed, marked sent, until acknowledged"


def test_a_rolled_back_unit_stores_and_publishes_nothing(shop, unit):
    async def fail() -> None:
        async with unit(shop):
            shop.plain.delay(1)
            shop.durable.delay(2)
            raise RuntimeError("the caller's transaction fails")

    with pytest.raises(RuntimeError):
        asyncio.run(fail())
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert outgoing_rows(shop.outbox.store) == (0, 0)


def test_the_rows_of_a_unit_commit_with_its_own_writes(shop):
    async def place() -> None:
        async with shop.outbox.abegin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS orders (id INTEGER)"))
        async with shop.outbox.atransaction() as session:
            await session.execute(text("INSERT INTO orders VALUES (1)"))
            shop.durable.delay(1)
        with pytest.raises(KeyError):
            async with shop.outbox.abegin() as conn:
                await conn.execute(text("INSERT INTO orders VALUES (2)"))
                shop.durable.delay(2)
                raise KeyError("rolled back")

    asyncio.run(place())
    with shop.outbox.engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM orders")).scalars().all() == [1]
    assert [m.args for m in receive(shop.app, shop.durable_queue, 1)] == [[1]]
    assert nothing_more(shop.app, shop.durable_queue)


def test_concurrent_units_in_one_loop_each_publish_only_their_own_messages(shop):
    async def place(n: int) -> str:
        async with shop.outbox.atransaction():
            result = shop.durable.delay(n)
            await asyncio.sleep(0)  # the others run meanwhile, each in its own unit
            if n % 5 == 0:
                raise LookupError(n)
        return result.id

    async def place_all() -> list:
        return await asyncio.gather(*(place(n) for n in range(20)), return_exceptions=True)

    outcomes = asyncio.run(place_all())
    committed = {outcome for outcome in outcomes if isinstance(outcome, str)}
    assert len(committed) == 16
    assert {m.id for m in receive(shop.app, shop.durable_queue, 16)} == committed
    assert nothing_more(shop.app, shop.durable_queue), "a rolled-back unit published nothing"


def test_a_unit_inside_a_unit_joins_it(shop):
    async def nested() -> None:
        async with shop.outbox.abegin() as conn:
            shop.plain.delay(1)
            async with shop.outbox.atransaction() as session:
                assert (await session.connection()).sync_connection is conn.sync_connection
                shop.plain.delay(2)
            async with shop.outbox.abegin() as inner:
                assert inner is conn
            assert nothing_more(shop.app, shop.plain_queue), "the inner blocks publish with the outer commit"

    asyncio.run(nested())
    assert [m.args for m in receive(shop.app, shop.plain_queue, 2)] == [[1], [2]]


def test_a_users_own_async_session_is_published_after_its_commit(shop):
    async def own_session() -> None:
        async with AsyncSession(shop.outbox.async_engine) as session:
            async with shop.outbox.atransaction(session):
                shop.plain.delay(1)
                assert nothing_more(shop.app, shop.plain_queue)
                await session.commit()
                assert [m.args for m in receive(shop.app, shop.plain_queue, 1)] == [[1]]
                shop.plain.delay(2)
                await session.rollback()
            assert nothing_more(shop.app, shop.plain_queue), "the rolled back send is dropped"

    asyncio.run(own_session())


def test_the_loop_runs_other_tasks_while_the_publish_is_in_progress(shop, monkeypatch):
    """The publish blocks until a coroutine of the same loop lets it go: were it run on the loop,
    that coroutine could never run, and the unit would never end."""
    release = threading.Event()
    real_publish = shop.outbox.publisher.publish_committed

    def gated_publish(messages, producer=None):
        assert release.wait(10), "the loop never ran the releasing coroutine"
        real_publish(messages, producer)

    monkeypatch.setattr(shop.outbox.publisher, "publish_committed", gated_publish)

    async def place_and_release() -> None:
        async def place() -> None:
            async with shop.outbox.atransaction():
                shop.plain.delay(1)

        async def releaser() -> None:
            await asyncio.sleep(0.05)
            release.set()

        await asyncio.wait_for(asyncio.gather(place(), releaser()), timeout=20)

    asyncio.run(place_and_release())
    assert [m.args for m in receive(shop.app, shop.plain_queue, 1)] == [[1]]


def test_a_cancellation_after_the_commit_leaves_the_publish_running(shop, monkeypatch):
    publishing = threading.Event()
    release = threading.Event()
    real_publish = shop.outbox.publisher.publish_committed

    def gated_publish(messages, producer=None):
        publishing.set()
        assert release.wait(10)
        real_publish(messages, producer)

    monkeypatch.setattr(shop.outbox.publisher, "publish_committed", gated_publish)

    async def place_then_cancel() -> None:
        async def place() -> None:
            async with shop.outbox.atransaction():
                shop.durable.delay(1)

        task = asyncio.ensure_future(place())
        while not publishing.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    asyncio.run(place_then_cancel())
    assert [m.args for m in receive(shop.app, shop.durable_queue, 1)] == [[1]], "the publish went on"
    assert unsent_rows(shop.outbox.store) == 0


def test_run_to_end_finishes_a_commit_its_waiter_was_cancelled_during():
    async def scenario() -> tuple[bool, bool]:
        done = asyncio.Event()
        may_finish = asyncio.Event()

        async def commit() -> None:
            await may_finish.wait()
            done.set()

        waiter = asyncio.ensure_future(run_to_end(commit()))
        await asyncio.sleep(0)
        waiter.cancel()  # the cancellation reaches the waiter, not the commit
        await asyncio.sleep(0)
        may_finish.set()
        return await waiter, done.is_set()

    assert asyncio.run(scenario()) == (True, True), "a cancelled waiter still sees the commit end, then says so"


def test_each_event_loop_gets_an_engine_no_live_loop_uses(shop):
    """Connections belong to the loop that made them: units in a second ``asyncio.run`` work, and
    two loops running at once in two threads use two engines."""

    async def place(n: int):
        async with shop.outbox.atransaction() as session:
            await session.execute(text("SELECT 1"))
            shop.plain.delay(n)
        return shop.outbox.runtime.async_engine_of_running_loop()

    first = asyncio.run(place(1))
    second = asyncio.run(place(2))
    assert first is second is shop.outbox.async_engine, "a loop that shut down gives its engine back"
    engines = []
    both_running = threading.Barrier(2)

    async def held(n: int) -> None:
        engines.append(await place(n))
        await asyncio.get_running_loop().run_in_executor(None, both_running.wait, 10)

    threads = [threading.Thread(target=asyncio.run, args=(held(n),)) for n in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len({id(engine) for engine in engines}) == 2
    assert sorted(m.args[0] for m in receive(shop.app, shop.plain_queue, 4)) == [1, 2, 3, 4]


def test_an_engine_given_to_the_outbox_is_the_one_units_use(app, sqlite_url, table_prefix):
    engine = create_async_engine(sqlite_url.replace("sqlite://", "sqlite+aiosqlite://"))
    app.conf.update(outbox_database_url=sqlite_url, outbox_table_prefix=table_prefix)
    outbox = Outbox(app, async_engine=engine)
    assert outbox.async_engine is engine
    assert asyncio.run(_engine_of_a_unit(outbox)) is engine
    asyncio.run(engine.dispose())


async def _engine_of_a_unit(outbox: Outbox):
    async with outbox.atransaction() as session:
        return session.bind


def test_a_sync_unit_inside_an_async_one_is_an_error(shop):
    async def mixed() -> None:
        async with shop.outbox.atransaction():
            shop.plain.delay(1)
            with shop.outbox.transaction():
                pass

    with pytest.raises(OutboxError, match="inside an async unit of work"):
        asyncio.run(mixed())
    assert nothing_more(shop.app, shop.plain_queue)


def test_a_missing_async_driver_is_an_error_naming_the_extra(shop, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(async_engine_module.importlib.util, "find_spec",
                        lambda name, *args: None if name == "aiosqlite" else real(name, *args))

    async def open_one() -> None:
        async with shop.outbox.atransaction():
            pass

    with pytest.raises(ConfigurationError, match=r"need aiosqlite.*celery-outbox\[asyncio\]"):
        asyncio.run(open_one())


@pytest.mark.parametrize(("store", "given", "expected"), [
    ("sqlite:///x.sqlite3", None, "sqlite+aiosqlite:///x.sqlite3"),
    ("postgresql+psycopg://u@h/db", None, "postgresql+psycopg://u@h/db"),
    ("postgresql+psycopg://u@h/db", "postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ("postgresql+psycopg://u@h/db", "postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
])
def test_the_async_url_is_the_stores_with_its_async_driver_unless_given(store, given, expected):
    assert async_engine_module.async_url(store, given).render_as_string(False) == expected


@pytest.mark.parametrize(("given", "error"), [
    ("postgresql+pg8000://u@h/db", "not an async one"),
    ("mysql+aiomysql://u@h/db", "names the database 'mysql'"),
    ("not a url", "is not a database URL"),
])
def test_a_wrong_async_url_is_a_configuration_error(given, error):
    with pytest.raises(ConfigurationError, match=error):
        async_engine_module.async_url("postgresql+psycopg://u@h/db", given)
