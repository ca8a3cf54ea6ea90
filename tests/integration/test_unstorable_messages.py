"""A durable message the outgoing table cannot hold fails at ``apply_async``, on real PostgreSQL:
the caller's transaction is untouched and its own writes still commit."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, MetaData, String, Table, insert, select

from celery_outbox.errors import OutboxError, UnstorableMessage

from ..apps.factory import make_shop
from ..brokers import purge, receive
from ..conftest import drop_store, unsent_rows

TOO_LONG = "x" * 300


@pytest.fixture
def shop(postgres_url, table_prefix):
    shop = make_shop("memory://", postgres_url, table_prefix)
    shop.outbox.ready()
    users = Table(f"{table_prefix}users", MetaData(), Column("name", String(64), primary_key=True))
    users.create(shop.outbox.engine)
    shop.users = users
    yield shop
    purge(shop.app, shop.plain_queue, shop.durable_queue)
    users.drop(shop.outbox.engine)
    drop_store(shop.outbox.store)
    shop.outbox.engine.dispose()


@pytest.mark.parametrize(("task_id", "named"), [
    (TOO_LONG, "300 characters"), ("bad\x00id", "NUL"), ("bad\udc80id", "UTF-8"),
])
def test_an_id_the_store_cannot_hold_fails_at_the_call_and_the_callers_data_commits(shop, task_id, named):
    with shop.outbox.transaction() as session:
        session.execute(insert(shop.users).values(name="ada"))
        with pytest.raises(UnstorableMessage, match=named) as raised:
            shop.durable.apply_async((1,), task_id=task_id)
        shop.durable.delay(2)  # the unit of work goes on
    assert isinstance(raised.value, OutboxError) and isinstance(raised.value, ValueError)
    assert "task id" in str(raised.value) and shop.durable_queue in str(raised.value)
    with shop.outbox.engine.connect() as conn:
        assert conn.execute(select(shop.users.c.name)).scalars().all() == ["ada"], "the caller's row committed"
    assert unsent_rows(shop.outbox.store) == 0
    assert [m.args for m in receive(shop.app, shop.durable_queue, 1)] == [[2]]


def test_the_error_names_the_limit_of_the_column(shop):
    with pytest.raises(UnstorableMessage) as raised:
        shop.durable.apply_async((1,), task_id=TOO_LONG)
    limit = shop.outbox.store.tables.outgoing.c.message_id.type.length
    assert f"at most {limit}" in str(raised.value) and "xxxx" in str(raised.value)
    assert unsent_rows(shop.outbox.store) == 0


def test_a_task_name_the_store_cannot_hold_fails_at_the_call(shop):
    with shop.outbox.transaction():
        with pytest.raises(UnstorableMessage, match="task name"):
            shop.app.send_task("n" * 300, (1,), queue=shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0


def test_a_plain_queue_takes_any_id_as_plain_celery_does(shop):
    with shop.outbox.transaction():
        result = shop.plain.apply_async((1,), task_id=TOO_LONG)
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [result.id]
