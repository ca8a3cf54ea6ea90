"""A fault-injection run: the shop of tests/apps/fault_app.py under fire, then its invariants.

Real processes: a producer placing orders (each order and its payment message in one
unit of work), a worker consuming the durable queue (prefork, two children), a
maintenance worker running beat's recover and cleanup, and celery beat. With a crash
point armed, every one of them runs with ``CELERY_OUTBOX_CRASHPOINT`` set; whichever
process dies with the crash point's exit code is started again (a prefork child by
its pool, any other process by the run), as an operator's supervisor would. Faults
from outside (a SIGKILLed worker, a broker or database restart) fire when a given
share of the orders has been paid. While the orders flow, the run sends copies of
freshly handled payment messages to the queue, as a broker's redelivery would (once
every fault from outside has fired: a copy held by a worker that is then killed is the
broker's to give back, after its visibility timeout).

When the producer is done, the run waits for the system to settle (two readings in a row, a
poll apart, find nothing pending, and the outcome's own reading after them agrees) and checks:

* nothing lost: every committed send (an order row, and the receipt its payment
  committed) is handled: it has its effect row;
* exactly once: no order has a second payment or receipt effect, no effect exists
  for an order that was never committed, no dead letters;
* every redelivered copy was discarded and counted on its inbox row;
* nothing pending: no outgoing row (unsent, or sent and unacknowledged), no inbox row
  running or owned by a node, no task of a pool process a crash point ended still
  unanswered by its worker (Celery re-sends it as a new attempt, ``retry_on_worker_lost``,
  sometimes only after ``worker_lost_wait``: its message is one more outgoing row).

``Outcome.line()`` is the one line each scenario prints.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

from kombu.exceptions import KombuError
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from celery_outbox.core.crashpoints import ENVIRONMENT_VARIABLE, EXIT_CODE
from celery_outbox.message.envelope import from_row
from celery_outbox.store import utcnow

from ..apps import fault_app
from ..brokers import purge
from ..conftest import SUMMARY_LINE, drop_store
from ..services import wait_until
from ..workers import ROOT, BeatProcess, WorkerProcess

# A run normally settles in 15 to 30 s. A message the broker lost comes back at its next redelivery,
# whose delay doubles while a backlog keeps the consumer from acknowledging it (4, 12, 28, 60 and
# 124 s after its send with FAST_MAINTENANCE): on a slow host the last one it needs may come late.
SETTLE_TIMEOUT = 180.0
# How long a pool process's exit may wait for Celery's answer: its ``worker_lost_wait`` (10 s by
# default) and a margin.
LOST_WORKER_GRACE = 15.0
# Fast maintenance, so a run settles in seconds: recovery every second, a node dead after two
# stale checks, a sent message nobody acknowledged published again after a few seconds.
FAST_MAINTENANCE = {
    "outbox_recover_interval": 1, "outbox_cleanup_interval": 1, "outbox_node_stale_after": 1.5,
    "outbox_node_stale_checks": 2, "outbox_redeliver_after": 4,
}
PAYMENT_TASKS = ("fault.pay", "fault.pay_eager")
# Crashes of Celery itself that an operator's supervisor answers by starting the process again,
# as the run does. Celery 5.7 with kombu 5.7 on Redis: when the broker goes away while the worker
# waits in BRPOP, the consumer closes its connection a second time after ``collect()`` cleared
# it, and the redis channel's restore of unacked messages fails on the missing connection info.
KNOWN_CRASHES = (
    "Unrecoverable error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")",
)
# While the producer runs, a copy is sent only of a payment handled this recently (days inside the dedupe window).
COPY_FRESHNESS = timedelta(seconds=2)


@dataclass
class Outcome:
    scenario: str
    messages: int = 0
    kills: int = 0
    lost: int = 0
    duplicate_effects: int = 0
    discarded: int = 0
    recovered: int = 0
    seconds: float = 0.0
    ghost_effects: int = 0
    dead_letters: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    copies_sent: int = 0
    copies_uncounted: int = 0
    bodies_run_twice: int = 0  # eager payment bodies started again (a kill or a lost connection may do it)
    nodes_declared_dead: int = 0
    longest_delay: float | None = None  # seconds from a fault to the broker having the message, when measured

    def line(self) -> str:
        delay = "" if self.longest_delay is None else f", longest delay {self.longest_delay:.1f} s"
        return (f"fault scenario {self.scenario}: messages {self.messages}, faults {self.kills}, lost {self.lost}, "
                f"duplicate effects {self.duplicate_effects}, bodies run twice {self.bodies_run_twice}, "
                f"discarded {self.discarded}, recovered {self.recovered}, seconds {self.seconds:.1f}{delay}")


class Supervised:
    """A process of the run; started again when a crash point ends it, or a known crash of a
    dependency (see ``KNOWN_CRASHES``) that its log names."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen], log: Path | None = None):
        self.name, self._start, self._log = name, start, log
        self.process = start()
        self.restarts = 0
        self.known_crashes = 0
        self.finished = False

    def check(self) -> None:
        """Start the process again if a crash point or a known crash ended it; fail on any other exit
        (0 ends it)."""
        if self.finished:
            return
        code = self.process.poll()
        if code is None:
            return
        _kill_group(self.process)  # what is left of it: a prefork pool's children
        if code == 0:
            self.finished = True
        elif code == EXIT_CODE:
            self.restarts += 1
            self.process = self._start()
        elif self._crashed_known_way():
            self.known_crashes += 1
            self.process = self._start()
        else:
            raise AssertionError(f"{self.name} exited with {code}")

    def _crashed_known_way(self) -> bool:
        if self._log is None or not self._log.exists():
            return False
        log = self._log.read_text(errors="replace")
        return sum(log.count(signature) for signature in KNOWN_CRASHES) > self.known_crashes

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # cold shutdown: a fault run has no use for a warm one
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.process)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class FaultRun:
    """One scenario: build with its faults, ``run()``, then assert on the returned ``Outcome``."""

    def __init__(self, scenario: str, tmp_path: Path, broker_url: str, database_url: str, *, orders: int = 150,
                 crashpoint: str | None = None, pace: float = 0.01, visibility_timeout: float = 3,
                 body_seconds: float = 0.0, producer_broker_url: str | None = None, copies: int = 15,
                 pool: str = "prefork", tricks: str = "", plain_receipts: bool = False,
                 consumer_clock: float | None = None, async_producer: str | None = None, **conf):
        suffix = uuid.uuid4().hex[:8]
        self.scenario, self.tmp_path, self.orders, self.pace, self.copies = scenario, tmp_path, orders, pace, copies
        self.pool = pool
        self.consumer_clock = consumer_clock
        self.prefix = f"f{suffix}_"
        settings = {**FAST_MAINTENANCE, **conf}
        self.env = {
            "FAULT_BROKER_URL": broker_url, "FAULT_DATABASE_URL": database_url, "FAULT_PREFIX": self.prefix,
            "FAULT_QUEUE": f"fault_{suffix}", "FAULT_MAINTENANCE_QUEUE": f"fault_maintenance_{suffix}",
            "FAULT_VISIBILITY_TIMEOUT": str(visibility_timeout), "FAULT_BODY_SECONDS": str(body_seconds),
            "FAULT_CONF": json.dumps(settings), "FAULT_TRICKS": tricks,
            "FAULT_PLAIN_RECEIPTS": "1" if plain_receipts else "0",
        }
        if crashpoint:
            self.env[ENVIRONMENT_VARIABLE] = crashpoint
        self.producer_env = dict(self.env, FAULT_BROKER_URL=producer_broker_url or broker_url)
        if async_producer:  # "1" or "cancel": the producer's units of work are async (fault_app)
            self.producer_env["FAULT_ASYNC"] = async_producer
        self.shop = fault_app.create(broker_url, database_url, self.prefix, self.env["FAULT_QUEUE"],
                                     self.env["FAULT_MAINTENANCE_QUEUE"], visibility_timeout, tricks=tricks,
                                     plain_receipts=plain_receipts, **settings)
        self._create_tables()
        self.processes: dict[str, Supervised] = {}
        self.external_kills = 0
        self._faults: list[tuple[float, Callable[[], None]]] = []
        self._copied: dict[str, int] = {}
        self._exits_seen: list[float] = []  # when the run first saw each pool process exit
        self._conditions: list[tuple[str, Callable[[], bool]]] = []
        self.played = 0  # tricks played (FAULT_TRICKS), read when the run settles
        with self.shop.app.connection_for_write() as connection:  # not connected: only its error types
            self._service_errors = (SQLAlchemyError, OSError, KombuError, *connection.connection_errors,
                                    *connection.channel_errors)

    def _create_tables(self, attempts: int = 3) -> None:
        """The store's tables and the shop's. A server ending idle sessions (``idle_session_timeout``)
        may end a connection between its ping and its first statement when this process stalls under
        load: that statement fails, as the library documents, and the pool connects afresh. The
        setup is not the drill: it is tried again on a connection the pool has invalidated."""
        for attempt in range(attempts):
            try:
                self.shop.outbox.ready()
                self.shop.metadata.create_all(self.shop.outbox.engine)
                return
            except DBAPIError as exc:
                if not exc.connection_invalidated or attempt == attempts - 1:
                    raise

    # -- processes -----------------------------------------------------------------------------

    def _log(self, name: str) -> Path:
        return self.tmp_path / f"{name}.log"

    def _log_text(self, name: str) -> str:
        log = self._log(name)
        return log.read_text(errors="replace") if log.exists() else ""

    def application_name(self, role: str) -> str:
        """The PostgreSQL ``application_name`` of a role's connections (``PGAPPNAME``): a drill finds
        the connections of one kind by it."""
        return f"{self.prefix}{role}"

    def _worker(self, name: str, queue: str, concurrency: int, pool: str = "prefork") -> Callable[[], subprocess.Popen]:
        def start() -> subprocess.Popen:
            env = dict(self.env, PGAPPNAME=self.application_name(name))
            if name == "consumer" and self.consumer_clock is not None:
                env["FAULT_CLOCK_OFFSET"] = str(self.consumer_clock)  # tests/apps/skewed_clock.py
            worker = WorkerProcess("tests.apps.fault_app", env, pool=pool, concurrency=concurrency, queues=[queue],
                                   log_path=self._log(name)).start()
            return worker.process

        return start

    def _beat(self) -> subprocess.Popen:
        env = dict(self.env, PGAPPNAME=self.application_name("beat"))
        return BeatProcess("tests.apps.fault_app", env, log_path=self._log("beat")).start().process

    def _producer(self) -> subprocess.Popen:
        log = open(self._log("producer"), "ab")
        return subprocess.Popen(
            [sys.executable, "-m", "tests.apps.fault_app", "produce", str(self.orders), str(self.pace)],
            env=dict(os.environ, PYTHONPATH=str(ROOT), PGAPPNAME=self.application_name("producer"),
                     **self.producer_env), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def count_fault(self) -> None:
        """One fault fired from outside (a connection terminated, an outage begun)."""
        self.external_kills += 1

    def kill_consumer(self) -> None:
        """SIGKILL the consuming worker and its children (no cleanup, no ack) and start a new one."""
        consumer = self.processes["consumer"]
        _kill_group(consumer.process)
        self.external_kills += 1
        consumer.process = consumer._start()

    def kill_consumer_in_flight(self, bodies: int = 2, timeout: float = 30.0) -> None:
        """``kill_consumer`` at a moment when at least ``bodies`` eager attempts run in it (their
        envelopes committed with their claims, not yet finished), caught by stopping the worker
        (SIGSTOP) to look: the kill is sure to strand envelopes for recovery, not only messages the
        broker or delivery tracking holds (an optimistic attempt commits nothing before its body).
        Give the run bodies that take a while (``body_seconds``) and mostly eager attempts
        (``plain_receipts``), or two at once may never be caught."""
        self._stop_consumer_with_bodies_in_flight(bodies, timeout)
        self.kill_consumer()

    def pause_consumer_in_flight(self, seconds: float, bodies: int = 1, timeout: float = 30.0) -> None:
        """Stop the consuming worker (SIGSTOP, its whole process group) at a moment when at least
        ``bodies`` eager attempts run in it, for ``seconds`` (past the nodes' stale window: a VM
        paused, a cgroup frozen, a body holding the GIL), then let it go on (SIGCONT). Its
        database sessions live on, and with them its nodes' liveness locks."""
        group = self._stop_consumer_with_bodies_in_flight(bodies, timeout)
        try:
            time.sleep(seconds)  # the pause is the fault: there is no condition to wait for
        finally:
            os.killpg(group, signal.SIGCONT)
        self.external_kills += 1

    def _stop_consumer_with_bodies_in_flight(self, bodies: int, timeout: float) -> int:
        """Stop the consuming worker's process group (SIGSTOP), letting it go on and trying again
        until at least ``bodies`` eager attempts run in it; the group, left stopped."""
        group = self.processes["consumer"].process.pid

        def caught() -> bool:
            os.killpg(group, signal.SIGSTOP)
            if self._safely(self._envelopes_in_flight, 0) >= bodies:
                return True
            os.killpg(group, signal.SIGCONT)
            return False

        wait_until(caught, timeout=timeout, interval=0.02,
                   message=f"{bodies} attempts running in the consuming worker at once")
        return group

    def _envelopes_in_flight(self) -> int:
        """Stored envelopes of attempts running now: not finished, not yet due for recovery."""
        incoming = self.shop.outbox.store.tables.incoming
        with self.shop.outbox.engine.begin() as conn:
            return conn.execute(select(func.count()).select_from(incoming).where(
                incoming.c.status == "running", incoming.c.recover_after > utcnow())).scalar_one()

    def with_consumer_stopped(self, fault: Callable[[], None], backlog: int = 10,
                              timeout: float = 30.0) -> Callable[[], None]:
        """``fault``, fired while the consuming worker is stopped (SIGSTOP) and at least ``backlog``
        sent messages wait in the broker, unacknowledged by any inbox: the fault is sure to catch
        messages in flight. The worker goes on (SIGCONT) right after."""
        def fire() -> None:
            group = self.processes["consumer"].process.pid
            os.killpg(group, signal.SIGSTOP)
            try:
                wait_until(lambda: self._safely(self._outgoing, 0) >= backlog, timeout=timeout,
                           message=f"{backlog} sent messages waiting while the consumer is stopped")
                fault()
            finally:
                os.killpg(group, signal.SIGCONT)

        return fire

    def _outgoing(self) -> int:
        with self.shop.outbox.engine.begin() as conn:
            return self.shop.outbox.store.count_outgoing(conn)

    def redelivered(self) -> int:
        """Sent messages that delivery tracking published again (the recover results in the
        maintenance worker's log)."""
        return sum(int(count) for count in re.findall(r"'redelivered': (\d+)", self._log_text("maintenance")))

    def tricks_played(self) -> int:
        """First deliveries that misbehaved on purpose (``FAULT_TRICKS``)."""
        tricked = self.shop.metadata.tables[f"{self.prefix}tricked"]
        with self.shop.outbox.engine.begin() as conn:
            return conn.execute(select(func.count()).select_from(tricked)).scalar_one()

    def at_progress(self, share: float, fault: Callable[[], None]) -> "FaultRun":
        """Inject ``fault`` once ``share`` of the orders have been paid."""
        self._faults.append((share, fault))
        self._faults.sort(key=lambda item: item[0])
        return self

    def settles_when(self, what: str, condition: Callable[[], bool]) -> "FaultRun":
        """One more condition the system must reach before the run counts as settled."""
        self._conditions.append((what, condition))
        return self

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Outcome:
        started = time.monotonic()
        try:
            self.processes = {
                "consumer": Supervised("the consuming worker", self._worker(
                    "consumer", self.env["FAULT_QUEUE"], 2 if self.pool == "prefork" else 4, self.pool),
                    self._log("consumer")),
                "maintenance": Supervised("the maintenance worker", self._worker(
                    "maintenance", self.env["FAULT_MAINTENANCE_QUEUE"], 1), self._log("maintenance")),
                "beat": Supervised("celery beat", self._beat),
                "producer": Supervised("the producer", self._producer),
            }
            deadline = started + SETTLE_TIMEOUT
            while True:
                settled = self._drive(deadline)
                self.played = self._safely(self.tricks_played, 0)
                outcome = self.outcome(time.monotonic() - started)
                # the outcome is read once more after the settle: it can find what the settle's two
                # readings could not yet see (a pool process whose worker noticed its death seconds
                # late: its exit logged, its task not yet answered); then the run drives on
                if not settled or not self._unsettled(outcome):
                    break
            if not settled:
                raise AssertionError(f"{outcome.line()}\nthe system did not settle in {SETTLE_TIMEOUT:.0f}s: "
                                     f"{self._unsettled(outcome)}; logs in {self.tmp_path}")
            return outcome
        finally:
            for process in self.processes.values():
                process.stop()

    def _drive(self, deadline: float) -> bool:
        was_quiet = False
        while time.monotonic() < deadline:
            for process in self.processes.values():
                process.check()
            paid = self._safely(self._paid, 0)
            while self._faults and paid >= self._faults[0][0] * self.orders:
                self._faults.pop(0)[1]()
            if not self._faults:  # a copy held by a worker that is then killed would be the broker's to give back
                self._safely(self._send_copies, None)
            quiet = self.processes["producer"].finished and not self._faults and self._safely(self._settled, False)
            if quiet and was_quiet:  # twice, a poll apart (``run`` reads the outcome once more)
                return True
            was_quiet = quiet
            time.sleep(0.25)
        return False

    def _safely(self, read: Callable, default):
        """A reading of the tables or a publish of a copy, or ``default`` while a service is down."""
        try:
            return read()
        except self._service_errors:
            return default

    def _paid(self) -> int:
        effects = self.shop.effects
        with self.shop.outbox.engine.begin() as conn:
            return conn.execute(select(func.count()).select_from(effects).where(effects.c.kind == "payment")) \
                .scalar_one()

    def _send_copies(self) -> None:
        """Publish again the stored envelope of a few payments handled in the last seconds, as a broker
        redelivering them would, and remember how many discards each row must count afterwards.

        Once the producer is done, the latest payments handled are copied whatever their age (still
        well inside the dedupe window): a fault that held the run up until the last payments were
        handled would otherwise leave nothing fresh to copy, and the run would prove nothing."""
        if len(self._copied) >= self.copies:
            return
        incoming = self.shop.outbox.store.tables.incoming
        copyable = [incoming.c.status == "handled", incoming.c.task_name.in_(PAYMENT_TASKS),
                    incoming.c.body.is_not(None), incoming.c.message_id.not_in(list(self._copied) or [""])]
        if not self.processes["producer"].finished:
            copyable.append(incoming.c.handled_at > utcnow() - COPY_FRESHNESS)
        with self.shop.outbox.engine.begin() as conn:
            rows = conn.execute(select(incoming).where(*copyable).order_by(incoming.c.handled_at.desc())
                                .limit(3)).all()
        if not rows:
            return
        with self.shop.app.producer_or_acquire() as producer:
            for row in rows[: self.copies - len(self._copied)]:
                # with retries: a pooled connection a broker restart cut is connected again, not failed on for good
                from_row(row, self.shop.app.amqp.queues).publish(producer, retry=True)
                self._copied[row.message_id] = row.duplicates + 1

    def _lost_tasks_unanswered(self) -> int:
        """Pool processes of the consuming worker that a crash point ended, less the tasks the worker
        has answered with ``WorkerLostError`` (re-sent as a new attempt, or failed) so far.

        A child that dies before its parent has read that it accepted the job is never answered so:
        the pool puts the job back and another child runs it. So an exit counts as unanswered only
        until ``LOST_WORKER_GRACE`` after the run first saw it (Celery answers an accepted job's loss
        within ``worker_lost_wait``)."""
        text = self._log_text("consumer")
        unanswered = exits = 0
        for status in (f"exitcode {EXIT_CODE}", "signal 9 (SIGKILL)"):  # a crash point; a body that kills itself
            exited = text.count(f"exited with '{status}'")
            exits += exited
            unanswered += max(exited - text.count(f"WorkerLostError('Worker exited prematurely: {status}"), 0)
        now = time.monotonic()
        self._exits_seen += [now] * (exits - len(self._exits_seen))
        return min(unanswered, sum(1 for seen in self._exits_seen if now - seen < LOST_WORKER_GRACE))

    def _settled(self) -> bool:
        return not self._unsettled(self.outcome(0.0))

    def _unsettled(self, outcome: Outcome) -> str:
        reasons = [f"{count} {what}" for what, count in outcome.pending.items() if count]
        reasons += [f"not yet: {what}" for what, condition in self._conditions if not self._safely(condition, False)]
        if outcome.lost:
            reasons.append(f"{outcome.lost} committed sends not handled")
        if outcome.copies_sent < self.copies:
            reasons.append(f"only {outcome.copies_sent} of {self.copies} redelivered copies sent")
        if outcome.copies_uncounted:
            reasons.append(f"{outcome.copies_uncounted} redelivered copies not counted as discarded")
        return ", ".join(reasons)

    # -- the invariants ------------------------------------------------------------------------

    def outcome(self, seconds: float) -> Outcome:
        shop, store = self.shop, self.shop.outbox.store
        orders, effects, incoming = shop.orders, shop.effects, store.tables.incoming
        with shop.outbox.engine.begin() as conn:
            placed = set(conn.execute(select(orders.c.id)).scalars())
            counts: dict[tuple[str, str], int] = {
                (order_id, kind): count for order_id, kind, count in conn.execute(
                    select(effects.c.order_id, effects.c.kind, func.count()).group_by(effects.c.order_id,
                                                                                      effects.c.kind))}
            discarded, recovered = conn.execute(select(func.coalesce(func.sum(incoming.c.duplicates), 0),
                                                       func.coalesce(func.sum(incoming.c.recoveries), 0))).one()
            duplicates_of = dict(conn.execute(
                select(incoming.c.message_id, incoming.c.duplicates)
                .where(incoming.c.message_id.in_(list(self._copied) or [""]))).all())
            pending = {
                "outgoing rows": store.count_outgoing(conn),
                "inbox rows not handled": conn.execute(select(func.count()).select_from(incoming).where(
                    incoming.c.status != "handled")).scalar_one(),
                "inbox rows owned by a node": conn.execute(select(func.count()).select_from(incoming).where(
                    incoming.c.owner != 0)).scalar_one(),
                "tasks of crashed pool processes not yet re-sent": self._lost_tasks_unanswered(),
            }
            dead_letters = store.count_dead_letters(conn)
            bodies = shop.bodies
            bodies_run_twice = sum(count - 1 for count in conn.execute(
                select(func.count()).select_from(bodies).group_by(bodies.c.order_id)).scalars() if count > 1)
        if not self.processes.get("producer") or not self.processes["producer"].finished:
            pending["producer still placing orders"] = 1
        sends = [(order_id, kind) for order_id in placed for kind in ("payment", "receipt")]
        return Outcome(
            scenario=self.scenario,
            messages=len(sends),
            kills=self.kills(),
            lost=sum(1 for send in sends if counts.get(send, 0) == 0),
            duplicate_effects=sum(count - 1 for send, count in counts.items() if count > 1),
            ghost_effects=sum(count for (order_id, _), count in counts.items() if order_id not in placed),
            discarded=discarded,
            recovered=recovered,
            seconds=seconds,
            dead_letters=dead_letters,
            pending=pending,
            copies_sent=len(self._copied),
            copies_uncounted=sum(1 for message_id, needed in self._copied.items()
                                 if duplicates_of.get(message_id, 0) < needed),
            bodies_run_twice=bodies_run_twice,
            nodes_declared_dead=sum(self._log_text(name).count("declared dead; its claims are released")
                                    for name in ("maintenance", "consumer")),
        )

    def kills(self) -> int:
        """The faults of the run: processes a crash point ended (each says so in its log), processes a
        known crash of Celery ended, processes the run SIGKILLed, faults fired from outside
        (``count_fault``) and deliveries that misbehaved on purpose (``FAULT_TRICKS``)."""
        fired = sum(path.read_text(errors="replace").count("celery-outbox: crash point")
                    for path in self.tmp_path.glob("*.log"))
        return (fired + sum(process.known_crashes for process in self.processes.values()) + self.external_kills
                + self.played)

    def close(self) -> None:
        try:
            purge(self.shop.app, self.env["FAULT_QUEUE"], self.env["FAULT_MAINTENANCE_QUEUE"])
        except Exception:  # noqa: BLE001 - a broker that is gone has no queues to purge
            pass
        try:
            self.shop.metadata.drop_all(self.shop.outbox.engine)
            drop_store(self.shop.outbox.store)
        finally:
            self.shop.outbox.engine.dispose()


def play(run: FaultRun, record_property, more_faults: Callable[[], int] | None = None) -> Outcome:
    """Run a scenario, drop its tables, and leave its line for the run's summary (``record_property``,
    ``tests/conftest.py``); ``more_faults`` counts faults the run could not see (a server's own
    doing, read from its log)."""
    try:
        outcome = run.run()
    finally:
        run.close()
    if more_faults is not None:
        outcome.kills += more_faults()
    record_property(SUMMARY_LINE, outcome.line())
    return outcome


def assert_invariants(outcome: Outcome) -> None:
    """Nothing lost, effects exactly once, every redelivered copy discarded and counted, nothing pending."""
    line = outcome.line()
    assert outcome.messages > 0, f"{line}: no order was placed"
    assert outcome.lost == 0, f"{line}: committed sends never handled"
    assert outcome.duplicate_effects == 0, f"{line}: effects happened twice"
    assert outcome.ghost_effects == 0, f"{line}: effects of orders that were never committed"
    assert outcome.dead_letters == 0, f"{line}: dead letters"
    assert outcome.copies_sent > 0 and outcome.copies_uncounted == 0, \
        f"{line}: {outcome.copies_uncounted} of {outcome.copies_sent} redelivered copies not discarded and counted"
    assert outcome.discarded >= outcome.copies_sent, line
    assert not any(outcome.pending.values()), f"{line}: left pending {outcome.pending}"
