"""The app the worker benchmark's processes run (built from BENCH_* environment variables).

One body, seven ways to run it: a plain Celery task (acknowledged before it runs, Celery's
default, and after, with ``acks_late``), two floors (plain tasks writing their inbox row by
hand, the least each ``IdempotentTask`` style must do), an ``IdempotentTask`` in the
optimistic and in the eager style, and the plain task consumed from a durable queue.
``BENCH_BODY`` is ``noop`` or ``write`` (one Core INSERT: through ``self.connection``, in
the claim's transaction, in an ``IdempotentTask``; in its own transaction on a plain
SQLAlchemy engine otherwise, as a Celery user without celery-outbox would write it). ``bench.mark`` records when the
first and the last message of a run were handled, in Redis.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, insert, update

from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str, durable_queue: str, body: str,
           marks_url: str, **settings: Any) -> tuple[Celery, Outbox, MetaData]:
    app = Celery("bench_worker", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, outbox_database_url=database_url, outbox_table_prefix=prefix,
                    outbox_durable_queues=[durable_queue], worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, **settings)
    outbox = Outbox(app)
    metadata = MetaData()
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("n", Integer, nullable=False))
    marks = redis.Redis.from_url(marks_url)
    plain_engine = create_engine(database_url)
    inbox = outbox.store.tables.incoming

    def write_alone(n: int) -> None:
        with plain_engine.begin() as conn:
            conn.execute(insert(effects).values(n=n))

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> None:
        if body == "write":
            write_alone(n)

    @app.task(name="bench.plain_late", shared=False, acks_late=True)
    def plain_late(n: int) -> None:  # acknowledged after it ran, as every IdempotentTask is
        if body == "write":
            write_alone(n)

    def inbox_row(task: Any, status: str) -> dict[str, Any]:
        now = datetime.now(timezone.utc)
        return {"message_id": task.request.id, "destination": "", "task_name": task.name,
                "queue": task.request.delivery_info.get("routing_key") or "", "status": status, "owner": 0,
                "retries": 0, "nesting": 0, "replays": 0, "received_at": now, "claimed_at": now,
                "handled_at": now if status == "handled" else None, "keep_until": now + timedelta(days=1)}

    @app.task(name="bench.floor", bind=True, shared=False, acks_late=True)
    def floor(self, n: int) -> None:
        """The least an inbox claimed in the body's transaction costs: acknowledged after it ran,
        and one more row (the inbox row, by hand) in the body's transaction."""
        with plain_engine.begin() as conn:
            conn.execute(insert(inbox), inbox_row(self, "handled"))
            if body == "write":
                conn.execute(insert(effects).values(n=n))

    @app.task(name="bench.floor_eager", bind=True, shared=False, acks_late=True)
    def floor_eager(self, n: int) -> None:
        """The least an inbox claimed before the body costs: the inbox row committed first (not
        waiting for the disk, as the eager claim does), then marked handled in the body's
        transaction."""
        with plain_engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            conn.execute(insert(inbox), inbox_row(self, "running"))
        with plain_engine.begin() as conn:
            conn.execute(update(inbox).where(inbox.c.message_id == self.request.id, inbox.c.destination == "")
                         .values(status="handled"))
            if body == "write":
                conn.execute(insert(effects).values(n=n))

    @app.task(base=IdempotentTask, bind=True, name="bench.optimistic", shared=False)
    def optimistic(self, n: int) -> None:
        if body == "write":
            self.connection.execute(insert(effects).values(n=n))

    @app.task(base=IdempotentTask, bind=True, name="bench.eager", shared=False)
    def eager(self, n: int) -> None:
        if body == "write":
            self.connection.execute(insert(effects).values(n=n))

    eager.idempotency = "eager"

    @app.task(name="bench.mark", shared=False)
    def mark(key: str) -> None:
        marks.set(key, repr(time.time()))

    return app, outbox, metadata


if "BENCH_BROKER_URL" in os.environ:
    app, outbox, metadata = create(
        os.environ["BENCH_BROKER_URL"], os.environ["BENCH_DATABASE_URL"], os.environ["BENCH_PREFIX"],
        os.environ["BENCH_QUEUE"], os.environ["BENCH_DURABLE_QUEUE"], os.environ["BENCH_BODY"],
        os.environ["BENCH_MARKS_URL"])
