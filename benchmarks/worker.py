"""Worker throughput: a plain task vs ``IdempotentTask`` (optimistic, eager) vs a durable-queue task.

One real worker (prefork, two processes, the same for every variant) drains one queue filled
beforehand with blocks of messages: a start mark, B messages of one variant's task, an end
mark, and so for each variant in turn, round after round (in one round the variants go in order,
in the next in reverse, so that a drift of the machine's speed during a round weighs on each
alike). A block's throughput is B over the time between its marks, as the worker recorded them;
the ratio compares each variant with the plain task's block of the same round, taken seconds
apart, and the table gives the median of the rounds' ratios (and of their throughputs) with
its confidence interval. The machine's speed drifts by up to 2x within minutes: variants
measured a minute apart, each by a worker of its own, gave ratios that ranged from 0.6 to 1.4
between two tasks that differ only in when the ack goes. The tables start empty and grow by
every block, alike for each variant as they take turns.

The two floors are plain tasks that do by hand the least each inbox style must do,
with no library code: acknowledge late and write the inbox row, in the body's
transaction (optimistic) or committed before it (eager). No implementation of the
guarantee can be faster than its floor: a target above the floor's ratio is beyond
what this machine's database allows.

The durable-queue task is consumed from another queue, and a worker draining two queues
interleaves them: it is measured in rounds of its own, each a worker draining the durable
queue and then one draining the plain task's messages.

What it costs that every worker is a node (its main process registers when ready and heartbeats
until it stops) is measured the same way: rounds of two workers of their own draining the same
number of optimistic ``IdempotentTask`` messages, one a node and one not (``BENCH_WITHOUT_NODE``),
in turn.

Each block also counts the CPU time it took, per task, of the worker's main process, of its pool, of
PostgreSQL and of the broker (``benchmarks.cpu``, read by the marks): on a machine whose cores
all these share, it says where a variant's time goes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from contextlib import nullcontext
from typing import Any

import redis

from . import worker_app
from .common import (
    POSTGRES_URL,
    RABBITMQ_URL,
    REDIS_URL,
    Options,
    Result,
    delete_queues,
    drop_store,
    in_turn,
    worker_until,
)
from .cpu import CPU_PARTS, spent_between

CONCURRENCY = 2
# Rounds of blocks of messages: fifteen give each ratio an interval at 90% confidence from the
# 4th to the 12th round's (thirty gave the 11th to the 20th, narrower, but the worker alone then
# took half an hour, too long for the full run's 45 minutes)
ROUNDS = 15
# Messages in a block, by broker: half a second or more of the fastest variant (the plain task
# runs some 1,000 a second on Redis, 3,000 on RabbitMQ); RabbitMQ's blocks of 500, 0.17 s each,
# gave plain vs plain acks_late an interval of 0.67 to 1.16
BLOCK = {"Redis": 500, "RabbitMQ": 1500}
# Messages of each variant the worker runs before the first block: its pool's connections and
# prepared statements are made there, not in a measured block
WARM_UP = 200
# Rounds of the durable-queue task, each two workers of their own
DURABLE_ROUNDS = 5
DURABLE_MESSAGES = 2000
# Rounds of the node's cost (a worker that is a node vs one that is not), each two workers of their own
NODE_ROUNDS = 6
NODE_MESSAGES = 2000
# a worker that is a node against one that is not: no more than 1% of throughput
NODE_TARGET = 0.99
# (variant, task, target ratio against the plain task, its floor)
PLAIN = "plain task"
OPTIMISTIC_FLOOR = "floor: plain task writing its inbox row in its transaction"
EAGER_FLOOR = "floor: plain task committing its inbox row first"
OPTIMISTIC = "IdempotentTask optimistic"
VARIANTS = (
    (PLAIN, "bench.plain", None, None),
    ("plain task, acks_late", "bench.plain_late", None, None),
    (OPTIMISTIC_FLOOR, "bench.floor", None, None),
    (EAGER_FLOOR, "bench.floor_eager", None, None),
    (OPTIMISTIC, "bench.optimistic", 0.85, OPTIMISTIC_FLOOR),
    ("IdempotentTask eager", "bench.eager", 0.75, EAGER_FLOOR),
)
DURABLE = "durable-queue task"
DURABLE_FLOOR = "floor: plain task storing its envelope and acknowledging first"
DURABLE_OPTIMISTIC = "IdempotentTask optimistic on a durable queue"
# the durable-queue task against the optimistic IdempotentTask with the same body, in the same rounds
DURABLE_VS_OPTIMISTIC = 0.95
NODE = "IdempotentTask optimistic, the worker a node"
WITHOUT_NODE = "IdempotentTask optimistic, the worker no node"

Block = dict[str, float | dict[str, float]]  # a block's throughput ("rate") and CPU seconds per task ("cpu")


def marked_block(marks: redis.Redis, key: str, messages: int) -> Block:
    """A block's throughput and CPU per task from its marks ``key:start`` and ``key:end`` (each a
    ``cpu.mark_reading``), which are then deleted."""
    start, end = (json.loads(marks.get(f"{key}:{which}")) for which in ("start", "end"))
    marks.delete(f"{key}:start", f"{key}:end")
    spent = spent_between(start["cpu"], end["cpu"])
    return {"rate": messages / (end["time"] - start["time"]),
            "cpu": {part: seconds / messages for part, seconds in spent.items()}}


class Run:
    """One worker's queues, tables and marks, for one broker and one body."""

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
        self.marks_key = f"bench:{suffix}"  # the run's marks are under it: bench:<suffix>:<block>:start

    def empty_tables(self) -> None:
        """Start from empty tables: the rows an earlier run left would slow this one's inserts (a
        bigger index, autovacuum at work)."""
        tables = self.outbox.store.tables
        names = [table.name for table in (tables.incoming, tables.outgoing, *self.metadata.sorted_tables)]
        with self.outbox.engine.begin() as conn:
            conn.exec_driver_sql(f"TRUNCATE {', '.join(names)}")

    def blocks(self, tasks: list[str], rounds: int, block: int, warm_up: int = WARM_UP) -> list[dict[str, Block]]:
        """Each round's block of each of ``tasks``, drained by one worker from one queue: the
        rounds in the order they ran, each mapping a task to its block's throughput and CPU."""
        self.empty_tables()
        queue, send = self.env["BENCH_QUEUE"], self.app.send_task
        for task in tasks:
            for n in range(warm_up):
                send(task, (n,), queue=queue)
        key = f"{self.marks_key}:{uuid.uuid4().hex}"
        for number in range(rounds):
            for task in in_turn(tasks, number):
                self._fill(queue, f"{key}:{number}:{task}", task, block)
        last = in_turn(tasks, rounds - 1)[-1]
        self._drain(queue, f"{key}:{rounds - 1}:{last}:end", rounds * len(tasks) * block)
        return [{task: marked_block(self.marks, f"{key}:{number}:{task}", block) for task in tasks}
                for number in range(rounds)]

    def durable_round(self, messages: int) -> dict[str, Block]:
        """The plain task drained from the durable queue (stored and relayed by the outbox), then
        from the plain queue, then the optimistic ``IdempotentTask`` and the durable-queue task's
        floor from the plain queue, then the optimistic ``IdempotentTask`` from the durable queue,
        each by a worker of its own, from empty tables."""
        measured = {}
        self.empty_tables()
        for name, task, durable in ((DURABLE, "bench.plain", True), (PLAIN, "bench.plain", False),
                                    (OPTIMISTIC, "bench.optimistic", False),
                                    (DURABLE_FLOOR, "bench.floor_durable", False),
                                    (DURABLE_OPTIMISTIC, "bench.optimistic", True)):
            queue = self.env["BENCH_DURABLE_QUEUE" if durable else "BENCH_QUEUE"]
            key = f"{self.marks_key}:{uuid.uuid4().hex}"
            with self.outbox.transaction() if durable else nullcontext():  # one INSERT, then published in order
                self._fill(queue, key, task, messages)
            self._drain(queue, f"{key}:end", messages)
            measured[name] = marked_block(self.marks, key, messages)
        return measured

    def node_round(self, number: int, messages: int) -> dict[str, Block]:
        """The optimistic ``IdempotentTask`` drained from the plain queue by a worker that is a node
        (as every worker is) and by one that is not, each a worker of its own, in turn."""
        measured = {}
        for name in in_turn((NODE, WITHOUT_NODE), number):
            key = f"{self.marks_key}:{uuid.uuid4().hex}"
            self._fill(self.env["BENCH_QUEUE"], key, "bench.optimistic", messages)
            self._drain(self.env["BENCH_QUEUE"], f"{key}:end", messages,
                        {"BENCH_WITHOUT_NODE": "1"} if name == WITHOUT_NODE else {})
            measured[name] = marked_block(self.marks, key, messages)
        return measured

    def _fill(self, queue: str, key: str, task: str, messages: int) -> None:
        """Send a block: the start mark ``key:start``, ``messages`` messages of ``task``, the end mark."""
        send = self.app.send_task
        send("bench.mark", (f"{key}:start",), queue=queue)
        for n in range(messages):
            send(task, (n,), queue=queue)
        send("bench.mark", (f"{key}:end",), queue=queue)

    def _drain(self, queue: str, last_mark: str, messages: int, env: dict[str, str] | None = None) -> None:
        """Start a worker on ``queue`` (with ``env`` added to the run's environment) and stop it once
        it has recorded ``last_mark``."""
        limit = 60 + messages / 20  # twenty tasks a second: far slower than any variant
        worker_until("benchmarks.worker_app", queue, {**self.env, **(env or {})},
                     lambda: bool(self.marks.exists(last_mark)), limit, f"drain {messages} messages from {queue}",
                     CONCURRENCY)

    def close(self) -> None:
        delete_queues(self.app, (self.env["BENCH_QUEUE"], self.env["BENCH_DURABLE_QUEUE"]))
        self.metadata.drop_all(self.outbox.engine)
        drop_store(self.outbox)


def mean_cpu(blocks: list[Block]) -> dict[str, float]:
    """The CPU per task, by part, over all of a variant's blocks: a block's reading counts clock
    ticks of 10 ms, 20 µs a task in a block of 500; the mean of fifteen resolves about 1 µs."""
    if not blocks:
        return {}
    return {part: statistics.fmean(each["cpu"][part] for each in blocks) for part in CPU_PARTS}


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    rounds, block = options.size(ROUNDS, 2), options.units(BLOCK[broker], 20)
    durable_rounds, durable_messages = options.size(DURABLE_ROUNDS, 1), options.units(DURABLE_MESSAGES, 100)
    node_rounds, node_messages = options.size(NODE_ROUNDS, 2), options.units(NODE_MESSAGES, 100)
    results = []
    for body, label in (("noop", "no-op body"), ("write", "one DB write")):
        run = Run(broker_url, body)
        try:
            measured = run.blocks([task for _, task, _, _ in VARIANTS], rounds, block, options.units(WARM_UP, 10))
            durable = [run.durable_round(durable_messages) for _ in range(durable_rounds)]
            # the node's cost is the same whatever the body: measured where it weighs most, the no-op's
            nodes = [run.node_round(number, node_messages) for number in range(node_rounds)] if body == "noop" else []
            heartbeat = heartbeat_cost(run.outbox) if nodes else (0.0, 0.0, 0.0)
        finally:
            run.close()
        names = {task: name for name, task, _, _ in VARIANTS}
        by_name = [{names[task]: each for task, each in blocks.items()} for blocks in measured]
        for blocks in by_name:
            print(f"  worker {broker}, {label}: " + ", ".join(f"{name} {each['rate']:.0f}/s"
                                                             for name, each in blocks.items()), file=sys.stderr)
        results += [_row(broker, label, name, by_name, target, floor) for name, _, target, floor in VARIANTS[1:]]
        results.append(_row(broker, label, DURABLE, durable, None, None))
        results.append(_row(broker, label, DURABLE_FLOOR, durable, None, None))
        results.append(Result.of_rounds(
            "worker", f"{broker}, durable-queue task vs IdempotentTask optimistic, {label}", "tasks/s",
            [(each[DURABLE]["rate"], each[OPTIMISTIC]["rate"], each[DURABLE_FLOOR]["rate"]) for each in durable],
            target=(">=", DURABLE_VS_OPTIMISTIC), versus=OPTIMISTIC,
            note=cpu_note(mean_cpu([each[DURABLE] for each in durable]),
                          mean_cpu([each[OPTIMISTIC] for each in durable])).replace("vs plain", "vs optimistic")))
        # no target: what a durable queue costs the optimistic style (its envelope's commit of its own)
        results.append(Result.of_rounds(
            "worker", f"{broker}, {DURABLE_OPTIMISTIC} vs on a plain one, {label}", "tasks/s",
            [(each[DURABLE_OPTIMISTIC]["rate"], each[OPTIMISTIC]["rate"], None) for each in durable],
            versus=OPTIMISTIC,
            note=cpu_note(mean_cpu([each[DURABLE_OPTIMISTIC] for each in durable]),
                          mean_cpu([each[OPTIMISTIC] for each in durable])).replace("vs plain", "vs optimistic")))
        if nodes:
            spent = mean_cpu([each[NODE] for each in nodes])
            results.append(Result.of_rounds(
                "worker", f"{broker}, the worker a node vs not, IdempotentTask optimistic, {label}", "tasks/s",
                [(each[NODE]["rate"], each[WITHOUT_NODE]["rate"], None) for each in nodes],
                target=(">=", NODE_TARGET), versus=WITHOUT_NODE,
                note="; ".join((cpu_note(spent, mean_cpu([each[WITHOUT_NODE] for each in nodes])).replace(
                    "vs plain", "vs no node"), heartbeat_note(heartbeat, statistics.median(
                        each[NODE]["rate"] for each in nodes), sum(spent.values()))))))
    return results


def heartbeat_cost(outbox: Any, beats: int = 200) -> tuple[float, float, float]:
    """What one heartbeat of a node costs, measured in this process on a node it registers: the
    CPU seconds of this process and the wall seconds per heartbeat, and the interval between two."""
    node = outbox.node
    node.prepare()
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(beats):
            outbox.store.heartbeat(node.id)
        return ((time.process_time() - cpu) / beats, (time.perf_counter() - wall) / beats,
                outbox.settings.node_heartbeat_interval)
    finally:
        node.deregister()


def heartbeat_note(heartbeat: tuple[float, float, float], rate: float, cpu_per_task: float) -> str:
    """The node's running cost against the worker's: one heartbeat's CPU every interval, as a share of
    the CPU the worker spends on the tasks it runs in that interval at ``rate``."""
    cpu, wall, interval = heartbeat
    share = cpu / (interval * rate * cpu_per_task) if rate and cpu_per_task else 0.0
    return (f"one heartbeat: {cpu * 1e6:.0f} µs of the worker's CPU ({wall * 1e3:.2f} ms) every {interval:g} s, "
            f"{share:.4%} of the CPU its {interval * rate:,.0f} tasks of that time take")


def _row(broker: str, label: str, name: str, rounds: list[dict[str, Block]], target: float | None,
         floor: str | None) -> Result:
    """A variant's row: its rounds against the plain task's and its floor's of the same round."""
    rates = [(each[name]["rate"], each[PLAIN]["rate"], floor and each[floor]["rate"]) for each in rounds]
    cpu = cpu_note(*(mean_cpu([each[variant] for each in rounds]) for variant in (name, PLAIN, floor) if variant))
    against_late = floor and "vs plain with acks_late: " + _median_ratio(rounds, name, "plain task, acks_late")
    return Result.of_rounds("worker", f"{broker}, {name}, {label}", "tasks/s", rates,
                            target=None if target is None else (">=", target),
                            note="; ".join(filter(None, (against_late, cpu))))


def _median_ratio(rounds: list[dict[str, Block]], name: str, other: str) -> str:
    return f"{statistics.median(each[name]['rate'] / each[other]['rate'] for each in rounds):.2f}"


def cpu_note(spent: dict[str, float], plain: dict[str, float], floor: dict[str, float] | None = None) -> str:
    """CPU per task, in microseconds, by part, and how much more than the plain task's (and, given
    one, than its floor's)."""
    if not spent or not plain:
        return ""
    parts = ", ".join(f"{part} {spent[part] * 1e6:.0f}" for part in CPU_PARTS)
    more = [f"{_more(spent, other) * 1e6:+.0f} vs {label}" for label, other in (("plain", plain), ("floor", floor))
            if other]
    return f"CPU µs/task: {parts} ({', '.join(more)})"


def _more(spent: dict[str, float], other: dict[str, float]) -> float:
    return sum(spent.values()) - sum(other.values())


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
