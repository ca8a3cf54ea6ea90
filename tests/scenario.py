"""A scenario with real worker (and beat) processes of tests/apps/inbox_app.py on one table prefix."""

from __future__ import annotations

import json
import uuid

from .apps import inbox_app
from .brokers import purge
from .conftest import drop_store
from .services import wait_until
from .workers import BeatProcess, WorkerProcess


class Scenario:
    def __init__(self, broker_url, database_url, prefix, tmp_path, identity="id", visibility_timeout=3, **conf):
        suffix = uuid.uuid4().hex[:8]
        self.env = {
            "TEST_BROKER_URL": broker_url, "TEST_DATABASE_URL": database_url, "TEST_TABLE_PREFIX": prefix,
            "TEST_QUEUE": f"pay_{suffix}", "TEST_OTHER_QUEUE": f"pay_other_{suffix}", "TEST_IDENTITY": identity,
            "TEST_VISIBILITY_TIMEOUT": str(visibility_timeout), "TEST_CONF": json.dumps(conf),
        }
        self.shop = inbox_app.create(broker_url, database_url, prefix, self.env["TEST_QUEUE"],
                                     self.env["TEST_OTHER_QUEUE"], identity, visibility_timeout, **conf)
        self.shop.outbox.ready()
        self.shop.metadata.create_all(self.shop.outbox.engine)
        self.tmp_path = tmp_path
        self.workers: list[WorkerProcess] = []

    def worker(self, pool="prefork", concurrency=1, queues=None) -> WorkerProcess:
        worker = WorkerProcess("tests.apps.inbox_app", self.env, pool=pool, concurrency=concurrency,
                               queues=queues or [self.env["TEST_QUEUE"]],
                               log_path=self.tmp_path / f"worker{len(self.workers)}.log").start()
        self.workers.append(worker)
        return worker.wait_ready()

    def worker_with_both_styles_in_flight(self) -> WorkerProcess:
        """A worker of the durable queue running ``eager-1`` (eager) and ``optimistic-1`` (optimistic),
        both bodies started and held for two minutes: the victim of a kill."""
        durable = self.env["TEST_OTHER_QUEUE"]
        victim = self.worker(queues=[durable], concurrency=2)
        self.shop.pay_eager.apply_async(("eager-1", 120), task_id="eager-1", queue=durable)
        self.shop.pay.apply_async(("optimistic-1", 120), task_id="optimistic-1", queue=durable)
        self.wait_events("eager-1", "body", 1)
        self.wait_events("optimistic-1", "body", 1)
        return victim

    def wait_events(self, task_id, kind, count, timeout=60):
        return wait_until(
            lambda: (rows := [e for e in self.shop.events(task_id) if e.kind == kind]) and len(rows) >= count and rows,
            timeout=timeout, message=f"{count} {kind} event(s) of {task_id} (logs in {self.tmp_path})")

    def beat(self) -> BeatProcess:
        beat = BeatProcess("tests.apps.inbox_app", self.env, log_path=self.tmp_path / f"beat{len(self.workers)}.log")
        self.workers.append(beat.start())
        return beat.wait_ready()

    def close(self):
        for worker in self.workers:
            worker.stop(cold=True)
        purge(self.shop.app, self.env["TEST_QUEUE"], self.env["TEST_OTHER_QUEUE"])
        self.shop.metadata.drop_all(self.shop.outbox.engine)
        self.shop.disconnect()
        drop_store(self.shop.outbox.store)
        self.shop.outbox.engine.dispose()
