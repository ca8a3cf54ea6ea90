"""The host's pace, measured at the start of a full run, sets how many units of work a round runs.

The full sizes (every benchmark's messages, rows and jobs per round) were set on one host, on
which a full run of every benchmark took ``REFERENCE_MINUTES``. A host whose round trips are
slower takes longer for the same sizes (a 2-core Intel Xeon about 1.3 times). So a full run
first times plain Celery's realistic unit of work here (one row written on PostgreSQL and
committed, then one ``apply_async`` to Redis: the producer benchmark's plain way) against that
host's time, and scales every count of units of work by the ratio (``Options.units``) to keep
the run within ``BUDGET_MINUTES``. The number of rounds, which sets each ratio's interval, is
never scaled; nor are the few sizes a benchmark's case names (the peers' backlog of 100 k).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from .common import REDIS_URL, delete_queues, drop_store

#: The host the full sizes were set on: a 2-core AMD EPYC VM (2026-11-26 to 28), on which the full
#: run took 44 minutes and the calibration's unit of work 1.1 ms (plain Celery's unit writing one
#: row ran 850 to 1,008 a second in the producer benchmark's rounds)
REFERENCE_MINUTES = 44.0
REFERENCE_MS = 1.1
#: What the scaled parts may take: 45 minutes less a margin for what does not scale (services,
#: workers and Spark starting, the peers' backlog of 100 k)
BUDGET_MINUTES = 38.0
#: The calibration: the median of passes of units of work, after a warm-up
PASSES = 9
UNITS = 100
WARM_UP = 100


@dataclass(frozen=True)
class Pace:
    """What the calibration measured (``ms_per_unit``, the median pass) and the share of the full
    sizes a round runs on this host (``scale``, at most 1: a faster host runs the full sizes)."""

    ms_per_unit: float
    scale: float

    @classmethod
    def of(cls, ms_per_unit: float) -> "Pace":
        scale = BUDGET_MINUTES / REFERENCE_MINUTES * REFERENCE_MS / ms_per_unit
        return cls(ms_per_unit, min(1.0, scale))

    def as_dict(self) -> dict[str, float]:
        return {"calibration_ms_per_unit": round(self.ms_per_unit, 3), "scale": round(self.scale, 3)}


def measure() -> Pace:
    """Time the calibration's unit of work on this host (its own tables and queue, dropped after)."""
    from . import producer, producer_row

    app, outbox, plain, _ = producer.build(REDIS_URL)
    orders = producer_row.Orders(outbox)
    try:
        orders.plain(plain, WARM_UP, 1)
        passes = []
        for _ in range(PASSES):
            started = time.perf_counter()
            orders.plain(plain, UNITS, 1)
            passes.append((time.perf_counter() - started) / UNITS * 1e3)
    finally:
        orders.close()
        delete_queues(app, list(app.amqp.queues))
        drop_store(outbox)
    pace = Pace.of(statistics.median(passes))
    print(f"pace: plain Celery's unit of work writing one row took {pace.ms_per_unit:.2f} ms here "
          f"({REFERENCE_MS} ms on the host the sizes were set on): rounds run {pace.scale:.2f} of their full "
          f"units of work", file=sys.stderr, flush=True)
    return pace
