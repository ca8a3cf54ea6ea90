"""The app of the contention benchmark's processes: its workers (``celery -A
benchmarks.contention_app worker``, built from CONTENTION_* environment variables), its relays and
its recovers (``create``).

One task, ``bench.durable``, routed to the durable queue: an ``IdempotentTask`` (optimistic
style) that writes one effect row, naming its message, through ``self.connection``, in the
claim's transaction. Each delivery of it that reaches a pool process is counted in a Redis hash
(``deliveries_key``, one field per message id) before the inbox claims it, so a message
published twice shows there even when the inbox discards the copy. Recover passes run every
``RECOVER_INTERVAL`` seconds, as beat runs them with ``outbox_recover_interval`` set to that.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, signals
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, insert

from celery_outbox import IdempotentTask, Outbox

TASK = "bench.durable"
RECOVER_INTERVAL = 1.0


def deliveries_key(prefix: str) -> str:
    return f"contention:{prefix}deliveries"  # not bench:*, the worker benchmark's marks


def effects_table(prefix: str, metadata: MetaData) -> Table:
    return Table(f"{prefix}effects", metadata, Column("id", BigInteger, primary_key=True, autoincrement=True),
                 Column("message_id", String(255), nullable=False), Column("n", Integer, nullable=False))


def create(broker_url: str, database_url: str, prefix: str, queue: str,
           counts_url: str) -> tuple[Celery, Outbox, Table]:
    app = Celery("bench_contention", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}plain", task_routes={TASK: {"queue": queue}},
                    outbox_database_url=database_url, outbox_table_prefix=prefix, outbox_durable_queues=[queue],
                    outbox_recover_interval=RECOVER_INTERVAL, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)
    outbox = Outbox(app)
    effects = effects_table(prefix, MetaData())
    counts: dict[int, Any] = {}  # one Redis client per process (pool processes fork after it is made)
    key = deliveries_key(prefix)

    @app.task(base=IdempotentTask, bind=True, name=TASK, shared=False)
    def durable(self, n: int) -> None:
        self.connection.execute(insert(effects).values(message_id=self.request.id, n=n))

    def count_delivery(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if getattr(sender, "name", None) != TASK:
            return
        client = counts.get(os.getpid())
        if client is None:
            client = counts[os.getpid()] = redis.Redis.from_url(counts_url)
        client.hincrby(key, task_id or "", 1)

    signals.task_prerun.connect(count_delivery, weak=False)
    return app, outbox, effects


if "CONTENTION_PREFIX" in os.environ:
    app, outbox, effects = create(
        os.environ["CONTENTION_BROKER_URL"], os.environ["CONTENTION_DATABASE_URL"], os.environ["CONTENTION_PREFIX"],
        os.environ["CONTENTION_QUEUE"], os.environ["CONTENTION_COUNTS_URL"])
