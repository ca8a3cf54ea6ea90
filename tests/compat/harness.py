"""One real worker per mode of tests/apps/compat_app.py, and the outcomes of scenarios run on them.

All four workers (threads pool) run at once, each on its own queues and table prefix, with Redis
as broker and result backend and PostgreSQL as the store; the durable modes also run celery beat,
as a deployment with durable queues does. ``Harness.outcome(scenario, mode)`` runs the scenario in
every mode at once (one thread per mode, each driving its own app) the first time it is asked
for, and caches the outcomes (or the exception a scenario raised): plain Celery's outcome is
computed once per scenario and compared with every other mode's, and the waits of the modes
that differ overlap instead of adding up.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..apps import compat_app
from ..brokers import purge
from ..conftest import drop_store, unique_prefix
from ..workers import BeatProcess, WorkerProcess

POOL, CONCURRENCY = "threads", 4


@dataclass
class Mode:
    """One mode: the app as the test process builds it, and the worker that runs its tasks."""

    name: str
    compat: Any
    worker: WorkerProcess
    beat: BeatProcess | None
    run: str  # prefix of every Redis key this run writes


@dataclass
class Harness:
    modes: dict[str, Mode]
    outcomes: dict[tuple[str, str], Any] = field(default_factory=dict)

    def outcome(self, scenario: Callable[[Any], Any], mode: str) -> Any:
        """What ``scenario`` gave in ``mode``; raises what it raised there."""
        key = (scenario.__name__, mode)
        if key not in self.outcomes:
            with ThreadPoolExecutor(len(self.modes)) as pool:
                futures = {name: pool.submit(scenario, Context(m)) for name, m in self.modes.items()}
            for name, future in futures.items():
                exc = future.exception()
                self.outcomes[(scenario.__name__, name)] = (exc, None) if exc else (None, future.result())
        exc, value = self.outcomes[key]
        if exc is not None:
            raise exc
        return value


class Context:
    """What a scenario drives: the mode's tasks (``ctx.add``...), its app, and fresh Redis keys."""

    def __init__(self, mode: Mode):
        self.mode = mode
        self.compat = mode.compat
        self.app = mode.compat.app
        self.redis = mode.compat.redis

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compat, name)

    def key(self) -> str:
        """A Redis key no other scenario or run uses."""
        return f"{self.mode.run}:{uuid.uuid4().hex}"


def start(broker_url: str, database_url: str, log_dir: Path) -> Harness:
    """Start one worker per mode (in parallel: their start-ups overlap) and wait until all are ready."""
    run = f"compat:{uuid.uuid4().hex[:8]}"
    modes: dict[str, Mode] = {}
    for name in compat_app.MODES:
        prefix = unique_prefix()
        queue = f"compat_{name}_{uuid.uuid4().hex[:8]}"
        compat = compat_app.create(name, broker_url, broker_url, database_url, prefix, queue)
        if compat.outbox is not None:
            compat.outbox.ready()  # creates the tables before the worker and the test process use them
        env = {"COMPAT_MODE": name, "TEST_BROKER_URL": broker_url, "TEST_BACKEND_URL": broker_url,
               "TEST_DATABASE_URL": database_url, "TEST_TABLE_PREFIX": prefix, "TEST_QUEUE": queue}
        worker = WorkerProcess("tests.apps.compat_app", env, pool=POOL, concurrency=CONCURRENCY,
                               queues=[compat.queue, compat.other_queue], log_path=log_dir / f"{name}.log")
        beat = None
        if name in ("durable", "idempotent"):
            beat = BeatProcess("tests.apps.compat_app", env, log_path=log_dir / f"{name}-beat.log").start()
        modes[name] = Mode(name, compat, worker.start(), beat, run)
    harness = Harness(modes)
    try:
        for mode in modes.values():
            mode.worker.wait_ready()
            if mode.beat is not None:
                mode.beat.wait_ready()
    except BaseException:
        stop(harness)
        raise
    return harness


def stop(harness: Harness) -> None:
    for mode in harness.modes.values():
        if mode.beat is not None:
            mode.beat.stop()
        mode.worker.stop(cold=True)
    for mode in harness.modes.values():
        compat = mode.compat
        purge(compat.app, compat.queue, compat.other_queue)
        compat.disconnect()
        if compat.outbox is not None:
            drop_store(compat.outbox.store)
            compat.outbox.engine.dispose()
        for key in compat.redis.scan_iter(f"{mode.run}:*"):
            compat.redis.delete(key)
