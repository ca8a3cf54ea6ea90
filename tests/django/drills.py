"""Real processes of the Django project (``tests/django_project/worker_app.py``) for the drills of
``tests/django``: their environment, the test's own side of the shop that places the orders, and
the check every drill ends with: each order written once, nothing pending.

A drill's worker and beat processes run the project as a Django user does: ``DJANGO_SETTINGS_MODULE``
set, so Celery's Django fixup closes the worker's Django connections around each task. They use the
test's databases (the names the test runner made) unless a drill gives a database other settings
(a proxy in front of PostgreSQL, a throwaway server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from celery_outbox import Outbox

from ..brokers import purge
from ..services import wait_until
from ..workers import BeatProcess, WorkerProcess

# Maintenance fast enough for a drill: recovery every second, a node dead after two stale checks
# (on PostgreSQL a killed process's node at once: its liveness lock is gone), a sent message no inbox
# acknowledged published again after 4 s.
FAST_MAINTENANCE = {"node_heartbeat_interval": 0.5, "node_stale_after": 1.5, "node_stale_checks": 2,
                    "recover_interval": 1, "cleanup_interval": 60, "redeliver_after": 4}
TASKS = {"optimistic": "shop.place", "eager": "shop.place_eager"}


def runner_database_names() -> dict[str, str]:
    """The names of the test databases, as the test runner made them."""
    from django.db import connections

    return {alias: connections[alias].settings_dict["NAME"] for alias in ("default", "pg")}


@dataclass
class Project:
    """The environment of one drill's worker and beat processes: the Django database of the outbox
    and the orders (``using``), the broker, a queue of its own (durable or not), the outbox's
    settings (with ``maintenance``, fast maintenance routed to a queue of its own), more Celery
    settings, Django database settings to change, and how long a body waits before its write."""

    tmp_path: Path
    using: str
    broker_url: str
    durable: bool = False
    maintenance: bool = False
    outbox: dict[str, Any] = field(default_factory=dict)
    conf: dict[str, Any] = field(default_factory=dict)
    database_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    body_seconds: float = 0.0
    queue: str = field(default_factory=lambda: f"dj_drill_{uuid.uuid4().hex[:8]}")

    @property
    def maintenance_queue(self) -> str:
        return f"{self.queue}_maintenance"

    def outbox_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {}
        if self.durable:
            settings["durable_queues"] = [self.queue]
        if self.maintenance:
            settings.update(FAST_MAINTENANCE, maintenance_queue=self.maintenance_queue)
        return {**settings, **self.outbox}

    def env(self) -> dict[str, str]:
        return {
            "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
            "CELERY_OUTBOX_DJANGO_TEST_DATABASES": json.dumps(runner_database_names()),
            "CELERY_OUTBOX_DJANGO_TEST_DATABASE_SETTINGS": json.dumps(self.database_settings),
            "DJANGO_WORKER_DATABASE": self.using, "DJANGO_WORKER_QUEUE": self.queue,
            "DJANGO_WORKER_BROKER_URL": self.broker_url, "DJANGO_WORKER_DEATHS": str(self.tmp_path),
            "DJANGO_WORKER_OUTBOX": json.dumps(self.outbox_settings()), "DJANGO_WORKER_CONF": json.dumps(self.conf),
            "DJANGO_WORKER_BODY_SECONDS": str(self.body_seconds),
        }

    def worker(self, name: str, queues: list[str] | None = None, concurrency: int = 2) -> WorkerProcess:
        """A prefork worker of the project (not started), logging to ``<name>.log``."""
        return WorkerProcess("tests.django_project.worker_app", self.env(), concurrency=concurrency,
                             queues=queues or [self.queue], log_path=self.tmp_path / f"{name}.log")

    def maintenance_worker(self) -> WorkerProcess:
        """A worker of one process that runs the maintenance beat sends (recovery)."""
        return self.worker("maintenance", [self.maintenance_queue], concurrency=1)

    def beat(self) -> BeatProcess:
        return BeatProcess("tests.django_project.worker_app", self.env(), log_path=self.tmp_path / "beat.log")

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def purge(self) -> None:
        purge(Celery("dj_purge", broker=self.broker_url, set_as_current=False), self.queue, self.maintenance_queue)


class Shop:
    """The test's side of the shop: a Celery app configured from Django's settings as the project's
    is, with an outbox on the same database. It places orders as a Django view does (inside
    ``transaction.atomic()``: for a durable queue the message is stored with the commit and published
    after it) or, given the ``database_url`` of a database Django does not know (a throwaway server),
    in the outbox's own transaction; and it reads the orders and the outbox's tables."""

    def __init__(self, project: Project, **outbox: Any):
        from django.conf import settings

        self.project = project
        self.app = Celery(f"dj_shop_{uuid.uuid4().hex[:8]}", broker=project.broker_url, set_as_current=False)
        self.app.config_from_object(settings, namespace="CELERY")
        self.app.conf.update(task_default_queue=project.queue, **project.conf)
        self.outbox = Outbox(self.app, django_database=project.using, **{**project.outbox_settings(), **outbox})
        self.store = self.outbox.ready().store
        with self.store.engine.begin() as conn:  # the tables outlive a test: its rows must not
            for table in self.store.tables.all():
                conn.execute(table.delete())

    def place(self, numbers: list[str], style: str | list[str]) -> None:
        """Send ``shop.place`` or ``shop.place_eager`` (a style per order, or one for all) for each order."""
        from django.db import transaction

        styles = [style] * len(numbers) if isinstance(style, str) else style
        for number, each in zip(numbers, styles, strict=True):
            block = (transaction.atomic(using=self.project.using) if self.outbox.runtime.joined
                     else self.outbox.transaction())
            with block:
                self.app.send_task(TASKS[each], (number,), task_id=f"place-{number}", queue=self.project.queue)

    def orders(self) -> dict[str, int]:
        """How many times each order was written (``shop_order``)."""
        return dict(self.read("SELECT number, count(*) FROM shop_order GROUP BY number"))

    def pending(self) -> dict[str, int]:
        """What the outbox's tables still hold that is not done: inbox rows not handled or owned by a
        node, outgoing rows (unsent, or sent and not acknowledged by the inbox), dead letters."""
        tables = self.store.tables
        (counts,) = self.read(
            f"SELECT (SELECT count(*) FROM {tables.incoming.name} WHERE status <> 'handled'),"
            f" (SELECT count(*) FROM {tables.incoming.name} WHERE owner <> 0),"
            f" (SELECT count(*) FROM {tables.outgoing.name}), (SELECT count(*) FROM {tables.dead_letters.name})")
        return dict(zip(("inbox rows not handled", "inbox rows owned by a node", "outgoing rows", "dead letters"),
                        counts, strict=True))

    def running(self) -> list[str]:
        """The message ids of the inbox rows running: attempts that have not ended."""
        return [message_id for (message_id,) in self.read(
            f"SELECT message_id FROM {self.store.tables.incoming.name} WHERE status = 'running'")]

    def held(self) -> list[str]:
        """PostgreSQL: the message ids whose outgoing row a running attempt holds (an optimistic
        attempt acknowledges the sender's row in its open transaction): the rows this connection
        cannot lock, read in a transaction rolled back at once."""
        if not self.store.is_postgres:
            return []
        outgoing = self.store.tables.outgoing.name
        connection = self.outbox.engine.raw_connection()
        try:
            cursor = connection.cursor()
            cursor.execute(f"SELECT message_id FROM {outgoing}")
            every = {row[0] for row in cursor.fetchall()}
            cursor.execute(f"SELECT message_id FROM {outgoing} FOR UPDATE SKIP LOCKED")
            return sorted(every - {row[0] for row in cursor.fetchall()})
        finally:
            connection.rollback()
            connection.close()

    def read(self, query: str) -> list[tuple]:
        """The rows of ``query``, read on a connection of the outbox's engine outside any transaction of
        its own: no lock taken (the store's transactions on SQLite take the write lock, which a worker
        stopped in the middle of an attempt may hold)."""
        connection = self.outbox.engine.raw_connection()
        try:
            cursor = connection.cursor()
            cursor.execute(query)
            return [tuple(row) for row in cursor.fetchall()]
        finally:
            connection.rollback()
            connection.close()

    def settled(self, numbers: list[str]) -> bool:
        """Every order written and nothing pending (False while the database cannot be read)."""
        try:
            return set(self.orders()) >= set(numbers) and not any(self.pending().values())
        except Exception:  # noqa: BLE001 - a database restarting or refusing: not settled yet
            return False

    def assert_each_order_once(self, numbers: list[str]) -> None:
        orders, pending = self.orders(), self.pending()
        assert orders == dict.fromkeys(numbers, 1), f"orders written: {orders}"
        assert not any(pending.values()), f"left pending: {pending}"

    def close(self) -> None:
        self.outbox.node.deregister()
        self.outbox.engine.dispose()  # its connections would keep the test database from being dropped


def caught_running(worker: WorkerProcess, shop: Shop, bodies: int, timeout: float = 30.0) -> list[str]:
    """Stop the worker (SIGSTOP, its whole process group) at a moment when at least ``bodies`` attempts
    run in it (their envelopes committed, in the eager style with their claims; or, an optimistic
    attempt on PostgreSQL, the sender's row held by its open transaction; their bodies not
    committed), and return their message ids; the worker stays stopped. Give it bodies that take a
    while, or ``bodies`` at once may never be caught."""
    group = worker.process.pid
    running: list[str] = []

    def caught() -> bool:
        os.killpg(group, signal.SIGSTOP)
        running[:] = shop.running() + shop.held()
        if len(running) >= bodies:
            return True
        os.killpg(group, signal.SIGCONT)
        return False

    wait_until(caught, timeout=timeout, interval=0.02, message=f"{bodies} attempts running in the worker at once")
    return running


def start_all(processes: list[WorkerProcess]) -> None:
    """Start every process, then wait until each is ready (they start side by side)."""
    for process in processes:
        process.start()
    for process in processes:
        process.wait_ready()


def stop_all(processes: list[WorkerProcess]) -> None:
    """Warm shutdown of every process at once (SIGTERM to all, then wait); SIGKILL one that does not stop."""
    running = [p for p in processes if p.process is not None and p.process.poll() is None]
    for process in running:
        process.process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def numbers_of(count: int) -> list[str]:
    """``count`` order numbers no other run uses."""
    run = uuid.uuid4().hex[:6]
    return [f"order-{run}-{n}" for n in range(count)]
