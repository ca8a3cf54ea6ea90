"""Peers: celery-outbox side by side with procrastinate and django-celery-outbox, in the same run.

The peers come from the package index at the versions the ``bench`` extra pins (setup.cfg); each
row names the peer and its version, and its ratio is ours / the peer's (the table's ``vs peer``
block). Everything runs on the same PostgreSQL and Redis, each pair in rounds in which the two
ways take turns (in order, then in reverse), with the same N, the same task arguments (one
integer) and, for the workers, the same concurrency (two) and the same body:

* **procrastinate, deferring**: N = 1, 10, 100 jobs in one transaction, each job's arguments one
  integer: ours, N ``apply_async`` in one durable unit of work on Redis (one INSERT of the N rows,
  after the commit one publish to Redis and one UPDATE), vs procrastinate's ``defer`` N times on
  the caller's connection (``configure(connection=...)``: the jobs' INSERTs join its transaction,
  procrastinate's way of deferring atomically with the caller's writes), and vs its
  ``batch_defer`` (one statement for the N jobs). Both commit and both keep every message
  durably; ours also publishes it, theirs waits in the table for a worker.
* **procrastinate, the worker**: jobs that write one row. A queue of K jobs (procrastinate's,
  deferred beforehand) or K messages (ours, sent beforehand) drained by one worker: ours, Celery's
  prefork worker with two processes running ``IdempotentTask`` in the optimistic style, the row
  written through ``self.connection`` in the claim's transaction (``benchmarks.worker``'s own
  worker and task); theirs, procrastinate's worker with ``concurrency=2`` running an async job
  that writes the row on a connection of its own pool (``benchmarks.peers_procrastinate``). The
  time runs between two mark jobs before and after the K (start-up and a warm-up of jobs before
  the first mark are not counted), and the marks read the CPU each part of the system spent.
  procrastinate's job runs at least once (its row and the job's end are two transactions); ours
  exactly once in effect (the row and the claim commit together).
* **django-celery-outbox, sending**: N = 1, 10, 100 messages in one ``transaction.atomic()``
  that also writes one row with Django's connection (``benchmarks.django``'s unit of work): ours,
  ``delay`` to a durable queue with ``celery_outbox.django`` (the rows written through Django's
  connection with the block's COMMIT, published after it), vs ``delay`` on its ``OutboxCelery`` app
  (a row written with the ORM in the block; published later by its relay).
* **django-celery-outbox, the relay**: a backlog of 100 k rows published to Redis: ours
  (``outbox.relay()`` on rows stranded while the broker was unreachable, ``benchmarks.relay``) vs
  its ``Relay`` (what its ``celery_outbox_relay`` command runs), stopped the way the command is
  (SIGTERM) once it has sent the last row, both in batches of ``outbox_relay_batch_size`` (500)
  and each into an empty queue.

django-celery-outbox logs with structlog; here only its errors are printed, so that its relay's
line per batch does not fill the output, and its StatsD metrics are off
(``benchmarks.django_settings``): celery-outbox sends none.

Each row's note says what the process that sends or relays spent in CPU per message, ours and
the peer's (for the workers: by part, worker, pool, PostgreSQL and broker, as the worker
benchmark reads them), and, where it helps to read the ratio, what plain Celery does in the same
rounds without storing anything.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from functools import partial
from typing import Any, Callable

import psycopg
import redis
from celery import Celery

from . import django as django_benchmark
from . import django_settings, producer, worker
from . import relay as relay_benchmark
from .common import (
    POSTGRES_URL,
    REDIS_URL,
    ROOT,
    Options,
    Result,
    delete_queues,
    drop_store,
    in_rounds,
    in_turn,
    unique_prefix,
)
from .peers_procrastinate import CONCURRENCY, conninfo, create

PROCRASTINATE = "procrastinate"
DJANGO_CELERY_OUTBOX = "django-celery-outbox"
BATCHES = (1, 10, 100)
# Deferring: rounds, and jobs per way and round
DEFER_ROUNDS = 5
DEFER_MESSAGES = {1: 1000, 10: 2000, 100: 3000}
# The workers: rounds, jobs in each round's block, and jobs run before its first mark
WORKER_ROUNDS = 8  # an interval of the 2nd to the 7th round's ratio, at 93%
WORKER_BLOCK = 1500
WORKER_WARM_UP = 200
# django-celery-outbox: rounds and messages per way and round
SEND_ROUNDS = 5
SEND_MESSAGES = {1: 1000, 10: 1500, 100: 2000}
# The relay: rounds of a backlog of 100 k rows each. One round takes two to three minutes
# (stranding our 100 k rows 40 s, our relay 12 to 20 s, theirs 90 to 150 s), and the ratio, near
# seven, lies far beyond the rounds' noise; their relay is also measured in each round of the
# sending rows
RELAY_ROUNDS = 1
RELAY_BACKLOG = 100_000
UNIT = 1000  # rows per transaction when the backlog is made


def versus(package: str) -> str:
    """The peer's name and installed version, as the table names it."""
    return f"{package} {importlib.metadata.version(package)}"


def missing() -> list[str]:
    """The peers that are not installed (the ``bench`` extra installs them)."""
    names = []
    for package in (PROCRASTINATE, DJANGO_CELERY_OUTBOX):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            names.append(package)
    return names


def libpq_dsn() -> str:
    return POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


class Procrastinate:
    """procrastinate on a schema of its own of the benchmarks' database (dropped by ``close``);
    its body writes to ``effects``."""

    def __init__(self, effects: str):
        self.schema = f"bp_{uuid.uuid4().hex[:10]}"
        self.effects = effects
        with psycopg.connect(libpq_dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
        self.app = create(libpq_dsn(), self.schema, effects, REDIS_URL, sync=True)
        try:
            self.app.open()
            self.app.schema_manager.apply_schema()
            self.connection = psycopg.connect(conninfo(libpq_dsn(), self.schema))
        except BaseException:
            self._drop()
            raise
        self.write, self.mark = (self.app.tasks[name] for name in ("bench.peer_write", "bench.peer_mark"))
        self.marks = redis.Redis.from_url(REDIS_URL)  # the worker's marks, read after each block

    def defer(self, units: int, n: int) -> None:
        """``units`` transactions of N ``defer`` each, on the caller's connection."""
        conn = self.connection
        for _ in range(units):
            with conn.transaction():
                deferrer = self.write.configure(connection=conn)
                for i in range(n):
                    deferrer.defer(n=i)

    def batch_defer(self, units: int, n: int) -> None:
        """``units`` transactions of one ``batch_defer`` of N jobs each, on the caller's connection."""
        conn = self.connection
        for _ in range(units):
            with conn.transaction():
                self.write.configure(connection=conn).batch_defer(*({"n": i} for i in range(n)))

    def block(self, jobs: int, warm_up: int) -> worker.Block:
        """One worker drains ``warm_up`` jobs, a start mark, ``jobs`` jobs and an end mark, deferred
        beforehand, from empty tables: the block's throughput and CPU per job, between its marks."""
        conn = self.connection
        with conn.transaction():
            conn.execute(f'TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers, '
                         f'"{self.effects}"')
        key = f"bench:{uuid.uuid4().hex}"
        with conn.transaction():
            self.write.configure(connection=conn).batch_defer(*({"n": i} for i in range(warm_up)))
            self.mark.configure(connection=conn).defer(key=f"{key}:start")
            self.write.configure(connection=conn).batch_defer(*({"n": i} for i in range(jobs)))
            self.mark.configure(connection=conn).defer(key=f"{key}:end")
        env = {"BENCH_DSN": libpq_dsn(), "BENCH_SCHEMA": self.schema, "BENCH_EFFECTS": self.effects,
               "BENCH_MARKS_URL": REDIS_URL}
        limit = 60 + (jobs + warm_up) / 20
        completed = subprocess.run([sys.executable, "-m", "benchmarks.peers_procrastinate"],
                                   env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT,
                                   capture_output=True, text=True, timeout=limit, start_new_session=True)
        if completed.returncode != 0:
            raise RuntimeError(f"procrastinate's worker exited with {completed.returncode}: "
                               f"{completed.stderr[-2000:]}")
        with conn.transaction():
            written = conn.execute(f'SELECT count(*) FROM "{self.effects}"').fetchone()[0]
        if written != jobs + warm_up:
            raise RuntimeError(f"procrastinate's worker wrote {written} rows for {jobs + warm_up} jobs")
        return worker.marked_block(self.marks, key, jobs)

    def close(self) -> None:
        self.marks.close()
        self.connection.close()
        self._drop()

    def _drop(self) -> None:
        self.app.close()
        with psycopg.connect(libpq_dsn(), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {self.schema} CASCADE")


def procrastinate_defer(options: Options) -> list[Result]:
    """N jobs in one transaction: ours (a durable unit of work) vs its ``defer`` N times and its
    ``batch_defer``; plain Celery's N ``apply_async`` (nothing stored) in the same rounds, in the
    note: what Celery's messages cost before any outbox."""
    peer = versus(PROCRASTINATE)
    app, outbox, plain, durable = producer.build(REDIS_URL)
    jobs = Procrastinate(f"{unique_prefix()}effects")
    try:
        producer.send(durable, 1, 1, outbox)  # connect and declare before anything is timed
        producer.send(plain, 1, 1, None)
        jobs.defer(1, 1)
        jobs.batch_defer(1, 1)
        results = []
        for n in BATCHES:
            units = max(10, options.units(DEFER_MESSAGES[n], 200) // n)
            ways = [partial(producer.send, durable, units, n, outbox), partial(producer.send, plain, units, n, None),
                    partial(jobs.defer, units, n)]
            if n > 1:  # one job: batch_defer is defer
                ways.append(partial(jobs.batch_defer, units, n))
            measured = in_rounds(options.size(DEFER_ROUNDS, 1), *(partial(spent, units * n, way) for way in ways))
            rounds = [[way[0] for way in each] for each in measured]
            cpu = [[way[1] for way in each] for each in measured]
            for each in rounds:
                batched = f", batch_defer {each[3]:.0f}/s" if n > 1 else ""
                print(f"  peers procrastinate N={n}: outbox durable {each[0]:.0f}/s, plain apply_async "
                      f"{each[1]:.0f}/s, defer {each[2]:.0f}/s{batched}", file=sys.stderr)
            for column, how in ((2, f"defer ×{n}"), (3, f"one batch_defer of {n}"))[:2 if n > 1 else 1]:
                results.append(Result.of_rounds(
                    "peers", f"N={n} in one transaction: durable unit of work (Redis) vs {how} on the caller's "
                    "connection", "msg/s", [(each[0], each[column], None) for each in rounds], target=(">=", 1.0),
                    note=_beside(f"plain Celery's apply_async ×{n} (nothing stored)", rounds, 1, column) + "; "
                    + _cpu_note(cpu, column), versus=peer))
        return results
    finally:
        jobs.close()
        producer._tear_down(app, outbox)


def spent(count: int, action: Callable[[], Any]) -> tuple[float, float]:
    """``count`` divided by the seconds ``action`` took, and the CPU time this process spent on it
    per ``count``."""
    started, cpu = time.perf_counter(), time.process_time()
    action()
    return count / (time.perf_counter() - started), (time.process_time() - cpu) / count


def _cpu_note(cpu: list, peer: int, ours: int = 0) -> str:
    """The CPU this process spent per message, ours and the peer's: the medians of the rounds'."""
    mine, theirs = (statistics.median(each[column] for each in cpu) * 1e6 for column in (ours, peer))
    return f"CPU of this process per message: ours {mine:.0f} µs, the peer's {theirs:.0f} µs"


def _beside(what: str, rounds: list, column: int, peer: int) -> str:
    """A reference measured in the same rounds, and its ratio to the peer's (the median of the rounds')."""
    measured = statistics.median(each[column] for each in rounds)
    ratio = statistics.median(each[column] / each[peer] for each in rounds)
    return f"{what}, in the same rounds: {measured:,.0f} msg/s, {ratio:.2f} of the peer's"


def procrastinate_worker(options: Options) -> list[Result]:
    peer = versus(PROCRASTINATE)
    ours = worker.Run(REDIS_URL, "write")
    effects = f"{ours.env['BENCH_PREFIX']}effects"
    jobs = Procrastinate(effects)
    block, warm_up = options.units(WORKER_BLOCK, 20), options.units(WORKER_WARM_UP, 10)
    try:
        measured: list[dict[str, worker.Block]] = []
        for number in range(options.size(WORKER_ROUNDS, 1)):
            each = {}
            for way in in_turn(["ours", "peer"], number):
                if way == "ours":
                    each[way] = ours.blocks(["bench.optimistic"], 1, block, warm_up)[0]["bench.optimistic"]
                else:
                    each[way] = jobs.block(block, warm_up)
            print(f"  peers procrastinate worker: IdempotentTask optimistic {each['ours']['rate']:.0f}/s, "
                  f"procrastinate {each['peer']['rate']:.0f}/s", file=sys.stderr)
            measured.append(each)
    finally:
        jobs.close()
        ours.close()
    cpu = worker.cpu_note(worker.mean_cpu([each["ours"] for each in measured]),
                          worker.mean_cpu([each["peer"] for each in measured]))
    return [Result.of_rounds(
        "peers", f"one DB write per job, a queue of {block:,} drained by one worker of concurrency {CONCURRENCY}: "
        f"IdempotentTask optimistic (Redis, prefork) vs its async job (its worker)", "tasks/s",
        [(each["ours"]["rate"], each["peer"]["rate"], None) for each in measured], target=(">=", 1.0),
        note=cpu.replace(" vs plain)", " vs procrastinate)") + f"; procrastinate's: {_cpu(measured)}",
        versus=peer)]


def _cpu(measured: list[dict[str, worker.Block]]) -> str:
    spent = worker.mean_cpu([each["peer"] for each in measured])
    return ", ".join(f"{part} {spent[part] * 1e6:.0f}" for part in worker.CPU_PARTS)


def quiet_structlog() -> None:
    """Print only django-celery-outbox's errors, to stderr (structlog prints all to stdout by
    default, where the table goes; its relay warns at each start that Redis has no native delayed
    delivery). Whether its relay sent every row is checked apart."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))


class DjangoCeleryOutbox:
    """django-celery-outbox on Django's database (``benchmarks.django_settings``): its app
    (``OutboxCelery`` on Redis) with one task, and its tables, made from its models (and dropped
    by ``close``)."""

    def __init__(self, prefix: str):
        django_settings.configure()
        quiet_structlog()
        from django.db import connection
        from django_celery_outbox import OutboxCelery
        from django_celery_outbox.models import CeleryOutbox, CeleryOutboxDeadLetter

        self.models = (CeleryOutbox, CeleryOutboxDeadLetter)
        self.queue = f"{prefix}peer"
        self.app = OutboxCelery(f"bench_peer_{prefix}", broker=REDIS_URL, set_as_current=False)
        self.app.conf.update(task_default_queue=self.queue)
        self.task = self.app.task(name="bench.peer", shared=False)(_identity)
        existing = set(connection.introspection.table_names())
        with connection.schema_editor() as editor:
            for model in self.models:
                if model._meta.db_table in existing:  # left by a run that did not finish
                    editor.delete_model(model)
                editor.create_model(model)

    def backlog(self, messages: int) -> None:
        """``messages`` rows as ``delay`` writes them: the first thousand written by ``delay`` in one
        transaction, the rest copied from the first in one statement, each with a task id of its
        own and its own argument (a hundred thousand ``delay`` calls would take two minutes a
        round, and they are not what is measured)."""
        from django.db import connection, transaction
        from django_celery_outbox.models import CeleryOutbox

        first = min(messages, UNIT)
        with transaction.atomic():
            for n in range(first):
                self.task.delay(n)
        if messages == first:
            return
        columns = [field.column for field in CeleryOutbox._meta.concrete_fields if not field.primary_key]
        made = {"task_id": "gen_random_uuid()::text", "args": "jsonb_build_array(copies.n)"}
        chosen = ", ".join(made.get(column, f"template.{column}") for column in columns)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {CeleryOutbox._meta.db_table} ({', '.join(columns)}) SELECT {chosen} "
                           f"FROM (SELECT * FROM {CeleryOutbox._meta.db_table} ORDER BY id LIMIT 1) AS template, "
                           "generate_series(%s, %s) AS copies(n)", [first, messages - 1])

    def relay(self, messages: int, batch_size: int) -> float:
        """Run its relay until it has sent ``messages`` rows, and stop it as its command is stopped
        (SIGTERM): it then ends its batch and exits once no row is pending. Seconds it took. Its
        defaults but the batch size (ours') and ``idle_time`` 0: the pause it takes after a short
        batch, before it looks again, would be counted otherwise."""
        from django_celery_outbox.models import CeleryOutbox
        from django_celery_outbox.relay import Relay, RelayConfig
        from django_celery_outbox.signals import outbox_message_sent

        sent = 0

        def counted(**_: Any) -> None:
            nonlocal sent
            sent += 1
            if sent == messages:
                os.kill(os.getpid(), signal.SIGTERM)

        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        limit = 60 + messages / 100  # a hundred messages a second: far slower than it runs
        stuck = threading.Timer(limit, os.kill, (os.getpid(), signal.SIGTERM))
        outbox_message_sent.connect(counted, weak=False, dispatch_uid="bench-peers")
        try:
            relay = Relay(self.app, RelayConfig.init(batch_size=batch_size, idle_time=0))
            stuck.start()
            started = time.perf_counter()
            relay.start()
            seconds = time.perf_counter() - started
        finally:
            stuck.cancel()
            outbox_message_sent.disconnect(dispatch_uid="bench-peers")
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        left = CeleryOutbox.objects.count()
        if sent != messages or left:
            raise RuntimeError(f"django-celery-outbox's relay sent {sent} of {messages} rows in {limit:.0f} s "
                               f"({left} left)")
        return seconds

    def empty(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(model._meta.db_table for model in self.models)}")

    def close(self) -> None:
        from django.db import connection

        delete_queues(self.app, [self.queue])
        with connection.schema_editor() as editor:
            for model in self.models:
                editor.delete_model(model)


def _identity(n: int) -> int:
    return n


def django_send(options: Options) -> list[Result]:
    """N messages in one atomic block: ours (stored, then published after the commit) vs theirs
    stored alone, and vs theirs stored and then published by its relay (the same rows, relayed
    right after the round's blocks: the time of both counts); Celery's ``delay_on_commit`` (nothing
    stored, published after the commit) in the same rounds, in the note."""
    peer = versus(DJANGO_CELERY_OUTBOX)
    django_settings.configure()
    prefix = unique_prefix()
    app, outbox, plain, durable, table = django_benchmark.build(prefix)
    theirs = DjangoCeleryOutbox(prefix)
    unit_of_work = django_benchmark.unit_of_work
    batch_size = outbox.settings.relay_batch_size
    try:
        unit_of_work(table, durable.delay, 1, 1)  # connect and declare before anything is timed
        unit_of_work(table, plain.delay_on_commit, 1, 1)
        Celery.send_task(theirs.app, "bench.peer", (0,))

        def peer_way(units: int, n: int) -> tuple[float, float, float]:
            """Seconds its blocks took, and its relay then, and the CPU this process spent on both."""
            theirs.empty()
            _purge(theirs.app, [theirs.queue])
            started, cpu = time.perf_counter(), time.process_time()
            unit_of_work(table, theirs.task.delay, units, n)
            stored = time.perf_counter() - started
            return stored, theirs.relay(units * n, batch_size), time.process_time() - cpu

        results = []
        for n in BATCHES:
            units = max(10, options.units(SEND_MESSAGES[n], 200) // n)
            messages = units * n
            rounds, cpu = [], []
            for number in range(options.size(SEND_ROUNDS, 1)):
                measured: dict[str, Any] = {}
                for way in in_turn(["ours", "plain", "peer"], number):
                    if way == "peer":
                        measured[way] = peer_way(units, n)
                    else:
                        send = durable.delay if way == "ours" else plain.delay_on_commit
                        measured[way] = spent(messages, partial(unit_of_work, table, send, units, n))
                stored, relayed, peer_cpu = measured["peer"]
                rounds.append((measured["ours"][0], messages / stored, messages / (stored + relayed),
                               measured["plain"][0]))
                cpu.append((measured["ours"][1], peer_cpu / messages))
                print(f"  peers django-celery-outbox N={n}: outbox durable {rounds[-1][0]:.0f}/s, delay_on_commit "
                      f"{rounds[-1][3]:.0f}/s, django-celery-outbox stored {rounds[-1][1]:.0f}/s, stored and relayed "
                      f"{rounds[-1][2]:.0f}/s", file=sys.stderr)
            results += [
                Result.of_rounds(
                    "peers", f"N={n} in transaction.atomic() with one ORM row: durable delay, published after the "
                    "commit, vs its delay (stored only)", "msg/s", [(each[0], each[1], None) for each in rounds],
                    target=(">=", 1.0), note=_beside("delay_on_commit (nothing stored)", rounds, 3, 1), versus=peer),
                Result.of_rounds(
                    "peers", f"N={n} in transaction.atomic() with one ORM row: durable delay, published after the "
                    f"commit, vs its delay and then its relay publishing the rows (batches of {batch_size})", "msg/s",
                    [(each[0], each[2], None) for each in rounds], target=(">=", 1.0),
                    note=_beside("delay_on_commit (nothing stored)", rounds, 3, 2) + "; " + _cpu_note(cpu, 1)
                    + " (its delay and its relay)", versus=peer),
            ]
        return results
    finally:
        theirs.close()
        with outbox.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        delete_queues(app, list(app.amqp.queues))
        drop_store(outbox)
        from django.db import connections

        connections.close_all()


def django_relay(options: Options) -> list[Result]:
    peer = versus(DJANGO_CELERY_OUTBOX)
    messages = options.size(RELAY_BACKLOG, 3_000)
    prefix = unique_prefix()
    durable_queue = f"{prefix}durable"
    app, outbox = relay_benchmark.build(REDIS_URL, prefix, durable_queue)
    theirs = DjangoCeleryOutbox(prefix)
    batch_size = outbox.settings.relay_batch_size
    try:
        app.send_task("bench.plain", (0,))  # connect and declare before the clocks start
        Celery.send_task(theirs.app, "bench.peer", (0,))  # its relay's way to publish, past its outbox
        _purge(app, [f"{prefix}plain"])
        _purge(theirs.app, [theirs.queue])

        def ours() -> float:
            with outbox.engine.begin() as conn:
                conn.exec_driver_sql(f"TRUNCATE {outbox.store.tables.outgoing.name}")
            relay_benchmark.strand(prefix, durable_queue, messages)
            _purge(app, [durable_queue])
            relayed = []
            measured = spent(messages, lambda: relayed.append(outbox.relay(max_batches=10**9)))
            if relayed[0].published != messages:
                raise RuntimeError(f"the relay published {relayed[0].published} of {messages} rows: {relayed[0]}")
            return measured

        def peer_relay() -> tuple[float, float]:
            theirs.empty()
            theirs.backlog(messages)
            _purge(theirs.app, [theirs.queue])
            return spent(messages, partial(theirs.relay, messages, batch_size))

        measured = in_rounds(options.size(RELAY_ROUNDS, 1), ours, peer_relay)
        rounds = [[way[0] for way in each] for each in measured]
        for mine, theirs_rate in rounds:
            print(f"  peers django-celery-outbox relay: outbox {mine:.0f}/s, django-celery-outbox "
                  f"{theirs_rate:.0f}/s", file=sys.stderr)
        return [Result.of_rounds(
            "peers", f"a backlog of {messages:,} rows published to Redis in batches of {batch_size}: "
            "relay vs its relay", "msg/s", [(mine, theirs_rate, None) for mine, theirs_rate in rounds],
            target=(">=", 1.0), note=_cpu_note([[way[1] for way in each] for each in measured], 1), versus=peer)]
    finally:
        theirs.close()
        producer._tear_down(app, outbox)
        from django.db import connections

        connections.close_all()


def _purge(app: Any, queues: list[str]) -> None:
    with app.connection_for_write() as connection:
        for queue in queues:
            try:
                connection.default_channel.queue_purge(queue)
            except Exception:  # noqa: BLE001 - a queue never declared has nothing to purge
                pass


COMPARISONS: tuple[Callable[[Options], list[Result]], ...] = (
    procrastinate_defer, procrastinate_worker, django_send, django_relay)


def run(options: Options) -> list[Result]:
    absent = missing()
    if absent:
        raise RuntimeError(f"the peers are not installed: {', '.join(absent)} (pip install -e '.[bench]', or "
                           "tox -e bench)")
    results = []
    for comparison in COMPARISONS:
        began = time.monotonic()
        results += comparison(options)
        print(f"  peers {comparison.__name__}: {time.monotonic() - began:.0f}s", file=sys.stderr)
    return results
