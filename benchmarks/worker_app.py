"""The app the worker benchmark's processes run (built from BENCH_* environment variables).

One body, five ways to run it: a plain Celery task (acknowledged before it runs, Celery's
default, and after, with ``acks_late``), an ``IdempotentTask`` in the optimistic and in the
eager style, and the plain task consumed from a durable queue.
``BENCH_BODY`` is ``noop`` or ``write`` (one INSERT: through ``self.session`` in an
``IdempotentTask``; in its own transaction on a plain SQLAlchemy engine otherwise, as a
Celery user without celery-outbox would write it). ``bench.mark`` records when the
first and the last message of a run were handled, in Redis.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, insert

from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str, durable_queue: str, body: str,
           marks_url: str) -> tuple[Celery, Outbox, MetaData]:
    app = Celery("bench_worker", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, outbox_database_url=database_url, outbox_table_prefix=prefix,
                    outbox_durable_queues=[durable_queue], worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)
    outbox = Outbox(app)
    metadata = MetaData()
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("n", Integer, nullable=False))
    marks = redis.Redis.from_url(marks_url)
    plain_engine = create_engine(database_url)

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

    @app.task(base=IdempotentTask, bind=True, name="bench.optimistic", shared=False)
    def optimistic(self, n: int) -> None:
        if body == "write":
            self.session.execute(insert(effects).values(n=n))

    @app.task(base=IdempotentTask, bind=True, name="bench.eager", shared=False)
    def eager(self, n: int) -> None:
        if body == "write":
            self.session.execute(insert(effects).values(n=n))

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
