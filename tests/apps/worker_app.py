"""A Celery app for tests that run real worker processes.

The worker process builds it from TEST_BROKER_URL, TEST_DATABASE_URL,
TEST_TABLE_PREFIX, TEST_QUEUE and TEST_DURABLE_QUEUE; a test builds the same app in
its own process with ``create(...)`` to send tasks and read tables.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from celery import Celery
from sqlalchemy import Boolean, Column, Integer, MetaData, String, Table, insert, select

from celery_outbox import Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str, durable_queue: str) -> SimpleNamespace:
    """Orders are placed from ``queue``; checks run from ``queue + '_checks'`` (plain) or
    ``durable_queue``, so a check never waits behind the orders in one queue."""
    app = Celery("worker_app", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_routes={"orders.check": {"queue": f"{queue}_checks"}, "orders.check_durable": {"queue": durable_queue}},
        worker_prefetch_multiplier=1,
        outbox_database_url=database_url,
        outbox_table_prefix=prefix,
        outbox_durable_queues=[durable_queue],
        worker_hijack_root_logger=False,
    )
    outbox = Outbox(app)
    metadata = MetaData()
    orders = Table(f"{prefix}orders", metadata, Column("id", String(64), primary_key=True))
    checks = Table(
        f"{prefix}checks", metadata,
        Column("order_id", String(64), primary_key=True),
        Column("found", Boolean, nullable=False),
        Column("pid", Integer, nullable=False),
    )

    @app.task(name="orders.place", shared=False)
    def place(order_id: str, durable: bool = False) -> None:
        """Write an order and ask for its check in one unit of work: the check must find the order."""
        with outbox.transaction() as session:
            session.execute(insert(orders).values(id=order_id))
            (check_durable if durable else check).delay(order_id)
            time.sleep(0.1)  # the window in which plain Celery's worker would already run the check

    def record_check(order_id: str) -> None:
        with outbox.engine.begin() as conn:
            found = conn.execute(select(orders.c.id).where(orders.c.id == order_id)).first() is not None
            conn.execute(insert(checks).values(order_id=order_id, found=found, pid=os.getpid()))

    @app.task(name="orders.check", shared=False)
    def check(order_id: str) -> None:
        record_check(order_id)

    @app.task(name="orders.check_durable", shared=False)
    def check_durable(order_id: str) -> None:
        record_check(order_id)

    return SimpleNamespace(app=app, outbox=outbox, metadata=metadata, orders=orders, checks=checks, place=place)


if "TEST_BROKER_URL" in os.environ:
    shop = create(
        os.environ["TEST_BROKER_URL"], os.environ["TEST_DATABASE_URL"], os.environ["TEST_TABLE_PREFIX"],
        os.environ.get("TEST_QUEUE", "celery"), os.environ.get("TEST_DURABLE_QUEUE", "durable"),
    )
    app = shop.app
