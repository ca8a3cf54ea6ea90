"""tenants, one down: a worker's pace on the other stores' messages while one tenant's database refuses.

One real worker (prefork, two processes, ``tenants_app``) drains a queue filled beforehand with
``MESSAGES`` durable messages of each store (the default one and the tenants'), sent in units of
work that take the stores in turn, so the queue mixes them. Twice a round, in turn: with every
database up, and with one tenant's database refusing every session (``ALLOW_CONNECTIONS false``,
its sessions ended) from before the worker starts. The pace measured is the other stores'
messages over the span of their handling, read from their inbox rows (first claim to last
handled, on the database server's one clock), not the worker's start-up. With the tenant down,
its messages are parked in the default store (a worker's pool process parks the first, the
consumer the next ones without a pool slot) and the others' should keep the pace they have with
every tenant up (target: at least 0.9 of it). Between measurements every store, the queue and the
parked messages are emptied.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Engine, make_url

from celery_outbox import using_tenant

from . import tenants_app
from .common import REDIS_URL, Options, Result, delete_queues, drop_store, in_turn, unique_prefix, worker_until

MESSAGES = 300  # per store and measurement
ROUNDS = 4
TARGET = 0.9
EVERY_TENANT_UP = "the same worker and queue with every tenant's database up"


class Gate:
    """One database's sessions refused (``close``) and allowed again (``open``)."""

    def __init__(self, admin: Engine, url: str):
        self.admin, self.database = admin, make_url(url).database

    def close(self) -> None:
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS false')
            conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %(name)s",
                                 {"name": self.database})

    def open(self) -> None:
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS true')


class Run:
    """The app, its stores and the victim's gate."""

    def __init__(self, admin: Engine, default_url: str, tenant_urls: dict[str, str]):
        prefix = unique_prefix()
        self.queue = f"{prefix}down"
        self.env = {"BENCH_BROKER_URL": REDIS_URL, "BENCH_DATABASE_URL": default_url, "BENCH_TABLE_PREFIX": prefix,
                    "BENCH_QUEUE": self.queue, "BENCH_TENANTS": json.dumps(tenant_urls)}
        self.app, self.outbox, self.apply = tenants_app.create(REDIS_URL, default_url, prefix, self.queue, tenant_urls)
        names = list(tenant_urls)
        self.victim, self.stores = names[0], [None, *names]
        self.others = [store for store in self.stores if store != self.victim]
        self.gate = Gate(admin, tenant_urls[self.victim])
        for store in self.stores:
            with using_tenant(store):
                self.outbox.ready()

    def measure(self, down: bool, messages: int) -> float:
        """The other stores' messages handled per second, with the victim's database down or not."""
        self._fill(messages)
        if down:
            self.gate.close()
        try:
            self._drain(messages)
        finally:
            if down:
                self.gate.open()
        pace = self._pace(messages)
        self._empty()
        return pace

    def _fill(self, messages: int) -> None:
        for n in range(messages):
            for store in self.stores:
                with self.outbox.transaction(tenant=store):
                    self.apply.apply_async((n,))

    def _handled(self, store: str | None) -> tuple[int, Any, Any]:
        """(handled rows, first claim, last handled) of ``store``'s inbox."""
        with using_tenant(store):
            table = self.outbox.store.tables.incoming
            with self.outbox.store.begin() as conn:
                return tuple(conn.execute(select(func.count(), func.min(table.c.claimed_at),
                                                 func.max(table.c.handled_at))
                                          .where(table.c.status == "handled")).one())

    def _drain(self, messages: int) -> None:
        """A worker, stopped once every other store has handled its ``messages``."""
        worker_until("benchmarks.tenants_app", self.queue, self.env,
                     lambda: all(self._handled(store)[0] >= messages for store in self.others), 120 + messages / 10,
                     f"handle {messages} messages of each store")

    def _pace(self, messages: int) -> float:
        spans = [self._handled(store) for store in self.others]
        first, last = min(span[1] for span in spans), max(span[2] for span in spans)
        return messages * len(self.others) / (last - first).total_seconds()

    def _empty(self) -> None:
        """The queue purged; every store's inbox, outgoing rows and dead letters (the parked) deleted."""
        with self.app.connection_for_write() as connection:
            self.app.amqp.queues[self.queue].bind(connection.default_channel).purge()
        for store in self.stores:
            with using_tenant(store):
                tables = self.outbox.store.tables
                with self.outbox.store.begin() as conn:
                    for table in (tables.incoming, tables.outgoing, tables.dead_letters):
                        conn.execute(delete(table))

    def close(self) -> None:
        delete_queues(self.app, [self.queue])
        for store in self.stores[1:]:
            with using_tenant(store):
                self.outbox.store.engine.dispose()
        drop_store(self.outbox)


def measure(admin: Engine, default_url: str, tenant_urls: dict[str, str], options: Options) -> list[Result]:
    """The row: the other stores' pace with one tenant down against it with every tenant up."""
    messages, repeats = options.units(MESSAGES, 30), options.size(ROUNDS, 1)
    run = Run(admin, default_url, tenant_urls)
    try:
        rounds = []
        for number in range(repeats):
            paces = {down: run.measure(down, messages) for down in in_turn((False, True), number)}
            print(f"  tenants, one down, round {number + 1}/{repeats}: the others' pace "
                  f"{paces[True]:.0f}/s with {run.victim} down, {paces[False]:.0f}/s with every tenant up",
                  file=sys.stderr)
            rounds.append((paces[True], paces[False], None))
    finally:
        run.close()
    others = len(run.others)
    return [Result.of_rounds(
        "tenants", f"Redis, a worker (prefork, 2) on {others} stores' messages mixed with a tenant's: its database "
        "refusing sessions vs up", "msgs/s", rounds, target=(">=", TARGET), versus=EVERY_TENANT_UP,
        note=f"{messages} messages of each of {others + 1} stores in the queue; the down tenant's parked in the "
             f"default store; each round's ratio: {', '.join(f'{down / up:.2f}' for down, up, _ in rounds)}; "
             f"median pace with every tenant up {statistics.median(up for _, up, _ in rounds):.0f}/s")]
