"""What one task attempt costs the worker's pool process, counted in instructions, not seconds.

``python -m benchmarks.attempt [COUNT]`` runs each worker benchmark task (``worker_app``) through
Celery's tracer, the code a pool process runs for each message, in one process with no broker,
against the real PostgreSQL. Each variant runs COUNT times in one process under valgrind's
callgrind, which dumps its counts at a mark after the first quarter of the tasks and at one after
the last: the instructions between the two marks over the tasks between them are the instructions
per task, with start-up, warming up and shutting down left out. A run without valgrind gives the
CPU time per task beside them (seconds: they drift with the host's load).

Instruction counts do not drift with the host's load as seconds do: they settle which of two
variants does more work in the process where the two differ. They count this process only; the
database server's side of each round trip is not in them.

Not part of ``python -m benchmarks``'s table: it compares the variants with each other, not
with plain Celery's throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import worker_app
from .common import POSTGRES_URL, REDIS_URL, drop_store, unique_prefix

ROOT = Path(__file__).parents[1]
# (label, task): the plain task acknowledged late (what every IdempotentTask is), the two floors, and ours
VARIANTS = (
    ("plain task, acks_late", "bench.plain_late"),
    ("floor: inbox row in the body's transaction", "bench.floor"),
    ("IdempotentTask optimistic", "bench.optimistic"),
    ("floor: inbox row committed first", "bench.floor_eager"),
    ("IdempotentTask eager", "bench.eager"),
)
_TOTALS = re.compile(r"^totals:\s*(\d+)", re.M)


def _mark() -> None:
    """Where callgrind dumps its counts (``--dump-before=getloadavg``): a libc function that nothing
    else on a task's path calls."""
    os.getloadavg()


def run_tasks(task_name: str, count: int, body: str, marks: frozenset[int] = frozenset()) -> float:
    """Run ``count`` deliveries of ``task_name`` through Celery's tracer, on tables of their own
    (dropped after), calling ``_mark`` before the task of each index in ``marks`` (``count``: after
    the last). Returns the CPU seconds per task."""
    from celery.app.trace import build_tracer

    prefix = unique_prefix()
    # no heartbeat during the run: its statements would be counted in proportion to the run's length
    app, outbox, metadata = worker_app.create(REDIS_URL, POSTGRES_URL, prefix, "bench_attempt",
                                              "bench_attempt_durable", body, REDIS_URL,
                                              outbox_node_heartbeat_interval=3600)
    outbox.ready()
    metadata.create_all(outbox.engine)
    try:
        task = app.tasks[task_name]
        trace = build_tracer(task.name, task, app=app, eager=False)
        before = resource.getrusage(resource.RUSAGE_SELF)
        for n in range(count):
            if n in marks:
                _mark()
            task_id = str(uuid.uuid4())
            request = {"id": task_id, "task": task.name, "args": [n], "kwargs": {}, "retries": 0,
                       "root_id": task_id, "parent_id": None, "group": None, "hostname": "bench@attempt",
                       "delivery_info": {"exchange": "", "routing_key": "bench_attempt", "priority": 0,
                                         "redelivered": False}}
            _, info, _, _ = trace(task_id, (n,), {}, request)
            if info is not None and info.state != "SUCCESS":
                raise RuntimeError(f"{task_name} ended {info.state}: {info.retval!r}")
        if count in marks:
            _mark()
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        outbox.node.deregister()  # the eager style registered this process as a node
        metadata.drop_all(outbox.engine)
        drop_store(outbox)
    return ((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) / count


@dataclass(frozen=True)
class Instructions:
    """What callgrind counted in one process, in its three parts."""

    before: int  # start-up, the tables, and the first quarter of the tasks (warming up)
    counted: int  # the tasks between the two marks
    tasks: int  # how many tasks ran between them
    after: int  # shutting down: the tables dropped, the interpreter's exit

    @property
    def per_task(self) -> float:
        return self.counted / self.tasks


def instructions(task_name: str, count: int, body: str) -> Instructions:
    """User-space instructions callgrind counts in one process running ``count`` tasks, split at
    the marks after the first quarter of them and after the last."""
    first = max(1, count // 4)
    if count <= first:
        raise ValueError(f"count must be at least 2, not {count}")
    with tempfile.TemporaryDirectory(prefix="attempt-callgrind-") as folder:
        out = Path(folder) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--dump-before=getloadavg", f"--callgrind-out-file={out}",
                   sys.executable, "-m", "benchmarks.attempt", "--inner", task_name, str(count), "--body", body,
                   "--marks", f"{first},{count}"]
        done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="0"), capture_output=True,
                              text=True, timeout=1800)
        parts = {path.name: _totals(path) for path in Path(folder).iterdir()}
    if done.returncode != 0 or set(parts) != {out.name, f"{out.name}.1", f"{out.name}.2"}:
        raise RuntimeError(f"callgrind run of {task_name} x{count} failed (dumps: {sorted(parts)}): "
                           f"{done.stderr[-2000:]}")
    return Instructions(before=parts[f"{out.name}.1"], counted=parts[f"{out.name}.2"], tasks=count - first,
                        after=parts[out.name])


def _totals(dump: Path) -> int:
    found = _TOTALS.search(dump.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"{dump} has no totals line")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attempt", description=__doc__.split("\n\n")[0])
    parser.add_argument("count", nargs="?", type=int, default=200, help="tasks per variant (default 200)")
    parser.add_argument("--body", choices=("noop", "write"), default="noop", help="the task body (default noop)")
    parser.add_argument("--inner", metavar="TASK", help=argparse.SUPPRESS)
    parser.add_argument("--marks", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        run_tasks(args.inner, args.count, args.body, frozenset(int(n) for n in args.marks.split(",") if n))
        return 0
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    print(f"| task ({args.body} body) | instructions per task | CPU µs per task |")
    print("|---|---|---|")
    for label, task_name in VARIANTS:
        cpu = run_tasks(task_name, args.count, args.body)
        counted = instructions(task_name, args.count, args.body)
        print(f"| {label} | {counted.per_task:,.0f} | {cpu * 1e6:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
