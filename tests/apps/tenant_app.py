"""A Celery app whose tenants each have a PostgreSQL database of their own, for the tests that run
real worker processes for them (tests/integration/test_tenants_workers.py).

The worker builds it from the environment: TEST_BROKER_URL, TEST_DATABASE_URL (the default
store), TEST_TABLE_PREFIX, TEST_QUEUE (a durable queue), TEST_TENANTS_FILE (a JSON file of tenant
names to database URLs, read by ``tenants_from_file``, which ``outbox_tenants`` names by its dotted
path: it is read again for a tenant the worker does not know yet), TEST_GATE_DIR (where the
``hold`` task finds its gate files), TEST_VISIBILITY_TIMEOUT and TEST_CONF (more settings as
JSON). A test builds the same app in its own process with ``create(...)``.

Every database (the default one and each tenant's) has the same two tables of the app, under the
table prefix: ``orders``, written by a producer in the unit of work that sends the order's
message, and ``effects``, written by the task through ``self.session`` (no unique key: a second run
of a body shows as a second row), naming the tenant the task ran for and the database it wrote in.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, text

from celery_outbox import IdempotentTask, Outbox, current_tenant

from ..brokers import fast_redelivery

#: the dotted path ``outbox_tenants`` names in a worker
TENANTS_SOURCE = "tests.apps.tenant_app:tenants_from_file"
#: seconds a ``hold`` body waits for its gate before it gives up (fails)
HOLD_LIMIT = 120.0


def tenants_from_file(path: str | None = None) -> dict[str, Any]:
    """The tenants the JSON file at ``path`` (TEST_TENANTS_FILE) lists now."""
    return json.loads(Path(path or os.environ["TEST_TENANTS_FILE"]).read_text())


def build_tables(prefix: str) -> tuple[MetaData, Table, Table]:
    metadata = MetaData()
    orders = Table(f"{prefix}orders", metadata, Column("order_id", String(64), primary_key=True),
                   Column("tenant", String(64), nullable=True))
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("order_id", String(64), nullable=False), Column("tenant", String(64), nullable=True),
                    Column("database", String(64), nullable=False), Column("pid", Integer, nullable=False))
    return metadata, orders, effects


def create(broker_url: str, database_url: str, prefix: str, queue: str, tenants: str | Callable[[], Any],
           gate_dir: str, visibility_timeout: float = 3, **conf: Any) -> SimpleNamespace:
    app = Celery("tenant_app", broker=broker_url, set_as_current=False)
    app.conf.update({
        "task_default_queue": queue,
        "outbox_database_url": database_url,
        "outbox_table_prefix": prefix,
        "outbox_durable_queues": [queue],
        "outbox_tenants": tenants,
        "outbox_node_heartbeat_interval": 0.5,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": fast_redelivery(visibility_timeout),
        **conf,
    })
    outbox = Outbox(app)
    metadata, orders, effects = build_tables(prefix)
    gates = Path(gate_dir)

    def write_effect(task: Any, order_id: str) -> str:
        session = task.session  # the attempt's transaction, in the store of the delivery's tenant
        database = session.execute(text("SELECT current_database()")).scalar_one()
        session.execute(insert(effects).values(order_id=order_id, tenant=current_tenant(), database=database,
                                               pid=os.getpid()))
        return order_id

    @app.task(base=IdempotentTask, bind=True, name="tenant.apply_order", shared=False, default_retry_delay=0.2)
    def apply_order(self, order_id: str) -> str:
        return write_effect(self, order_id)

    @app.task(base=IdempotentTask, bind=True, name="tenant.hold", shared=False, default_retry_delay=0.2)
    def hold(self, order_id: str) -> str:
        """Says it started (``<order_id>.started``, its pid in it), then waits until the test opens
        its gate (``<order_id>.open``) before it writes its effect. Eager: its claim is committed,
        owned by this process's node in the tenant's store, while it waits."""
        (gates / f"{order_id}.started").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_LIMIT
        while not (gates / f"{order_id}.open").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gate of {order_id} stayed shut")
            time.sleep(0.05)  # a file the test creates: nothing here to wait on but the file system
        return write_effect(self, order_id)

    hold.idempotency = "eager"

    def place(order_id: str, tenant: str | None, task: Any = apply_order) -> None:
        """Commit the order row and its message in one unit of work of ``tenant`` (None: the default store)."""
        with outbox.transaction(tenant=tenant) as session:
            session.execute(insert(orders).values(order_id=order_id, tenant=tenant))
            task.apply_async((order_id,), task_id=order_id)

    return SimpleNamespace(app=app, outbox=outbox, metadata=metadata, orders=orders, effects=effects,
                           apply_order=apply_order, hold=hold, place=place)


if "TEST_TENANTS_FILE" in os.environ and "TEST_BROKER_URL" in os.environ:
    shop = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_DATABASE_URL"], os.environ["TEST_TABLE_PREFIX"],
                  os.environ["TEST_QUEUE"], TENANTS_SOURCE, os.environ["TEST_GATE_DIR"],
                  float(os.environ.get("TEST_VISIBILITY_TIMEOUT", 3)), **json.loads(os.environ.get("TEST_CONF", "{}")))
    app = shop.app
