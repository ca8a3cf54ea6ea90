"""The DoesNotExist race, in real worker processes of each pool Celery users run.

A task writes an order and, in the same unit of work, asks for a check of it; a
second worker, idle and listening only for checks, runs the check at once. With the outbox the check always finds the
order: the message leaves only after the commit. Runs with prefork and threads
pools, for a plain queue and a durable queue, on PostgreSQL with Redis and RabbitMQ.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from ..apps import worker_app
from ..brokers import purge
from ..conftest import drop_store
from ..services import require, wait_until
from ..workers import WorkerProcess

N_ORDERS = 40


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request):
    return require(request.param)


@pytest.mark.parametrize("pool, concurrency", [("prefork", 2), ("threads", 4)])
@pytest.mark.parametrize("durable", [False, True], ids=["plain", "durable"])
def test_the_check_always_finds_the_order(broker_url, postgres_url, table_prefix, tmp_path, pool, concurrency,
                                          durable):
    suffix = uuid.uuid4().hex[:8]
    env = {
        "TEST_BROKER_URL": broker_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": table_prefix,
        "TEST_QUEUE": f"orders_{suffix}", "TEST_DURABLE_QUEUE": f"checks_{suffix}",
    }
    shop = worker_app.create(broker_url, postgres_url, table_prefix, env["TEST_QUEUE"], env["TEST_DURABLE_QUEUE"])
    shop.outbox.ready()
    shop.metadata.create_all(shop.outbox.engine)
    placing = WorkerProcess("tests.apps.worker_app", env, pool=pool, concurrency=concurrency,
                            queues=[env["TEST_QUEUE"]], log_path=tmp_path / "placing.log").start()
    checking = WorkerProcess("tests.apps.worker_app", env, pool=pool, concurrency=concurrency,
                             queues=[env["TEST_QUEUE"] + "_checks", env["TEST_DURABLE_QUEUE"]],
                             log_path=tmp_path / "checking.log").start()
    placing.wait_ready()
    checking.wait_ready()
    try:
        order_ids = [f"order-{n}" for n in range(N_ORDERS)]
        for order_id in order_ids:
            shop.place.delay(order_id, durable)
        checks = shop.checks

        def all_checked():
            with shop.outbox.engine.begin() as conn:
                return conn.execute(select(checks.c.order_id, checks.c.found, checks.c.pid)).all()

        rows = wait_until(lambda: (r := all_checked()) and len(r) == N_ORDERS and r, timeout=90,
                          message=f"{N_ORDERS} checks (worker logs in {tmp_path})")
        assert sorted(r.order_id for r in rows) == sorted(order_ids)
        assert all(r.found for r in rows), [r for r in rows if not r.found]
        assert shop.outbox.store.count_outgoing() == 0
    finally:
        placing.stop(cold=True)
        checking.stop(cold=True)
        purge(shop.app, env["TEST_QUEUE"], env["TEST_QUEUE"] + "_checks", env["TEST_DURABLE_QUEUE"])
        shop.metadata.drop_all(shop.outbox.engine)
        drop_store(shop.outbox.store)
