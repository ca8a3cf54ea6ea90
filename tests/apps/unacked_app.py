"""A Celery app for the messages no inbox acknowledges (revoked, expired, a foreign task base,
protocol 1), built the same way with plain Celery (``with_outbox=False``) and with the outbox.

The worker builds it from the environment (TEST_BROKER_URL, also the result backend,
TEST_DATABASE_URL, TEST_TABLE_PREFIX, TEST_QUEUE and TEST_LATE_QUEUE (both durable with the
outbox), TEST_COUNTERS (a Redis key prefix), TEST_WITH_OUTBOX ("1" or "0"), TEST_CONF: more
settings as JSON); a test builds the same app in its own process with ``create(...)``. With the
outbox, ``held`` is an optimistic ``IdempotentTask`` that keeps its attempt's transaction open
until the test releases it (``release(task_id)``). Every task body counts its runs in Redis
(``runs(task_id)``), and the worker counts the messages it discards unrun
(``runs("revoked:<id>")``, ``runs("expired:<id>")``, from Celery's ``task_revoked`` signal, sent
once the message is acked), so a test sees what happened, in whichever process, with or without
the outbox.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery, Task, signals
from celery.worker.request import Request


def create(broker_url: str, database_url: str, prefix: str, queue: str, late_queue: str, counters: str,
           with_outbox: bool, **conf: Any) -> SimpleNamespace:
    app = Celery("unacked_app", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=False,
        **conf,
    )
    outbox = None
    if with_outbox:
        from celery_outbox import Outbox

        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=prefix,
                        outbox_durable_queues=[queue, late_queue], outbox_node_heartbeat_interval=0.5)
        outbox = Outbox(app)
    client = redis.Redis.from_url(broker_url)

    def count(key: str) -> None:
        client.incr(f"{counters}:{key}")

    def runs(key: str) -> int:
        return int(client.get(f"{counters}:{key}") or 0)

    class CountingRequest(Request):
        """A request class of the user's own: counts the runs a pool process accepted."""

        def on_accepted(self, pid: int, time_accepted: float) -> None:
            count(f"request:{self.id}")
            super().on_accepted(pid, time_accepted)

    class ForeignBase(Task):
        """A base class of the user's own, deriving from ``celery.Task`` directly."""

        Request = CountingRequest

    @app.task(name="unacked.count", bind=True, shared=False)
    def count_run(self) -> str:
        count(self.request.id)
        return self.request.id

    @app.task(name="unacked.block", bind=True, shared=False)
    def block(self) -> None:
        """Counts its run, then runs until its pool process is killed (at most a minute)."""
        count(self.request.id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)

    held = None
    if with_outbox:
        from celery_outbox import IdempotentTask

        @app.task(name="unacked.held", bind=True, shared=False, base=IdempotentTask)
        def held(self) -> None:
            """An optimistic attempt: counts its run, then holds its transaction open until
            ``release(task_id)`` (at most a minute)."""
            count(self.request.id)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # each wait shorter than the client's socket timeout
                if client.blpop([f"{counters}:release:{self.request.id}"], timeout=1):
                    return

    def release(task_id: str) -> None:
        client.rpush(f"{counters}:release:{task_id}", 1)

    @app.task(name="unacked.foreign", bind=True, shared=False, base=Task)
    def foreign(self) -> str:
        count(self.request.id)
        return self.request.id

    @app.task(name="unacked.foreign_custom", bind=True, shared=False, base=ForeignBase)
    def foreign_custom(self) -> str:
        count(self.request.id)
        return self.request.id

    def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
        if sender is not None and sender.app is app:
            count(f"{'expired' if expired else 'revoked'}:{request.id}")

    signals.task_revoked.connect(on_revoked, weak=False)

    def forget() -> None:
        signals.task_revoked.disconnect(on_revoked)
        keys = list(client.scan_iter(f"{counters}:*"))
        if keys:
            client.delete(*keys)
        client.close()

    return SimpleNamespace(app=app, outbox=outbox, count=count_run, block=block, held=held, release=release,
                           foreign=foreign, foreign_custom=foreign_custom, runs=runs, forget=forget, queue=queue,
                           late_queue=late_queue)


if "TEST_BROKER_URL" in os.environ:
    shop = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_DATABASE_URL"], os.environ["TEST_TABLE_PREFIX"],
                  os.environ["TEST_QUEUE"], os.environ["TEST_LATE_QUEUE"], os.environ["TEST_COUNTERS"],
                  os.environ["TEST_WITH_OUTBOX"] == "1", **json.loads(os.environ.get("TEST_CONF", "{}")))
    app = shop.app
