"""Tenants on real PostgreSQL databases with real worker processes (prefork, two pool processes,
Redis): tests/apps/tenant_app.py.

The module creates three tenant databases (``CREATE DATABASE``, dropped with ``WITH (FORCE)`` at
its end); each test has a table prefix of its own, under which the default store (in the test
database) and every tenant's store and tables live. ``outbox_tenants`` is the dotted path of a
callable that reads a JSON file of the test's, so a tenant can be added while the worker runs.
A producer (the test process, one thread per store) commits each order row and its message in
one unit of work of the order's tenant; the task writes its effect through ``self.session``,
naming the tenant it ran for and the database it wrote in. The checks read each database on a
connection of their own:

* nothing lost: every committed order has its effect, in the order's own database;
* exactly once: no order has two effects;
* nowhere else: no database holds an effect, or an inbox row, of another store's order;
* nothing pending: every store's outgoing rows are acknowledged by the inbox that claimed them.

Tenants in one process on SQLite files: tests/unit/core/test_tenancy.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import psycopg
import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from celery_outbox import OutboxError, using_tenant
from celery_outbox.core.crashpoints import ENVIRONMENT_VARIABLE, EXIT_CODE

from ..apps import tenant_app
from ..brokers import purge
from ..conftest import SUMMARY_LINE, drop_store
from ..faults.chaos import ConnectionKiller
from ..services import require, wait_until
from ..workers import WorkerProcess

# One xdist worker runs the module's tests one after another, on one set of tenant databases: each
# test's processes hold sessions on every store, and the server's sessions are shared with the suite.
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker, pytest.mark.xdist_group("tenants-workers")]

TENANTS = ("acme", "globex", "initech")
ORDERS = 30  # per store and test
# Maintenance in seconds, run by the tests themselves (no beat): a node is declared dead two recover
# passes after its heartbeat fell silent for 1.5 s, a sent message no inbox acknowledged goes out again
# after 4 s (the fault drills' FAST_MAINTENANCE).
FAST_MAINTENANCE = {
    "outbox_recover_interval": 1, "outbox_cleanup_interval": 1, "outbox_node_heartbeat_interval": 0.5,
    "outbox_node_stale_after": 1.5, "outbox_node_stale_checks": 2, "outbox_redeliver_after": 4,
}
DEFAULT = "default"  # the label of the default store (tenant None) in order ids and reports


def label(tenant: str | None) -> str:
    return DEFAULT if tenant is None else tenant


def with_database(url: str, database: str) -> str:
    return urlsplit(url)._replace(path=f"/{database}").geturl()


def libpq(url: str) -> str:
    """A SQLAlchemy URL as psycopg takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://")


class TenantDatabases:
    """Databases created on the test server for this module, dropped (``WITH (FORCE)``) at its end."""

    def __init__(self, server_url: str):
        self.server_url = server_url
        self.admin_url = libpq(with_database(server_url, "postgres"))
        self.run = uuid.uuid4().hex[:8]
        self.names: dict[str, str] = {}  # tenant -> database name

    def create(self, tenant: str) -> str:
        """A new database for ``tenant``; its URL."""
        name = f"co_tenant_{self.run}_{tenant}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.names[tenant] = name
        return self.url(tenant)

    def url(self, tenant: str) -> str:
        return with_database(self.server_url, self.names[tenant])

    def drop_all(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            for name in self.names.values():
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def tenant_databases():
    databases = TenantDatabases(require("postgres"))
    try:
        for tenant in TENANTS:
            databases.create(tenant)
        yield databases
    finally:
        databases.drop_all()


class DatabaseConnectionsKiller(ConnectionKiller):
    """Ends every session on one database (but its own) at random intervals, as a failover of that
    tenant's server would: the drills' ``ConnectionKiller``, aimed at a database, not a role."""

    def __init__(self, admin_url: str, database: str, **options: Any):
        super().__init__(admin_url, {}, on_fault=lambda: None, kinds=("database",), **options)
        self.database = database
        self.sessions_ended = 0

    def _terminate_one(self, kind: str) -> bool:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=2) as conn:
            ended = conn.execute("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                                 "WHERE datname = %s AND pid <> pg_backend_pid()", (self.database,)).fetchone()[0]
        self.sessions_ended += ended or 0
        return bool(ended)


@dataclass
class Audit:
    """What every store holds after a run (see the module's docstring)."""

    orders: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    duplicate_effects: int = 0
    misplaced: list[str] = field(default_factory=list)  # effects or inbox rows in a database not the order's
    unacknowledged: dict[str, int] = field(default_factory=dict)  # outgoing rows left, per store
    not_handled: dict[str, int] = field(default_factory=dict)  # inbox rows of orders not handled, per store
    dead_letters: dict[str, int] = field(default_factory=dict)

    def line(self, name: str, **more: Any) -> str:
        extra = "".join(f", {key.replace('_', ' ')} {value}" for key, value in more.items())
        return (f"tenant drill {name}: orders {sum(self.orders.values())} ({self.orders}), lost {self.lost}, "
                f"duplicate effects {self.duplicate_effects}, misplaced {len(self.misplaced)}{extra}")


class Cluster:
    """The default store and the tenants' stores of one test, its worker processes and its producer."""

    def __init__(self, broker_url: str, default_url: str, prefix: str, tmp_path: Path, databases: TenantDatabases,
                 **conf: Any):
        self.tmp_path, self.databases = tmp_path, databases
        self.tenants_file = tmp_path / "tenants.json"
        self.tenants_file.write_text(json.dumps({tenant: databases.url(tenant) for tenant in TENANTS}))
        gates = tmp_path / "gates"
        gates.mkdir()
        self.gates = gates
        queue = f"tenants_{uuid.uuid4().hex[:8]}"
        conf = {**FAST_MAINTENANCE, **conf}
        self.env = {
            "TEST_BROKER_URL": broker_url, "TEST_DATABASE_URL": default_url, "TEST_TABLE_PREFIX": prefix,
            "TEST_QUEUE": queue, "TEST_TENANTS_FILE": str(self.tenants_file), "TEST_GATE_DIR": str(gates),
            "TEST_CONF": json.dumps(conf),
        }
        self.queue = queue
        self.shop = tenant_app.create(broker_url, default_url, prefix, queue,
                                      lambda: tenant_app.tenants_from_file(str(self.tenants_file)), str(gates),
                                      **conf)
        self.urls: dict[str | None, str] = {None: default_url}
        self.readers: dict[str | None, Any] = {}
        self.workers: list[WorkerProcess] = []
        for tenant in (None, *TENANTS):
            self.prepare(tenant)

    # -- stores --------------------------------------------------------------------------------

    def prepare(self, tenant: str | None, url: str | None = None) -> None:
        """The store's tables and the app's in the database of ``tenant`` (known to this process's
        outbox by then), and a reader of its own on it."""
        if tenant not in self.urls:
            self.urls[tenant] = url or self.databases.url(tenant)
        url = self.urls[tenant]
        with using_tenant(tenant):
            self.shop.outbox.ready()
        reader = self.readers[tenant] = create_engine(url, poolclass=NullPool)  # a connection per reading
        self.shop.metadata.create_all(reader)

    def add_tenant(self, tenant: str) -> None:
        """A new tenant database, listed in the tenants file (which a worker reads again for a name it
        does not know), with its tables made: the store's and the app's."""
        url = self.databases.create(tenant)
        listed = json.loads(self.tenants_file.read_text())
        self.tenants_file.write_text(json.dumps({**listed, tenant: url}))
        self.prepare(tenant, url)

    def stores(self) -> list[str | None]:
        return list(self.urls)

    def store_of(self, tenant: str | None):
        with using_tenant(tenant):
            return self.shop.outbox.store

    def read(self, tenant: str | None, statement: Any) -> list[Any]:
        with self.readers[tenant].connect() as conn:
            return conn.execute(statement).all()

    def safely(self, read: Callable[[], Any], fallback: Any = None) -> Any:
        """``read()``, or ``fallback`` when its database session was just ended (the drill's killer)."""
        try:
            return read()
        except SQLAlchemyError:
            return fallback

    def orders(self, tenant: str | None) -> set[str]:
        return {row.order_id for row in self.read(tenant, select(self.shop.orders.c.order_id))}

    def effects(self, tenant: str | None) -> list[Any]:
        return self.read(tenant, select(self.shop.effects))

    def outgoing(self, tenant: str | None) -> int:
        table = self.store_of(tenant).tables.outgoing
        return self.read(tenant, select(func.count()).select_from(table))[0][0]

    def incoming(self, tenant: str | None) -> list[Any]:
        table = self.store_of(tenant).tables.incoming
        return self.read(tenant, select(table.c.message_id, table.c.status, table.c.owner))

    def dead_letters(self, tenant: str | None) -> list[Any]:
        table = self.store_of(tenant).tables.dead_letters
        return self.read(tenant, select(table.c.message_id, table.c.reason))

    # -- processes -----------------------------------------------------------------------------

    def worker(self, **more_env: str) -> WorkerProcess:
        name = f"worker{len(self.workers)}"
        env = dict(self.env, PGAPPNAME=f"{self.shop.outbox.settings.table_prefix}{name}",  # its sessions, by name
                   **more_env)
        worker = WorkerProcess("tests.apps.tenant_app", env, pool="prefork", concurrency=2, queues=[self.queue],
                               log_path=self.tmp_path / f"{name}.log").start()
        self.workers.append(worker)
        return worker.wait_ready()

    def place(self, order_id: str, tenant: str | None, task: Any = None, patience: float = 60.0) -> None:
        """Commit the order and its message for ``tenant``; a unit of work whose database session was
        ended is tried again, unless its commit went through before the session ended."""
        def placed() -> bool:
            try:
                self.shop.place(order_id, tenant, task or self.shop.apply_order)
                return True
            except (SQLAlchemyError, OutboxError):
                return self.safely(lambda: order_id in self.orders(tenant), False)

        wait_until(placed, timeout=patience, message=f"order {order_id} committed for {label(tenant)}")

    def produce(self, tenants: Iterable[str | None], count: int = ORDERS, name: str = "order", pace: float = 0.0,
                wait: bool = True) -> Callable[[], None]:
        """Place ``count`` orders for each of ``tenants``, one producer thread per tenant, at once, an
        order every ``pace`` seconds; returns a function that waits for the producers (``wait``: called
        already) and raises what one of them raised."""
        errors: list[BaseException] = []

        def producer(tenant: str | None) -> None:
            try:
                for number in range(count):
                    self.place(f"{label(tenant)}-{name}-{number}", tenant)
                    if pace:
                        time.sleep(pace)  # spreads the orders over the run, so faults meet messages in flight
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread by done()
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(tenant,), name=f"producer-{label(tenant)}")
                   for tenant in tenants]
        for thread in threads:
            thread.start()

        def done() -> None:
            for thread in threads:
                thread.join(timeout=120)
            if errors:
                raise errors[0]
            assert not any(thread.is_alive() for thread in threads), "a producer did not finish"

        if wait:
            done()
        return done

    def applied(self) -> int:
        """Orders applied so far, in every store (a store being read as its session ends counts none)."""
        def of(tenant: str | None) -> int:
            return self.safely(lambda: len({row.order_id for row in self.effects(tenant)}), 0)

        return sum(of(tenant) for tenant in self.stores())

    def recover(self, tenant: str | None):
        """One recover pass over ``tenant``'s store, as beat's per-tenant task runs it."""
        with using_tenant(tenant):
            return self.shop.outbox.recover()

    # -- the outcome ---------------------------------------------------------------------------

    def complete(self, tenant: str | None) -> bool:
        """Every order of the store has its effect and every outgoing row is acknowledged."""
        def read() -> bool:
            applied = {row.order_id for row in self.effects(tenant)}
            return self.orders(tenant) <= applied and self.outgoing(tenant) == 0
        return self.safely(read, False)

    def wait_complete(self, tenants: Iterable[str | None], timeout: float = 60.0,
                      between: Callable[[], Any] | None = None) -> None:
        tenants = list(tenants)

        def done() -> bool:
            if between is not None:
                between()
            return all(self.complete(tenant) for tenant in tenants)

        wait_until(done, timeout=timeout, interval=0.2,
                   message=f"the orders of {[label(t) for t in tenants]} applied (logs in {self.tmp_path})")

    def audit(self) -> Audit:
        """What every store holds now; read again when a session is refused (the server is shared)."""
        return wait_until(lambda: self.safely(self._audit), timeout=30, message="every store read")

    def _audit(self) -> Audit:
        audit = Audit()
        every_order = {tenant: self.orders(tenant) for tenant in self.stores()}
        for tenant in self.stores():
            name, orders = label(tenant), every_order[tenant]
            database = self.read(tenant, text("SELECT current_database()"))[0][0]
            effects = self.effects(tenant)
            applied = [row.order_id for row in effects]
            audit.orders[name] = len(orders)
            audit.lost += len(orders - set(applied))
            audit.duplicate_effects += len(applied) - len(set(applied))
            audit.misplaced += [f"effect of {row.order_id} (for {row.tenant}, written in {row.database}) in {name}"
                                for row in effects if row.order_id not in orders or row.tenant != tenant
                                or row.database != database]
            incoming = self.incoming(tenant)
            audit.misplaced += [f"inbox row of {row.message_id} in {name}" for row in incoming
                                if row.message_id not in orders]
            audit.not_handled[name] = len(orders - {row.message_id for row in incoming if row.status == "handled"})
            audit.unacknowledged[name] = self.outgoing(tenant)
            audit.dead_letters[name] = len(self.dead_letters(tenant))
        return audit

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(cold=True)
        purge(self.shop.app, self.queue)
        try:
            self.shop.outbox.nodes.deregister()
        except Exception:  # noqa: BLE001 - its tables are dropped, its database too at the module's end
            pass
        default = self.shop.outbox.store
        self.shop.metadata.drop_all(self.readers[None])
        drop_store(default)
        for tenant in self.stores():
            self.store_of(tenant).engine.dispose()
            self.readers[tenant].dispose()


@pytest.fixture
def cluster(tenant_databases, table_prefix, tmp_path):
    cluster = Cluster(require("redis"), require("postgres"), table_prefix, tmp_path, tenant_databases)
    yield cluster
    cluster.close()


def assert_exactly_once(audit: Audit) -> None:
    assert audit.lost == 0, audit
    assert audit.duplicate_effects == 0, audit
    assert audit.misplaced == [], audit
    assert set(audit.unacknowledged.values()) == {0}, audit
    assert set(audit.not_handled.values()) == {0}, audit
    assert set(audit.dead_letters.values()) == {0}, audit


def test_each_tenants_messages_are_stored_claimed_and_applied_once_in_its_own_database(cluster, record_property):
    """Three tenants and the default store, one producer each at once: every effect lands once, in
    its own tenant's database, claimed by the inbox there; every outgoing row is acknowledged."""
    started = time.monotonic()
    cluster.worker()
    cluster.produce([*TENANTS, None])
    cluster.wait_complete(cluster.stores())
    audit = cluster.audit()
    record_property(SUMMARY_LINE, audit.line("every store", seconds=f"{time.monotonic() - started:.1f}"))
    assert audit.orders == {label(tenant): ORDERS for tenant in cluster.stores()}
    assert_exactly_once(audit)
    for tenant in TENANTS:
        assert {row.tenant for row in cluster.effects(tenant)} == {tenant}
        assert {row.database for row in cluster.effects(tenant)} == {tenant_name(cluster, tenant)}


def tenant_name(cluster: Cluster, tenant: str) -> str:
    return cluster.databases.names[tenant]


def test_sessions_of_one_tenant_ended_again_and_again_lose_nothing_and_write_nothing_elsewhere(cluster,
                                                                                              record_property):
    """Every session on one tenant's database is ended at random moments while the producers send to
    every store and the worker consumes; the worker is SIGKILLed mid-run and another takes over. The
    other tenants' messages all complete meanwhile, with recovery passes for them running as beat's
    per-tenant tasks do (the killed worker's copies of their messages come back through it); then
    recovery passes for every tenant complete the victim's. Nothing lost, nothing applied twice,
    nothing written in another tenant's database. (One worker at a time: each process has sessions
    on every store, and the server's are shared with the rest of the suite.) How long the others
    wait behind the victim's messages is not asserted: docs/tenancy.md says what a down tenant costs
    the others."""
    victim, others = "globex", [tenant for tenant in (*TENANTS, None) if tenant != "globex"]
    started = time.monotonic()
    passes = []

    def recover(tenants) -> None:
        for tenant in tenants:
            try:
                passes.append(cluster.recover(tenant))
            except (SQLAlchemyError, OutboxError):  # a pooled session the killer ended: the next pass
                pass

    doomed = cluster.worker()
    killer = DatabaseConnectionsKiller(cluster.databases.admin_url, tenant_name(cluster, victim),
                                       interval=(0.1, 0.4))
    killer.start()
    try:
        produced = cluster.produce([*TENANTS, None], pace=0.03, wait=False)
        wait_until(lambda: cluster.applied() >= ORDERS, timeout=60, interval=0.1,
                   message="a quarter of the orders applied")
        doomed.kill()
        cluster.worker()
        produced()
        cluster.wait_complete(others, timeout=180, between=lambda: recover(others))
        wait_until(lambda: killer.total >= 5 or not killer._thread.is_alive(), timeout=30,
                   message="five rounds of sessions ended on the victim")
    finally:
        killer.stop()
    victim_left = len(cluster.safely(lambda: cluster.orders(victim), set())) - len(
        {row.order_id for row in cluster.safely(lambda: cluster.effects(victim), [])})
    cluster.wait_complete(cluster.stores(), timeout=120, between=lambda: recover(cluster.stores()))
    audit = cluster.audit()
    record_property(SUMMARY_LINE, audit.line(
        f"{victim} under fire", rounds=killer.total, sessions_ended=killer.sessions_ended,
        sessions_refused_to_the_killer=len(killer.errors), workers_killed=1, left_to_recovery=victim_left,
        redelivered=sum(result.redelivered for result in passes), seconds=f"{time.monotonic() - started:.1f}"))
    assert killer.sessions_ended > 0, killer.errors  # its errors: the server refused it a session (busy)
    assert audit.orders == {label(tenant): ORDERS for tenant in cluster.stores()}
    assert_exactly_once(audit)


def test_a_tenant_added_while_the_worker_runs_has_its_messages_stored_consumed_and_claimed_in_its_database(
        cluster):
    worker = cluster.worker()
    cluster.produce(["acme"], 5, name="before")
    cluster.wait_complete(["acme"])  # the worker has read the tenants file: it knew three tenants
    cluster.add_tenant("umbrella")
    cluster.produce(["umbrella", "acme"], 10, name="after")
    cluster.wait_complete(cluster.stores())
    assert worker.process.poll() is None, "the worker that found the new tenant is the one started before it"
    audit = cluster.audit()
    assert audit.orders == {DEFAULT: 0, "acme": 15, "globex": 0, "initech": 0, "umbrella": 10}
    assert_exactly_once(audit)
    effects = cluster.effects("umbrella")
    assert {(row.tenant, row.database) for row in effects} == {("umbrella", tenant_name(cluster, "umbrella"))}
    handled = {row.message_id for row in cluster.incoming("umbrella") if row.status == "handled"}
    assert handled == {f"umbrella-after-{number}" for number in range(10)}, "claimed in the new tenant's store"
    assert "which outbox_tenants does not know" not in worker.log()


def test_a_killed_workers_claims_are_released_in_every_tenant_store_and_a_second_worker_runs_them(cluster):
    """Held bodies run for two tenants (eager claims, owned by the pool processes' nodes in each
    tenant's store) when the worker is SIGKILLed: recovery in each tenant's store declares the
    node there dead and releases its claim; a second worker runs both messages to completion."""
    held = {"acme": "acme-held", "initech": "initech-held"}
    worker = cluster.worker()
    for tenant, order_id in held.items():
        cluster.place(order_id, tenant, cluster.shop.hold)
    wait_until(lambda: all((cluster.gates / f"{order_id}.started").exists() for order_id in held.values()),
               timeout=60, message=f"both held bodies started (log: {worker.log_path})")
    owners = {}
    for tenant, order_id in held.items():
        (row,) = cluster.incoming(tenant)
        assert (row.message_id, row.status) == (order_id, "running") and row.owner, row
        owners[tenant] = row.owner
    pids = {(cluster.gates / f"{order_id}.started").read_text() for order_id in held.values()}
    assert len(pids) == 2, "each body runs in its own pool process"
    worker.kill()

    declared: dict[str, list[int]] = {tenant: [] for tenant in held}
    released = dict.fromkeys(held, 0)

    def claims_released() -> bool:
        for tenant in held:
            if owners[tenant] not in declared[tenant]:
                result = cluster.recover(tenant)
                declared[tenant] += result.nodes_declared_dead
                released[tenant] += result.claims_released
        return all(owners[tenant] in declared[tenant] for tenant in held)

    wait_until(claims_released, timeout=30, interval=0.3, message="the killed node declared dead in both stores")
    assert released == dict.fromkeys(held, 1), released
    for tenant in held:
        assert [(row.status, row.owner) for row in cluster.incoming(tenant)] != [("running", owners[tenant])]
    for order_id in held.values():
        (cluster.gates / f"{order_id}.open").touch()
    cluster.worker()
    cluster.wait_complete(held, timeout=60, between=lambda: [cluster.recover(tenant) for tenant in held])
    audit = cluster.audit()
    assert audit.orders == {DEFAULT: 0, "acme": 1, "globex": 0, "initech": 1}
    assert_exactly_once(audit)


class DatabaseGate:
    """A tenant database that refuses every session (``ALLOW_CONNECTIONS false``, its sessions
    ended), as a tenant's server that is down does, until it is opened again."""

    def __init__(self, admin_url: str, database: str):
        self.admin_url, self.database = admin_url, database

    def _run(self, *statements: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def close(self) -> None:
        self._run(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS false',
                  f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{self.database}'")

    def open(self) -> None:
        self._run(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS true')


def waiting(cluster: Cluster) -> int:
    """Messages in the cluster's queue that no worker has taken (Redis keeps no empty queue)."""
    with cluster.shop.app.connection_for_read() as connection, connection.channel() as channel:
        try:
            return channel.queue_declare(cluster.queue, passive=True).message_count
        except connection.channel_errors:
            return 0


def test_a_tenant_whose_database_is_down_has_its_messages_parked_while_the_others_run(cluster, record_property):
    """Orders of every store wait in the queue; one tenant's database then refuses every session
    and a worker starts: the other stores' orders all complete while it is down (their recovery
    running as beat's per-tenant tasks do), the victim's messages parked in the default store
    (acked: none circles back to the worker); once the database answers, the victim's recovery
    sends them again and each is applied once, in its own database."""
    victim, others = "globex", [tenant for tenant in (*TENANTS, None) if tenant != "globex"]
    cluster.produce([*TENANTS, None])
    gate = DatabaseGate(cluster.databases.admin_url, tenant_name(cluster, victim))
    gate.close()
    try:
        started = time.monotonic()
        cluster.worker()
        cluster.wait_complete(others, timeout=120, between=lambda: [cluster.recover(tenant) for tenant in others])
        others_done = time.monotonic() - started
        default = cluster.store_of(None).tables.dead_letters

        def parked() -> int:
            return cluster.read(None, select(func.count(func.distinct(default.c.message_id)))
                                .where(default.c.reason == "tenant_unavailable"))[0][0]

        wait_until(lambda: parked() == ORDERS, timeout=60, message=f"the {victim}'s {ORDERS} messages parked")
        # parked and acked: the queue empties while the tenant is down (a copy the broker restored
        # meanwhile, past its visibility timeout, is parked again: its letter is one more)
        wait_until(lambda: waiting(cluster) == 0, timeout=60, message="the queue empty while the tenant is down")
    finally:
        gate.open()
    cluster.wait_complete(cluster.stores(), timeout=120, between=lambda: cluster.recover(victim))
    audit = cluster.audit()
    record_property(SUMMARY_LINE, audit.line(f"{victim} down", others_done_in=f"{others_done:.1f} s"))
    assert audit.orders == {label(tenant): ORDERS for tenant in cluster.stores()}
    assert_exactly_once(audit)


# Seconds a pool process's death may wait for Celery's answer: Celery re-sends the lost attempt
# (``retry_on_worker_lost``) up to ``worker_lost_wait`` (10 s) after it saw the process die, a new
# outgoing row in its tenant's store that the inbox then discards (the fault drills' LOST_WORKER_GRACE)
LOST_WORKER_GRACE = 15.0


def settled_audit(cluster: Cluster, between: Callable[[], Any]) -> Audit:
    """The audit once nothing is pending in any store (``between`` runs before each look), or the
    last one, for the assertions to name what is left, after ``LOST_WORKER_GRACE`` and a margin."""
    last: list[Audit] = []

    def settled() -> Audit | None:
        between()
        audit = cluster.audit()
        last[:] = [audit]
        return audit if not any(audit.unacknowledged.values()) and not any(audit.not_handled.values()) else None

    try:
        return wait_until(settled, timeout=LOST_WORKER_GRACE + 30, interval=0.5, message="nothing pending")
    except AssertionError:
        return last[0]


@pytest.mark.parametrize("point", ["after_claim", "before_commit", "after_commit"])
def test_a_crash_point_of_one_tenant_loses_nothing_and_the_others_run(cluster, point, record_property):
    """Processes of the worker die at a crash point every eighth time they reach it working for one
    tenant (``<point>:8@globex``): pool processes in the attempt's claim, before its commit, after
    it (the pool starts another), and the main process where it re-sends a lost attempt (the test
    starts another worker, as a supervisor does). The other stores' orders all complete meanwhile,
    with recovery passes for them as beat's per-tenant tasks run; then recovery passes for every
    store complete the victim's. Nothing lost, nothing applied twice, nothing written in another
    tenant's database. (Every eighth: a message Celery re-sends after its process died rarely
    comes as another process's eighth, so none dies four times and ends as a dead letter.)"""
    victim, others = "globex", [tenant for tenant in (*TENANTS, None) if tenant != "globex"]
    armed = {ENVIRONMENT_VARIABLE: f"{point}:8@{victim}"}
    started = time.monotonic()
    cluster.worker(**armed)

    def supervise_and_recover(tenants) -> None:
        if all(worker.process.poll() is not None for worker in cluster.workers):
            assert cluster.workers[-1].process.returncode == EXIT_CODE, cluster.workers[-1].log()[-3000:]
            cluster.worker(**armed)
        for tenant in tenants:
            cluster.recover(tenant)

    cluster.produce([*TENANTS, None])
    cluster.wait_complete(others, timeout=120, between=lambda: supervise_and_recover(others))
    cluster.wait_complete(cluster.stores(), timeout=180, between=lambda: supervise_and_recover(cluster.stores()))
    audit = settled_audit(cluster, between=lambda: supervise_and_recover(cluster.stores()))
    crashes = sum(worker.log().count(f"crash point {point} reached") for worker in cluster.workers)
    record_property(SUMMARY_LINE, audit.line(f"{victim} at {point}", processes_crashed=crashes,
                                             workers_started=len(cluster.workers),
                                             seconds=f"{time.monotonic() - started:.1f}"))
    assert crashes >= 1, f"the point never fired (logs in {cluster.tmp_path})"
    assert audit.orders == {label(tenant): ORDERS for tenant in cluster.stores()}
    assert_exactly_once(audit)
