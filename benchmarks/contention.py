"""Contention: two relays, two beat-driven recovers and two workers on one store at once.

On PostgreSQL and Redis. A backlog of K outgoing rows is stranded as production strands them
(``relay.strand``: units of work committed while the broker cannot be reached), then relayed by
one relay process, or by two at once; the phases take turns (one, two; then two, one; ...). A
relay process (spawned: a fresh interpreter, as a deployed one) runs ``outbox.relay()`` pass after
pass until no unsent row is left. All the while two recover processes run ``outbox.recover()``
(what beat's ``celery_outbox.recover`` runs) every ``RECOVER_INTERVAL`` seconds, as beat would
with ``outbox_recover_interval`` at that, their first pass of a phase a third and two thirds of
an interval after it starts; a pass relays too, so the recovers take part of the backlog, in
both phases alike, and the note says how much. Two real Celery workers (prefork, two processes
each) consume the durable queue with an ``IdempotentTask`` that writes one effect row per message
in its claim's transaction. The recovers pause only while rows are stranded (or they would relay
them before the clock starts); each phase ends once the workers have drained it (its rows all
acknowledged), so that the next one starts with them idle.

A phase's throughput is K over the time from the relays' start to the last one's end (every row
marked sent, by whichever process). The row: two relays against one, the median of the rounds'
own ratios, target 1 (contention must not make two relays slower than one). The workers' drain,
not the relays, sets the run's length: 40,200 messages (five rounds of two phases of 4,000 rows,
and a warm-up) took five minutes on a busy two-core host, where a phase's relaying took 0.6 to
2.2 seconds and its drain 19 to 38.

Then the invariants, over every phase, each a count in the row's ``checks``; any broken one fails
the benchmark with an exception naming it:

* every stranded row published once: the relays and recovers published exactly K in each phase,
  and each message reached a worker's pool once (a Redis counter per message id, counted before
  the inbox claims it, so that a copy the inbox discards counts too);
* no claim taken twice: one effect row per message, no inbox row with a duplicate or a recovery;
* nothing left pending: every inbox row handled, the outgoing table empty (the consuming inbox
  deletes a row once it has its message), no dead letter.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import redis
from sqlalchemy import func, select

from . import contention_app
from .common import POSTGRES_URL, REDIS_URL, Options, Result, delete_queues, drop_store, in_turn, unique_prefix
from .contention_app import RECOVER_INTERVAL
from .relay import strand

ROOT = Path(__file__).parents[1]
RELAYS = 2
RECOVERS = 2
WORKERS = 2
CONCURRENCY = 2  # pool processes per worker
ROUNDS = 5
MESSAGES = 4000  # stranded rows per phase: the workers' drain of 40,000 sets the run's length
WARM_UP = 200  # rows relayed by both relays before the first phase: connections made, workers up
EMPTY_PASS_REST = 0.005  # seconds a relay process waits after a pass that found nothing unlocked
HELPER_TIMEOUT = 300


def relay_loop(params: dict[str, str], commands: Any, results: Any) -> None:
    """A relay process: on each command, relay passes until no unsent row is left; then report
    what it published and when it ended (``time.monotonic``: one clock for every process)."""
    try:
        app, outbox, _ = contention_app.create(**params)
        outbox.ready()
        outgoing = outbox.store.tables.outgoing
        unsent = select(func.count()).select_from(outgoing).where(outgoing.c.sent_at.is_(None))
        with app.producer_or_acquire() as producer:  # connected before any clock starts
            producer.connection.ensure_connection(max_retries=3)
        results.put("ready")
        while commands.get() is not None:
            published = passes = 0
            while True:
                done = outbox.relay()
                if done.broker_error:
                    raise RuntimeError(f"the relay found the broker down: {done.broker_error}")
                published, passes = published + done.published, passes + 1
                if not done.published:
                    with outbox.engine.connect() as conn:
                        if not conn.execute(unsent).scalar_one():
                            break
                    time.sleep(EMPTY_PASS_REST)  # the rows left are another process's, locked
            results.put({"published": published, "passes": passes, "ended": time.monotonic()})
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which fails with it
        results.put({"error": f"relay process: {exc!r}"})


def recover_loop(params: dict[str, str], offset: float, active: Any, commands: Any, results: Any) -> None:
    """A recover process, as beat drives one: a pass every ``RECOVER_INTERVAL`` seconds while
    ``active`` is set, the first ``offset`` seconds after it is set. On ``"report"`` (which waits
    for a running pass to end), its totals since the last report."""
    try:
        _, outbox, _ = contention_app.create(**params)
        outbox.ready()
        results.put("ready")
        totals: Counter = Counter()
        next_pass = 0.0
        while True:
            try:
                command = commands.get(timeout=0.02)
            except queue.Empty:
                command = "tick"
            if command is None:
                return
            if command == "report":
                results.put(dict(totals))
                totals.clear()
                continue
            if not active.is_set():
                next_pass = time.monotonic() + offset
                continue
            if time.monotonic() >= next_pass:
                next_pass = time.monotonic() + RECOVER_INTERVAL
                done = outbox.recover().as_dict()
                if done["broker_error"]:
                    raise RuntimeError(f"a recover pass found the broker down: {done['broker_error']}")
                totals["passes"] += 1
                totals["nodes_declared_dead"] += len(done["nodes_declared_dead"])
                totals.update({key: value for key, value in done.items() if type(value) is int})
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which fails with it
        results.put({"error": f"recover process: {exc!r}"})


def _offset(number: int) -> float:
    """When recover ``number``'s first pass of a phase comes: the recovers' passes spread evenly
    over an interval (a third and two thirds of it, for two), the same in every phase."""
    return (number + 1) / (RECOVERS + 1) * RECOVER_INTERVAL


class _Helper:
    """A process of the benchmark's own (spawned: a fresh interpreter, as a deployed relay is),
    with a queue of commands and one of results."""

    def __init__(self, context: Any, target: Callable[..., None], *args: Any):
        self.commands, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=target, args=(*args, self.commands, self.results), daemon=True)
        self.process.start()

    def get(self, timeout: float = HELPER_TIMEOUT) -> Any:
        """Its next answer; an error it reported, its exit or its silence raise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self.results.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"a helper process exited (code {self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a helper process did not answer in {timeout:.0f} s") from None
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


class Cluster:
    """The store, the durable queue, and the relays, recovers and workers on them."""

    def __init__(self, broker_url: str):
        prefix = unique_prefix()
        self.params = {"broker_url": broker_url, "database_url": POSTGRES_URL, "prefix": prefix,
                       "queue": f"{prefix}durable", "counts_url": REDIS_URL}
        self.app, self.outbox, self.effects = contention_app.create(**self.params)
        self.outbox.ready()
        self.effects.create(self.outbox.engine)
        self.counts = redis.Redis.from_url(REDIS_URL)
        self.deliveries_key = contention_app.deliveries_key(prefix)
        self.stranded = 0  # rows stranded so far, over every phase
        self.relays: list[_Helper] = []
        self.recovers: list[_Helper] = []
        self.workers: list[subprocess.Popen] = []
        context = multiprocessing.get_context("spawn")
        self.active = context.Event()
        try:
            self.relays = [_Helper(context, relay_loop, self.params) for _ in range(RELAYS)]
            self.recovers = [_Helper(context, recover_loop, self.params, _offset(number), self.active)
                             for number in range(RECOVERS)]
            self.workers = [self._worker(number) for number in range(WORKERS)]
            for helper in self.relays + self.recovers:
                if helper.get() != "ready":
                    raise RuntimeError("a helper process did not start")
        except BaseException:
            self.close()
            raise

    def _worker(self, number: int) -> subprocess.Popen:
        env = {f"CONTENTION_{name.upper()}": value for name, value in self.params.items()}
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "benchmarks.contention_app", "worker", "-P", "prefork",
             "-c", str(CONCURRENCY), "-Q", self.params["queue"], "--without-heartbeat", "--without-gossip",
             "--without-mingle", "-l", "WARNING", "-n", f"contention-{number}-{uuid.uuid4().hex[:8]}@%h"],
            env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)

    def phase(self, relays: int, messages: int) -> dict[str, Any]:
        """Strand ``messages`` rows, relay them with ``relays`` relay processes while the recovers
        run, and wait for the workers to drain them: the throughput and who published what."""
        self._pause()  # no recover relays the rows before the clock starts
        began = time.monotonic()
        strand(self.params["prefix"], self.params["queue"], messages)
        self.stranded += messages
        stranded = time.monotonic() - began
        self.active.set()
        started = time.monotonic()
        for helper in self.relays[:relays]:
            helper.commands.put("relay")
        relayed = [helper.get() for helper in self.relays[:relays]]
        seconds = max(each["ended"] for each in relayed) - started
        self.drain()
        drained = time.monotonic() - started - seconds
        recovered = self._pause()
        by_relays = [each["published"] for each in relayed]
        return {"rate": messages / seconds, "relays": by_relays, "recovers": recovered["published"],
                "published": sum(by_relays) + recovered["published"], "messages": messages,
                "recover_passes": recovered["passes"], "seconds": {"strand": stranded, "relay": seconds,
                                                                   "drain": drained}}

    def _pause(self) -> Counter:
        """Stop the recovers' passes (a running one ends first) and sum what they did since the last
        pause."""
        self.active.clear()
        for helper in self.recovers:
            helper.commands.put("report")
        total: Counter = Counter()
        for helper in self.recovers:
            total.update(helper.get())
        return total

    def drain(self) -> None:
        """Wait until the workers ran every message stranded so far and the inbox acknowledged
        each (the outgoing table empty)."""
        outgoing = self.outbox.store.tables.outgoing
        limit = 120 + self.stranded / 50
        deadline = time.monotonic() + limit
        while True:
            with self.outbox.engine.connect() as conn:
                effects = conn.execute(select(func.count()).select_from(self.effects)).scalar_one()
                left = conn.execute(select(func.count()).select_from(outgoing)).scalar_one()
            if effects >= self.stranded and not left:
                return
            for worker in self.workers:
                if worker.poll() is not None:
                    raise RuntimeError(f"a worker exited: {worker.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"left pending after {limit:.0f} s: {self.stranded - effects} of "
                                   f"{self.stranded} messages not run, {left} outgoing rows not acknowledged")
            time.sleep(0.1)

    def checks(self) -> dict[str, int]:
        """The invariants' counts over every phase so far (all zero but the totals when they hold)."""
        deliveries = [int(count) for count in self.counts.hgetall(self.deliveries_key).values()]
        tables = self.outbox.store.tables
        inbox = tables.incoming
        with self.outbox.engine.connect() as conn:
            effects = conn.execute(select(self.effects.c.message_id, func.count())
                                   .group_by(self.effects.c.message_id)).all()
            claims, duplicates, recoveries, unhandled = conn.execute(select(
                func.count(), func.coalesce(func.sum(inbox.c.duplicates), 0),
                func.coalesce(func.sum(inbox.c.recoveries), 0),
                func.count().filter(inbox.c.status != "handled"))).one()
            outgoing = conn.execute(select(func.count()).select_from(tables.outgoing)).scalar_one()
            dead_letters = conn.execute(select(func.count()).select_from(tables.dead_letters)).scalar_one()
        return {"messages": self.stranded, "delivered": len(deliveries),
                "delivered_more_than_once": sum(count > 1 for count in deliveries),
                "deliveries": sum(deliveries), "effects": sum(count for _, count in effects),
                "effects_more_than_once": sum(count > 1 for _, count in effects), "inbox_rows": claims,
                "inbox_duplicates": duplicates, "inbox_recoveries": recoveries, "inbox_not_handled": unhandled,
                "outgoing_left": outgoing, "dead_letters": dead_letters}

    def close(self) -> None:
        for helper in self.relays + self.recovers:
            helper.stop()
        for worker in self.workers:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
        self.counts.delete(self.deliveries_key)
        delete_queues(self.app, [self.params["queue"]])
        self.effects.drop(self.outbox.engine, checkfirst=True)
        drop_store(self.outbox)


def broken(checks: dict[str, int], phases: list[dict[str, Any]]) -> list[str]:
    """What the counts say broke, in words (empty when every invariant held)."""
    problems = [f"a phase's relays and recovers published {each['published']} rows of {each['messages']} "
                f"(relays {each['relays']}, recovers {each['recovers']})"
                for each in phases if each["published"] != each["messages"]]
    total = checks["messages"]
    if checks["delivered_more_than_once"]:
        problems.append(f"{checks['delivered_more_than_once']} messages published twice (delivered more than once)")
    if checks["delivered"] != total or checks["deliveries"] != total:
        problems.append(f"{checks['delivered']} of {total} messages delivered, in {checks['deliveries']} deliveries")
    if checks["effects_more_than_once"]:
        problems.append(f"{checks['effects_more_than_once']} claims taken twice (effects written more than once)")
    if checks["effects"] != total or checks["inbox_rows"] != total:
        problems.append(f"{checks['effects']} effect rows and {checks['inbox_rows']} inbox rows for {total} messages")
    for name, what in (("inbox_duplicates", "duplicates discarded by the inbox"),
                       ("inbox_recoveries", "recoveries of inbox claims"),
                       ("inbox_not_handled", "inbox rows left not handled"),
                       ("outgoing_left", "outgoing rows left pending"), ("dead_letters", "dead letters")):
        if checks[name]:
            problems.append(f"{checks[name]} {what}")
    return problems


def measure(broker: str, broker_url: str, options: Options) -> Result:
    messages, rounds = options.units(MESSAGES, 300), options.size(ROUNDS, 1)
    cluster = Cluster(broker_url)
    try:
        warm = cluster.phase(RELAYS, options.units(WARM_UP, 50))
        phases = [warm]
        measured = []
        for number in range(rounds):
            rates = {}
            for relays in in_turn([1, RELAYS], number):
                phase = cluster.phase(relays, messages)
                phases.append(phase)
                rates[relays] = phase
                print(f"  contention {broker} round {number + 1}: {relays} relay(s) {phase['rate']:.0f} rows/s "
                      f"(relays published {phase['relays']}, recovers {phase['recovers']} in "
                      f"{phase['recover_passes']} passes; seconds: " + ", ".join(
                          f"{name} {value:.1f}" for name, value in phase["seconds"].items()) + ")", file=sys.stderr)
            measured.append(rates)
        cluster.drain()
        checks = cluster.checks()
    finally:
        cluster.close()
    problems = broken(checks, phases)
    if problems:
        raise RuntimeError(f"contention on {broker}: invariants broken: {'; '.join(problems)}")
    by_recovers = statistics.median(each[n]["recovers"] / messages for each in measured for n in each)
    note = (f"{RECOVERS} recovers every {RECOVER_INTERVAL:g} s and {WORKERS} workers of "
            f"{CONCURRENCY} processes at the same time; the recovers' passes published a median "
            f"{by_recovers:.0%} of a phase's rows; over {checks['messages']:,} messages: each published and "
            f"delivered once, one effect each, no inbox duplicate or recovery, nothing left pending")
    return Result.of_rounds("contention", f"{broker}, two relays vs one on {messages:,} stranded rows", "rows/s",
                            [(each[RELAYS]["rate"], each[1]["rate"], None) for each in measured],
                            target=(">=", 1.0), note=note, checks=checks)


def run(options: Options) -> list[Result]:
    return [measure("Redis", REDIS_URL, options)]
