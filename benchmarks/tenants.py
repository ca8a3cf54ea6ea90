"""tenants: what tenancy (``outbox_tenants``) costs, side by side with one store, on PostgreSQL and Redis.

The benchmark makes its own databases (unique names, dropped at the end, ``Databases``): the
default store's, one per tenant, and one whose schemas hold the tenants of the largest case.

First the unit of work. Every unit writes one row of the user's data (``producer_row``'s table,
made in each database) and sends N = 1 or 10 tasks to a durable queue (their rows stored marked
sent in its transaction, published after the commit). The ways, taking turns in rounds
(``in_rounds``), each timed over a round's units of work, one after another:

* the default store's: ``with outbox.transaction() as session:`` (no tenant), as an application
  without tenants runs it;
* a tenant's: ``with outbox.transaction(tenant=name) as session:``, the tenant turning over the
  ten tenants' databases unit by unit (each tenant's engine, pool, node and prepared statements
  its own, as in an application whose requests come for many customers);
* the tenant unit's floor, by hand, with no library code: ``producer_row.Floor`` on a plain
  SQLAlchemy engine of each tenant's database, turning over them the same way: the row, the
  messages' rows (marked sent) inserted by a statement sent with the COMMIT in one network
  message, then the ``apply_async`` calls. The least any implementation that stores a tenant's
  messages in the tenant's transaction does (an ``INSERT`` through SQLAlchemy's ``execute`` would
  cost one round trip more than ours: no floor). At N = 1 only: at N = 10 the library sends its
  publishes to Redis in one pipeline, where the floor's ``apply_async`` calls go one by one, so
  there it is no floor (as in ``producer_row``);
* at N = 1 also the same floor on a plain engine of the default store's database alone: what
  turning over ten databases costs with no library code at all.

In the ``vs peer`` block (the default store's unit the peer): a tenant's unit of work against the
default store's (target 0.95: tenancy costs at most 5% of a unit of work), with its floor; and at
N = 1 the floor turning over the tenants' databases against the floor on one database. The note
of the N = 1 row gives, from a pass of its own after the rounds, how many times per unit of work
the store's engines pinged a pooled connection on checkout (``ping_when_idle``: one idle for more
than ``PING_AFTER_IDLE``, 50 ms), a tenant's against the default store's: a tenant's connection
sits idle while the other tenants' units run.

Then beat's recover pass against the number of tenants. Beat's run sends one
``celery_outbox.recover`` task per tenant (``send_per_tenant``), and each runs the pass of its
tenant's store as the task body runs it: ``with using_tenant(t): recover(runtime)``. Timed here:
one such pass for every tenant of a case, one after another in the benchmark's process (the
time a worker spends on one beat run's tasks), beside the default store's own pass in the same
rounds, with the stores idle (nothing to do) and with ``PENDING`` unsent rows in each (put in
before the timed pass, as committed rows nobody published: the relay publishes them). The cases:

* 1 and 10 tenants, each a database, each tenant's connection kept in its engine's pool between
  passes (a worker that runs every tenant's task keeps one connection per tenant open);
* 10 tenants, each a database, 10 tenants, each a schema of one database, and 100 tenants, each
  tenant's connections closed after its pass (the next pass connects again). PostgreSQL's default
  ``max_connections`` is 100: a process that kept a connection per tenant for 100 tenants would
  take them all. The 100 tenants are databases where making them is quick (``CREATING_WITHIN``:
  at the median ``CREATE DATABASE`` of the run's first eleven databases, 100 within 20 s), else
  schemas of one database: on the 2-core host this was written on a ``CREATE DATABASE`` took from
  0.02 s (idle) to over 1 s (under other work), and the case's note says which it was. The 10
  schemas say whether a schema's pass costs what a database's does.

The pooled and the closed cases name the same ten databases under two names each (``pooled-dbN``
and ``dbN``), so that each case has engines of its own. Each row: the seconds of one pass over
every tenant of its case against the default store's pass times the number of tenants (the ratio:
a tenant's pass against the default store's); the note gives the milliseconds a tenant. The
note of the largest case also says what beat's own run took to send one task per tenant.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

from celery import Celery
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, create_engine, delete, insert
from sqlalchemy.engine import Engine, make_url

from celery_outbox import Outbox, using_tenant
from celery_outbox.maintenance.beat import RECOVER_TASK, send_per_tenant
from celery_outbox.maintenance.recover import recover
from celery_outbox.store.engine import PING_AFTER_IDLE

from . import tenants_down
from .common import POSTGRES_URL, REDIS_URL, Options, Result, in_rounds, rate, unique_prefix
from .producer import build
from .producer_row import Floor, captured_rows

BATCHES = (1, 10)
# Rounds per N and units of work per way and round: at N = 1, the target's, sixteen rounds (the
# interval of a ratio the 5th to the 12th round's); at N = 10 eight (the 2nd to the 7th)
ROUNDS = {1: 16, 10: 8}
UNITS = {1: 240, 10: 100}
TARGET = 0.95
TENANTS = 10  # the tenants the units of work turn over, each a database
SINGLE = "the default store's unit of work"
ONE_DATABASE = "the floor on one database"
WAYS = ("default store", "tenant", "floor", "floor on one database")

# Beat's pass: the tenants of the largest case, the unsent rows of each store in the pending state,
# and the rounds (eight: the interval the 2nd to the 7th round's)
LARGEST = 100
#: The largest case's tenants are databases where making them would take at most this many seconds
#: at the median ``CREATE DATABASE`` of the run's first databases, else schemas of one database
CREATING_WITHIN = 20.0
PENDING = 10
PASS_ROUNDS = 8
#: A round's measurement of a case is the median of as many passes over its tenants as make at
#: least this many tenants' passes (the default store's: of this many passes): one pass of a few
#: milliseconds is at the mercy of the host's noise
AT_LEAST = 10
EACH_PASS = "the default store's pass, once per tenant"


class Databases:
    """The benchmark's databases, made with unique names and dropped (with what is connected to
    them) at the end; the seconds each ``CREATE DATABASE`` took."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.url = make_url(POSTGRES_URL)
        self.admin = create_engine(self.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
        self.made: list[str] = []
        self.seconds: list[float] = []

    def create(self, name: str) -> str:
        """A new database named the prefix and ``name``: its URL."""
        database = f"{self.prefix}{name}"
        started = time.perf_counter()
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
        self.seconds.append(time.perf_counter() - started)
        self.made.append(database)
        return self.url.set(database=database).render_as_string(hide_password=False)

    def connections(self, names: list[str]) -> int:
        """How many connections the server has to the databases ``names`` (this process's alone:
        nobody else knows them)."""
        with self.admin.connect() as conn:
            return conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%(names)s)",
                                        {"names": names}).scalar_one()

    def drop_all(self) -> None:
        with self.admin.connect() as conn:
            for database in reversed(self.made):
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        self.made = []
        self.admin.dispose()


def _app(prefix: str, default_url: str, tenants: dict[str, Any]) -> tuple[Celery, Outbox, Any, Any]:
    """The producer benchmark's app (``plain`` and ``durable`` tasks) with its default store at
    ``default_url`` and ``tenants``."""
    return build(REDIS_URL, prefix=prefix, database_url=default_url, outbox_tenants=tenants,
                 outbox_maintenance_queue=f"{prefix}maintenance")


def _tear_down(app: Celery, outbox: Outbox, engines: Sequence[Engine] = ()) -> None:
    """The app's queues deleted (those it sent to without declaring them too), its nodes
    deregistered, every engine's connections closed (the tables go with their databases)."""
    prefix = outbox.settings.table_prefix
    try:
        for name in (f"{prefix}plain", f"{prefix}durable", f"{prefix}maintenance"):
            app.amqp.queues.select_add(name)
        with app.connection_for_write() as connection:  # a connection deletes only the queues it declared
            for queue in list(app.amqp.queues.values()):
                bound = queue.bind(connection.default_channel)
                bound.declare()
                bound.delete()
    finally:
        try:
            outbox.nodes.deregister()
        finally:
            for engine in [outbox.engine, *(store.engine for store in outbox.runtime.tenant_stores()), *engines]:
                engine.dispose()
            app.close()


# -- the unit of work ------------------------------------------------------------------------------


@dataclass
class _Place:
    """What ``producer_row.Floor`` writes on: the outbox its rows are captured from, a plain
    engine of one tenant's database, and the user's row."""

    outbox: Outbox
    engine: Engine
    write: Any


class Units:
    """The ways of one unit of work writing one row and sending N durable tasks: on the default
    store, for a tenant (turning over them), the tenant unit's floor (turning the same way), and
    that floor on the default store's database alone."""

    def __init__(self, databases: Databases, tenants: int):
        prefix = unique_prefix()
        self.databases = databases
        self.default_url = databases.create("default")
        self.tenant_urls = {f"db{i}": databases.create(f"db{i}") for i in range(tenants)}
        self.app, self.outbox, self.plain, self.durable = _app(prefix, self.default_url, self.tenant_urls)
        self.names = list(self.tenant_urls)
        metadata = MetaData()
        orders = Table(f"{prefix}orders", metadata, Column("id", BigInteger, primary_key=True, autoincrement=True),
                       Column("item", String(100), nullable=False), Column("quantity", Integer, nullable=False))
        self.write = insert(orders).values(item="a book", quantity=1)
        self.engines = [create_engine(url) for url in self.tenant_urls.values()]  # the floor's: plain engines
        self.default_engine = create_engine(self.default_url)
        for engine in [self.outbox.engine, *self.engines]:
            metadata.create_all(engine)
        self.floors: dict[tuple[int, bool], list[Floor]] = {}
        self.turn = {"tenant": 0, "floor": 0}

    def single(self, units: int, n: int) -> None:
        """``outbox.transaction()`` on the default store."""
        task, write = self.durable, self.write
        for _ in range(units):
            with self.outbox.transaction() as session:
                session.execute(write)
                for i in range(n):
                    task.apply_async((i,))

    def tenant(self, units: int, n: int) -> None:
        """``outbox.transaction(tenant=...)``, each unit of work the next tenant's."""
        task, write, names = self.durable, self.write, self.names
        for _ in range(units):
            name = names[self.turn["tenant"] % len(names)]
            self.turn["tenant"] += 1
            with self.outbox.transaction(tenant=name) as session:
                session.execute(write)
                for i in range(n):
                    task.apply_async((i,))

    def floor(self, units: int, n: int, one_database: bool = False) -> None:
        """The floor by hand on each tenant's plain engine, each unit of work the next tenant's; with
        ``one_database``, on a plain engine of the default store's database alone."""
        key = (n, one_database)
        if key not in self.floors:
            self.floors[key] = [Floor(_Place(self.outbox, engine, self.write), self.durable, n)
                                for engine in ([self.default_engine] if one_database else self.engines)]
        floors = self.floors[key]
        for _ in range(units):
            floor = floors[self.turn["floor"] % len(floors)]
            self.turn["floor"] += 1
            floor.send(self.plain, 1, n)

    def pings(self, units: int) -> tuple[float, float]:
        """The pings per unit of work, a tenant's and the default store's, in a pass of ``units`` of
        each at N = 1 (not in the rounds): the store's engines ping a pooled connection on checkout
        when it sat idle for more than ``PING_AFTER_IDLE``, and a tenant's connection sits idle
        while the other tenants' units run."""
        engines = [self.outbox.engine, *(store.engine for store in self.outbox.runtime.tenant_stores())]
        counted = [0]

        def counting(ping: Any) -> Any:
            def do_ping(dbapi_connection: Any) -> Any:
                counted[0] += 1
                return ping(dbapi_connection)
            return do_ping

        for engine in engines:
            engine.dialect.do_ping = counting(engine.dialect.do_ping)
        try:
            per_unit = []
            for way in (self.tenant, self.single):
                counted[0] = 0
                way(units, 1)
                per_unit.append(counted[0] / units)
        finally:
            for engine in engines:
                del engine.dialect.do_ping
        return per_unit[0], per_unit[1]

    def connections(self) -> int:
        """The connections this process holds to the tenants' databases, the floor's closed first:
        the library's (each tenant's pool's, and its node's liveness connection)."""
        for engine in [*self.engines, self.default_engine]:
            engine.dispose()
        return self.databases.connections([make_url(url).database for url in self.tenant_urls.values()])

    def close(self) -> None:
        _tear_down(self.app, self.outbox, [*self.engines, self.default_engine])


def throughput(units_of: Units, options: Options) -> list[Result]:
    """Units of work per second of each way, N = 1 and 10, in rounds (the floors at N = 1 only: on
    Redis the library sends N > 1 publishes in one pipeline, where the floor's ``apply_async``
    calls go one by one, so there it is no floor, as in ``producer_row``)."""
    results = []
    tenants = len(units_of.names)
    for n in BATCHES:
        ways = [units_of.single, units_of.tenant]
        if n == 1:
            ways += [units_of.floor, partial(units_of.floor, one_database=True)]
        units, repeats = max(tenants, options.units(UNITS[n], 10)), options.size(ROUNDS[n], 1)
        for way in ways:  # warm: each tenant's pool, node and prepared statements made
            way(3 * tenants, n)
        rounds = in_rounds(repeats, *(partial(rate, units, partial(way, units, n)) for way in ways))
        for each in rounds:
            print(f"  tenants N={n}: " + ", ".join(
                f"{way} {value:.0f}/s" for way, value in zip(WAYS, each, strict=False)), file=sys.stderr)
        single, tenant = (statistics.median(each[index] for each in rounds) for index in (0, 1))
        note = (f"ms per unit of work: a tenant's {1e3 / tenant:.2f}, the default store's {1e3 / single:.2f} "
                f"({1e3 / tenant - 1e3 / single:+.2f})")
        if n == 1:
            tenant_pings, single_pings = units_of.pings(units)
            held = units_of.connections()
            single_of_floor = statistics.median(each[0] / each[3] for each in rounds)
            note += (f"; the default store's unit at {single_of_floor:.2f} of the floor on its database alone; "
                     f"pings of a pooled connection idle over {PING_AFTER_IDLE * 1e3:.0f} ms, per unit of work "
                     f"(a pass of its own): a tenant's {tenant_pings:.2f}, the default store's {single_pings:.2f}; "
                     f"connections this process holds to the {tenants} tenants' databases: {held}")
        case = f"Redis, N={n}, one row and {n} durable send{'s' if n > 1 else ''} in a unit of work"
        results.append(Result.of_rounds(
            "tenants", f"{case}: transaction(tenant=...) turning over {tenants} tenants' databases vs transaction() "
            "on the default store", "units/s", [(each[1], each[0], each[2] if n == 1 else None) for each in rounds],
            target=(">=", TARGET), versus=SINGLE, note=note))
        if n == 1:
            results.append(Result.of_rounds(
                "tenants", f"{case}, floor by hand: turning over {tenants} tenants' databases vs on one database",
                "units/s", [(each[2], each[3], None) for each in rounds], versus=ONE_DATABASE))
    return results


# -- beat's pass -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Some tenants whose passes run one after another: their names, where each is, and whether
    each tenant's connections are closed after its pass."""

    names: list[str]
    place: str
    closed: bool

    @property
    def label(self) -> str:
        count = len(self.names)
        connections = "its connections closed after its pass" if self.closed else "its connection kept in its pool"
        return f"{count} tenant{'s' if count > 1 else ''}, {'each ' if count > 1 else ''}{self.place}, {connections}"


class Passes:
    """Beat's recover pass: the default store's, and each tenant's as the per-tenant task body
    runs it, on an outbox of its own (its own tables) in the databases of ``Units``."""

    def __init__(self, databases: Databases, default_url: str, tenant_urls: list[str], largest: int,
                 as_databases: bool):
        prefix = unique_prefix()
        schemas_url = databases.create("schemas")
        bridge = len(tenant_urls)  # as many schemas as databases in the cases before
        urls = list(tenant_urls)
        if as_databases:
            urls += [databases.create(f"db{i}") for i in range(len(urls), largest)]
        tenants: dict[str, Any] = {}
        for i, url in enumerate(urls):
            tenants[f"db{i}"] = url
            if i < bridge:
                tenants[f"pooled-db{i}"] = url
        for i in range(bridge if as_databases else max(bridge, largest)):
            tenants[f"schema{i:03d}"] = {"url": schemas_url, "schema": f"{prefix}s{i:03d}"}
        self.app, self.outbox, _, durable = _app(prefix, default_url, tenants)
        self.runtime = self.outbox.runtime
        self.insert, self.values, _ = captured_rows(self.outbox, durable, PENDING)  # unsent rows
        databases_named = [f"db{i}" for i in range(largest)] if as_databases else \
            [f"schema{i:03d}" for i in range(largest)]
        in_databases, in_schemas = "a database", "a schema of one database"
        self.cases = [Case(["pooled-db0"], in_databases, False),
                      Case([f"pooled-db{i}" for i in range(bridge)], in_databases, False),
                      Case([f"db{i}" for i in range(bridge)], in_databases, True),
                      Case([f"schema{i:03d}" for i in range(bridge)], in_schemas, True),
                      Case(databases_named, in_databases if as_databases else in_schemas, True)]
        self.published = 0  # rows the pending passes published: every one put in

    def fill(self, tenant: str | None) -> None:
        """The store's outgoing table emptied, then ``PENDING`` unsent rows in it (not timed)."""
        with using_tenant(tenant):
            store = self.runtime.store
            with store.engine.begin() as conn:
                conn.execute(delete(store.tables.outgoing))
                conn.execute(self.insert, self.values)

    def one(self, tenant: str | None, closed: bool) -> int:
        """The pass of ``tenant``'s store, as the per-tenant task body runs it: the rows it published."""
        with using_tenant(tenant):
            published = recover(self.runtime).relay.published
            if closed:
                self.runtime.store.engine.dispose()
        return published

    def default_pass(self, pending: bool) -> float:
        """Seconds of the default store's pass (the median of ``AT_LEAST`` passes)."""
        return statistics.median(self._default_pass(pending) for _ in range(AT_LEAST))

    def _default_pass(self, pending: bool) -> float:
        if pending:
            self.fill(None)
        started = time.perf_counter()
        published = self.one(None, False)
        took = time.perf_counter() - started
        self._check(pending, published, 1)
        return took

    def case_pass(self, case: Case, pending: bool) -> float:
        """Seconds of one pass over every tenant of ``case``, one after another (the median of as
        many passes as make ``AT_LEAST`` tenants' passes)."""
        return statistics.median(self._case_pass(case, pending)
                                 for _ in range(max(1, AT_LEAST // len(case.names))))

    def _case_pass(self, case: Case, pending: bool) -> float:
        if pending:
            for name in case.names:
                self.fill(name)
                if case.closed:
                    with using_tenant(name):
                        self.runtime.store.engine.dispose()
        started = time.perf_counter()
        published = sum(self.one(name, case.closed) for name in case.names)
        took = time.perf_counter() - started
        self._check(pending, published, len(case.names))
        return took

    def _check(self, pending: bool, published: int, stores: int) -> None:
        expected = PENDING * stores if pending else 0
        if published != expected:
            raise RuntimeError(f"the passes published {published} rows of {stores} store(s), not {expected}")
        self.published += published

    def beat_sends(self) -> tuple[int, float]:
        """Beat's run sending one task per tenant (``send_per_tenant``): how many, and the seconds."""
        started = time.perf_counter()
        sent = send_per_tenant(self.runtime, RECOVER_TASK, self.runtime.settings.recover_interval)
        return len(sent), time.perf_counter() - started

    def close(self) -> None:
        _tear_down(self.app, self.outbox)


def beat_pass(passes: Passes, options: Options, created: float, created_count: int,
              as_databases: bool) -> list[Result]:
    """Seconds of a pass over each case's tenants against the default store's pass, idle and with
    pending rows, in rounds (``created``: the median seconds of the run's ``created_count``
    ``CREATE DATABASE``, for the largest case's note)."""
    repeats = options.size(PASS_ROUNDS, 1)
    cases = passes.cases
    started = time.perf_counter()
    for pending in (False, True):  # warm: every store migrated, every statement compiled
        passes.default_pass(pending)
        for case in cases:
            passes.case_pass(case, pending)
    print(f"  tenants beat pass: warming up (every store migrated) took {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    passes.published = 0
    passes.beat_sends()
    sends = [passes.beat_sends() for _ in range(3)]
    sent, send_seconds = sends[0][0], statistics.median(seconds for _, seconds in sends)
    results = []
    for pending in (False, True):
        state = f"{PENDING} pending rows in each store" if pending else "idle stores"
        rounds = in_rounds(repeats, partial(passes.default_pass, pending),
                           *(partial(passes.case_pass, case, pending) for case in cases))
        for each in rounds:
            print(f"  tenants beat pass, {state}: default store {each[0] * 1e3:.1f} ms, " + ", ".join(
                f"{len(case.names)} ({'closed' if case.closed else 'pooled'}, {case.place}) {seconds * 1e3:.0f} ms"
                for case, seconds in zip(cases, each[1:], strict=True)), file=sys.stderr)
        default_ms = statistics.median(each[0] for each in rounds) * 1e3
        for index, case in enumerate(cases, start=1):
            count = len(case.names)
            per_tenant = statistics.median(each[index] / count for each in rounds) * 1e3
            note = f"{per_tenant:.1f} ms a tenant; the default store's pass {default_ms:.1f} ms"
            if case is cases[-1]:
                note += (f"; {'databases' if as_databases else 'schemas, not databases'}: a CREATE DATABASE took "
                         f"{created:.2f} s here (median of the run's first {created_count})"
                         f"; beat's own run sent one task per tenant, {sent} tasks, in {send_seconds * 1e3:.0f} ms "
                         f"({send_seconds / sent * 1e3:.2f} ms a task)")
            results.append(Result.of_rounds(
                "tenants", f"beat's recover pass over {case.label}, {state}", "s",
                [(each[index], count * each[0], None) for each in rounds], versus=EACH_PASS, note=note,
                checks={"rows published": passes.published} if pending and case is cases[-1] else None))
    return results


def run(options: Options) -> list[Result]:
    databases = Databases(unique_prefix())
    results: list[Result] = []
    try:
        units_of = Units(databases, options.size(TENANTS, 2))
        try:
            results += throughput(units_of, options)
            results += tenants_down.measure(databases.admin, units_of.default_url,
                                            dict(list(units_of.tenant_urls.items())[:3]), options)
        finally:
            units_of.close()
        largest = options.size(LARGEST, 3)
        created, created_count = statistics.median(databases.seconds), len(databases.seconds)
        as_databases = created * largest <= CREATING_WITHIN
        print(f"  tenants: a CREATE DATABASE took {created:.2f} s (median of {created_count}): the "
              f"{largest} tenants' case is on {'databases' if as_databases else 'schemas of one database'}",
              file=sys.stderr)
        passes = Passes(databases, units_of.default_url, list(units_of.tenant_urls.values()), largest, as_databases)
        try:
            results += beat_pass(passes, options, created, created_count, as_databases)
        finally:
            passes.close()
    finally:
        databases.drop_all()
    return results
