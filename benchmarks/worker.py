"""Worker throughput: a plain task vs ``IdempotentTask`` (optimistic, eager) vs a durable-queue task.

For each variant and body (no-op, one DB write) the queue is filled first with a
start mark, M task messages and an end mark; then one real worker (prefork, two
processes, the same for every variant) drains it. Throughput is M over the time
between the two marks, as the worker recorded them. Each measurement starts from
empty tables; the variants take turns, round after round. The ratio compares each variant
with the plain task running the same body in the same round, and the table gives the median
of the rounds' ratios (and of their throughputs): the machine's speed drifts by up to 2x
within minutes, so that a variant's best round and plain Celery's best round, compared, would
measure the drift.

The two floors are plain tasks that do by hand the least each inbox style must do,
with no library code: acknowledge late and write the inbox row, in the body's
transaction (optimistic) or committed before it (eager). No implementation of the
guarantee can be faster than its floor: a target above the floor's ratio is beyond
what this machine's database allows.

Each measurement also counts the CPU time spent between the two marks, per task, by the
worker and its pool, by PostgreSQL and by the broker (from ``/proc``): on a machine whose
cores all these share, it says where a variant's time goes.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from . import worker_app
from .common import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, Options, Result, delete_queues, drop_store, in_rounds

ROOT = Path(__file__).parents[1]
CONCURRENCY = 2
# Turns each variant takes; the ratios are the medians of the rounds' own (an odd count has a middle)
ROUNDS = 5
CPU_PARTS = ("worker", "PostgreSQL", "broker")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# (variant, task, durable queue?, target ratio against the plain task, its floor)
OPTIMISTIC_FLOOR = "floor: plain task writing its inbox row in its transaction"
EAGER_FLOOR = "floor: plain task committing its inbox row first"
VARIANTS = (
    ("plain task", "bench.plain", False, None, None),
    ("plain task, acks_late", "bench.plain_late", False, None, None),
    (OPTIMISTIC_FLOOR, "bench.floor", False, None, None),
    (EAGER_FLOOR, "bench.floor_eager", False, None, None),
    ("IdempotentTask optimistic", "bench.optimistic", False, 0.85, OPTIMISTIC_FLOOR),
    ("IdempotentTask eager", "bench.eager", False, 0.75, EAGER_FLOOR),
    ("durable-queue task", "bench.plain", True, None, None),
)


class Run:
    """One worker draining one pre-filled queue."""

    def __init__(self, broker_url: str, body: str):
        suffix = uuid.uuid4().hex[:8]
        self.env = {"BENCH_BROKER_URL": broker_url, "BENCH_DATABASE_URL": POSTGRES_URL,
                    "BENCH_PREFIX": f"bw{suffix}_", "BENCH_QUEUE": f"bench_{suffix}",
                    "BENCH_DURABLE_QUEUE": f"bench_durable_{suffix}", "BENCH_BODY": body, "BENCH_MARKS_URL": REDIS_URL}
        self.app, self.outbox, self.metadata = worker_app.create(
            broker_url, POSTGRES_URL, self.env["BENCH_PREFIX"], self.env["BENCH_QUEUE"],
            self.env["BENCH_DURABLE_QUEUE"], body, REDIS_URL)
        self.outbox.ready()
        self.metadata.create_all(self.outbox.engine)
        self.marks = redis.Redis.from_url(REDIS_URL)
        self.cpu: dict[tuple[str, bool], list[tuple[float, dict[str, float]]]] = {}

    def cpu_per_task(self, task: str, durable: bool) -> dict[str, float]:
        """CPU seconds per task, by part, in this variant's median measurement (by throughput),
        the round its throughput in the table comes from."""
        samples = sorted(self.cpu.get((task, durable), [(0.0, {})]), key=lambda sample: sample[0])
        return samples[len(samples) // 2][1]

    def empty_tables(self) -> None:
        """Start a measurement from empty tables: the rows an earlier variant left would slow
        the next one's inserts (a bigger index, autovacuum at work) and favour whoever ran first."""
        tables = self.outbox.store.tables
        names = [table.name for table in (tables.incoming, tables.outgoing, *self.metadata.sorted_tables)]
        with self.outbox.engine.begin() as conn:
            conn.exec_driver_sql(f"TRUNCATE {', '.join(names)}")

    def throughput(self, task: str, durable: bool, messages: int) -> float:
        self.empty_tables()
        queue = self.env["BENCH_DURABLE_QUEUE" if durable else "BENCH_QUEUE"]
        key = f"bench:{uuid.uuid4().hex}"
        send = self.app.send_task
        if durable:
            with self.outbox.transaction():  # one INSERT, then published in order
                send("bench.mark", (f"{key}:start",), queue=queue)
                for n in range(messages):
                    send(task, (n,), queue=queue)
                send("bench.mark", (f"{key}:end",), queue=queue)
        else:
            send("bench.mark", (f"{key}:start",), queue=queue)
            for n in range(messages):
                send(task, (n,), queue=queue)
            send("bench.mark", (f"{key}:end",), queue=queue)
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "benchmarks.worker_app", "worker", "-P", "prefork",
             "-c", str(CONCURRENCY), "-Q", queue, "--without-heartbeat", "--without-gossip", "--without-mingle",
             "-l", "WARNING", "-n", f"bench-{uuid.uuid4().hex[:8]}@%h"],
            env=dict(os.environ, PYTHONPATH=str(ROOT), **self.env), cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            cpu_at_start = None
            while not self.marks.exists(f"{key}:end"):
                if worker.poll() is not None:
                    raise RuntimeError(f"the benchmark worker exited: {worker.stderr.read().decode()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not drain {messages} messages of {task} in 600 s")
                if cpu_at_start is None and self.marks.exists(f"{key}:start"):
                    cpu_at_start = cpu_seconds(worker.pid)
                time.sleep(0.05)
            cpu_at_end = cpu_seconds(worker.pid)
            started, ended = (float(self.marks.get(f"{key}:{which}")) for which in ("start", "end"))
            rate = messages / (ended - started)
            if cpu_at_start is not None:
                spent = {part: (cpu_at_end[part] - cpu_at_start[part]) / messages for part in cpu_at_end}
                self.cpu.setdefault((task, durable), []).append((rate, spent))
            return rate
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
            self.marks.delete(f"{key}:start", f"{key}:end")

    def close(self) -> None:
        delete_queues(self.app, (self.env["BENCH_QUEUE"], self.env["BENCH_DURABLE_QUEUE"]))
        self.metadata.drop_all(self.outbox.engine)
        drop_store(self.outbox)


def cpu_seconds(worker_pid: int) -> dict[str, float]:
    """CPU time (user + system) spent so far by the worker and its pool (the processes of its
    session), by PostgreSQL (all its processes) and by the broker (Redis and RabbitMQ)."""
    spent = dict.fromkeys(CPU_PARTS, 0.0)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the process ended meanwhile
            continue
        session, ticks = int(fields[3]), int(fields[11]) + int(fields[12])
        part = ("worker" if session == worker_pid else "PostgreSQL" if name in ("postgres", "postmaster")
                else "broker" if name in ("redis-server", "beam.smp") else None)
        if part is not None:
            spent[part] += ticks / CLOCK_TICKS
    return spent


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    messages = options.size(3000, 200)
    results = []
    for body, label in (("noop", "no-op body"), ("write", "one DB write")):
        run = Run(broker_url, body)
        try:
            measures = [functools.partial(run.throughput, task, durable, messages)
                        for _, task, durable, _, _ in VARIANTS]
            names = [variant[0] for variant in VARIANTS]
            rounds = [dict(zip(names, each, strict=True)) for each in in_rounds(options.size(ROUNDS, 1), *measures)]
            cpu = {name: run.cpu_per_task(task, durable) for name, task, durable, _, _ in VARIANTS}
        finally:
            run.close()
        for each in rounds:
            print(f"  worker {broker}, {label}: " + ", ".join(f"{name} {rate:.0f}/s" for name, rate in each.items()),
                  file=sys.stderr)
        results += [Result.of_rounds("worker", f"{broker}, {name}, {label}", "tasks/s",
                                     [(each[name], each["plain task"], floor and each[floor]) for each in rounds],
                                     target=None if target is None else (">=", target),
                                     note="; ".join(filter(None, (
                                         floor and "vs plain with acks_late: " + _median_ratio(
                                             rounds, name, "plain task, acks_late"),
                                         cpu_note(cpu[name], cpu["plain task"])))))
                    for name, _, _, target, floor in VARIANTS[1:]]
    return results


def _median_ratio(rounds: list[dict[str, float]], name: str, other: str) -> str:
    return f"{statistics.median(each[name] / each[other] for each in rounds):.2f}"


def cpu_note(spent: dict[str, float], plain: dict[str, float]) -> str:
    """CPU per task, in microseconds, by part, and how much more than the plain task's."""
    if not spent or not plain:
        return ""
    parts = ", ".join(f"{part} {spent[part] * 1e6:.0f}" for part in CPU_PARTS)
    more = sum(spent.values()) - sum(plain.values())
    return f"CPU µs/task: {parts} ({more * 1e6:+.0f} vs plain)"


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
