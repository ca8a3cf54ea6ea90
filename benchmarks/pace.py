"""The host's pace sets how many units of work a full run's rounds run, to keep it within budget.

The full sizes (every benchmark's messages, rows and jobs per round) were set on one host, on
which each benchmark took ``REFERENCE_MINUTES``. A host whose round trips are slower takes longer
for the same sizes (a 2-core Intel Xeon about 1.3 times). So a full run runs a share of them,
``Options.scale``, set for each benchmark by a ``Budget``:

* before the first, by the calibration (``measure``): plain Celery's realistic unit of work (one
  row written on PostgreSQL and committed, then one ``apply_async`` to Redis: the producer
  benchmark's plain way) timed here against the reference host's ``REFERENCE_MS``;
* before each next one, by the pace the benchmarks run so far have shown: their minutes against
  the reference's at the scale they ran, which also counts what does not scale (workers and
  Spark starting, the peers' backlog of 100 k).

The number of rounds, which sets each ratio's interval, is never scaled; nor are the few sizes a
benchmark's case names.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from functools import partial

from .common import REDIS_URL, rate

#: Each benchmark's minutes at its full sizes on the host they were set on, a 2-core AMD EPYC VM
#: (2026-11-26 to 28), on which the calibration's unit of work took 1.1 ms (plain Celery's unit
#: writing one row ran 850 to 1,008 a second in the producer benchmark's rounds)
#: (asyncio's is estimated: its full runs took 7.4 and 6.7 minutes on the same kind of host on
#: 2026-12-07, whose calibration took 2.68 ms, 2.4 times the reference's; tenants' too: its runs
#: took 1.3 and 1.8 minutes at 0.87 and 0.62 of its full sizes on 2026-12-07, on hosts whose
#: calibration took 1.05 and 1.46 ms; beat's passes, about half of it, do not scale; with the
#: rounds of a tenant's database down added, 2.8 and 3.0 minutes at 0.65 and 0.63, calibration 1.41 and 1.42 ms)
REFERENCE_MINUTES = {"producer": 5.6, "worker": 16.1, "relay": 2.0, "contention": 1.3, "cleanup": 5.7,
                     "audit": 7.7, "django": 1.1, "peers": 4.0, "asyncio": 3.0, "tenants": 2.5}
REFERENCE_MS = 1.1
#: The full run's budget: 45 minutes less a margin for the calibration and the host's noise
BUDGET_MINUTES = 40.0
#: The least share of the full sizes a round runs, however slow the host
LEAST_SCALE = 0.2
#: The calibration: the median of passes of units of work, after a warm-up
PASSES = 9
UNITS = 100
WARM_UP = 100


@dataclass
class Budget:
    """The share of the full sizes each benchmark of a run runs (``scale_for``), from the host's
    pace: ``slowdown`` (the host's minutes over the reference's, for the same work) is the
    calibration's until a benchmark has run (``ran``), then what the benchmarks run have shown.
    The budget of a run of some benchmarks is their share of ``BUDGET_MINUTES``, so each runs at
    the scale the full run would give it. At most 1, at least ``LEAST_SCALE``."""

    names: list[str]
    slowdown: float
    spent: float = 0.0
    reference_ran: float = 0.0  # the reference's minutes for what ran, at the scales it ran
    scales: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget = BUDGET_MINUTES * sum(REFERENCE_MINUTES[name] for name in self.names) \
            / sum(REFERENCE_MINUTES.values())

    def scale_for(self, name: str) -> float:
        """The share of its full sizes benchmark ``name`` runs: the budget left over the time the
        benchmarks left would take at full sizes, at the pace seen."""
        left = self.names[self.names.index(name):]
        needed = self.slowdown * sum(REFERENCE_MINUTES[each] for each in left)
        scale = min(1.0, max(LEAST_SCALE, (self.budget - self.spent) / needed))
        self.scales[name] = scale
        return scale

    def ran(self, name: str, minutes: float) -> None:
        """Benchmark ``name`` took ``minutes`` at the scale ``scale_for`` gave it."""
        self.spent += minutes
        self.reference_ran += REFERENCE_MINUTES[name] * self.scales[name]
        self.slowdown = self.spent / self.reference_ran


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured (``ms_per_unit``, the median pass) and the host's slowdown
    against the reference host it gives."""

    ms_per_unit: float

    @property
    def slowdown(self) -> float:
        return self.ms_per_unit / REFERENCE_MS


def measure() -> Calibration:
    """Time the calibration's unit of work on this host (its own tables and queue, dropped after)."""
    from . import producer, producer_row

    app, outbox, plain, _ = producer.build(REDIS_URL)
    orders = producer_row.Orders(outbox)
    try:
        orders.plain(plain, WARM_UP, 1)
        passes = [1e3 / rate(UNITS, partial(orders.plain, plain, UNITS, 1)) for _ in range(PASSES)]
    finally:
        orders.close()
        producer._tear_down(app, outbox)
    calibration = Calibration(statistics.median(passes))
    print(f"pace: plain Celery's unit of work writing one row took {calibration.ms_per_unit:.2f} ms here "
          f"({REFERENCE_MS} ms on the host the full sizes were set on)", file=sys.stderr, flush=True)
    return calibration
