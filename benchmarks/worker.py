"""Worker throughput: a plain task vs ``IdempotentTask`` (optimistic, eager) vs a durable-queue task.

For each variant and body (no-op, one DB write) the queue is filled first with a
start mark, M task messages and an end mark; then one real worker (prefork, two
processes, the same for every variant) drains it. Throughput is M over the time
between the two marks, as the worker recorded them. The ratio compares each variant
with the plain task running the same body.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import redis
from sqlalchemy import create_engine

from . import worker_app
from .common import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, Options, Result, delete_queues, drop_store, rate

ROOT = Path(__file__).parents[1]
CONCURRENCY = 2
# (variant, task, durable queue?, target ratio against the plain task)
VARIANTS = (
    ("plain task", "bench.plain", False, None),
    ("plain task, acks_late", "bench.plain_late", False, None),
    ("IdempotentTask optimistic", "bench.optimistic", False, 0.85),
    ("IdempotentTask eager", "bench.eager", False, 0.75),
    ("durable-queue task", "bench.plain", True, None),
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

    def throughput(self, task: str, durable: bool, messages: int) -> float:
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
            while not self.marks.exists(f"{key}:end"):
                if worker.poll() is not None:
                    raise RuntimeError(f"the benchmark worker exited: {worker.stderr.read().decode()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not drain {messages} messages of {task} in 600 s")
                time.sleep(0.05)
            started, ended = (float(self.marks.get(f"{key}:{which}")) for which in ("start", "end"))
            return messages / (ended - started)
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


def commit_rate(commits: int) -> float:
    """One-row INSERT + COMMIT per transaction from CONCURRENCY connections at once: the most
    synchronous commits per second the database gives, the floor under any task that commits."""
    engine = create_engine(POSTGRES_URL, pool_size=CONCURRENCY)
    table = f"bench_commits_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, n integer)")

    def commit(count: int) -> None:
        with engine.connect() as conn:
            for n in range(count):
                conn.exec_driver_sql(f"INSERT INTO {table} (n) VALUES ({n})")
                conn.commit()

    def all_at_once() -> None:
        threads = [threading.Thread(target=commit, args=(commits // CONCURRENCY,)) for _ in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    try:
        return rate(commits, all_at_once)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        engine.dispose()


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    messages = options.size(3000, 200)
    results = []
    for body, label in (("noop", "no-op body"), ("write", "one DB write")):
        run = Run(broker_url, body)
        try:
            rates = {name: run.throughput(task, durable, messages) for name, task, durable, _ in VARIANTS}
        finally:
            run.close()
        print(f"  worker {broker}, {label}: " + ", ".join(f"{name} {rate:.0f}/s" for name, rate in rates.items()),
              file=sys.stderr)
        plain, late = rates["plain task"], rates["plain task, acks_late"]
        results += [Result("worker", f"{broker}, {name}, {label}", "tasks/s", rates[name], plain,
                           target=None if target is None else (">=", target),
                           note=f"vs plain with acks_late: {rates[name] / late:.2f}"
                           if name.startswith("IdempotentTask") else "")
                    for name, _, _, target in VARIANTS[1:]]
        if body == "noop":
            commits = commit_rate(messages)
            results.append(Result(
                "worker", f"{broker}, floor: PostgreSQL one-row INSERT + COMMIT, {CONCURRENCY} connections",
                "commits/s", commits,
                note=f"plain no-op {plain:.0f} tasks/s: a task that commits once reaches at most "
                     f"{1 / (1 + plain / commits):.2f} of it"))
    return results


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
