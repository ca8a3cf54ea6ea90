"""What every benchmark shares: the services, the result rows, the table and the JSON."""

from __future__ import annotations

import os
import platform
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

POSTGRES_URL = os.environ.get("CELERY_OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CELERY_OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
RABBITMQ_URL = os.environ.get("CELERY_OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

_OPERATORS: dict[str, Callable[[float, float], bool]] = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}


@dataclass
class Result:
    """One line of the table. With ``plain``, the target applies to the ratio ours / plain (both
    measured in the same run); without, to ``ours`` itself.

    ``floor``, where the benchmark measures one, is the throughput of the least that any
    implementation of the same guarantee must do (plain Celery plus the database work the
    guarantee needs, written by hand), measured in the same run. A target that the floor
    itself misses (``floor_met`` False) is beyond what this machine allows.

    ``rounds``, where the benchmark measures in rounds, holds each round's (ours, plain, floor),
    measured side by side; ``ours``, ``plain`` and ``floor`` are then their medians, and each
    ratio is the median of the rounds' own ratios: a drift of the machine's speed between
    rounds cancels out of them."""

    benchmark: str
    case: str
    unit: str
    ours: float
    plain: float | None = None
    target: tuple[str, float] | None = None
    note: str = ""
    floor: float | None = None
    rounds: list[tuple[float, float, float | None]] | None = None

    @classmethod
    def of_rounds(cls, benchmark: str, case: str, unit: str, rounds: list[tuple[float, float, float | None]],
                  **fields: Any) -> "Result":
        """A row from rounds of (ours, plain, floor) measured side by side: the medians."""
        floors = [floor for _, _, floor in rounds if floor is not None]
        return cls(benchmark, case, unit, statistics.median(ours for ours, _, _ in rounds),
                   plain=statistics.median(plain for _, plain, _ in rounds),
                   floor=statistics.median(floors) if floors else None, rounds=rounds, **fields)

    def _paired(self, numerator: int, denominator: int) -> float:
        """The median over the rounds of field ``numerator`` / field ``denominator``."""
        assert self.rounds
        return statistics.median(each[numerator] / each[denominator] for each in self.rounds)

    @property
    def ratio(self) -> float | None:
        if not self.plain:
            return None
        return self._paired(0, 1) if self.rounds else self.ours / self.plain

    @property
    def floor_ratio(self) -> float | None:
        """The floor against plain Celery: the best ratio any implementation could reach here."""
        if not self.plain or self.floor is None:
            return None
        return self._paired(2, 1) if self.rounds else self.floor / self.plain

    @property
    def of_floor(self) -> float | None:
        """Ours against the floor: how close to the least any implementation can do."""
        if not self.floor:
            return None
        return self._paired(0, 2) if self.rounds else self.ours / self.floor

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        measured = self.ratio if self.plain is not None else self.ours
        return self._meets(measured)

    @property
    def floor_met(self) -> bool | None:
        """Whether the floor meets the target (None without a floor or a target)."""
        if self.target is None or self.floor_ratio is None:
            return None
        return self._meets(self.floor_ratio)

    def _meets(self, measured: float | None) -> bool:
        assert self.target is not None
        return measured is not None and _OPERATORS[self.target[0]](measured, self.target[1])

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ratio=self.ratio, met=self.met, floor_ratio=self.floor_ratio, floor_met=self.floor_met,
                    of_floor=self.of_floor,
                    target=None if self.target is None else f"{self.target[0]} {self.target[1]:g}")
        return data


def unique_prefix() -> str:
    return f"b{uuid.uuid4().hex[:10]}_"


def delete_queues(app: Any, names: Any) -> None:
    """Delete the benchmark's queues from the broker (one never declared is skipped)."""
    with app.connection_for_write() as connection:
        for name in names:
            try:
                app.amqp.queues[name].bind(connection.default_channel).delete()
            except Exception:  # noqa: BLE001 - a queue never declared needs no deleting
                pass


def drop_store(outbox: Any) -> None:
    """Drop the outbox's tables (those that exist) and close its engine."""
    store = outbox.store
    with store.begin() as conn:
        for table in reversed(store.tables.all()):
            table.drop(conn, checkfirst=True)
    store.engine.dispose()


def in_rounds(repeats: int, *measures: Callable[[], float]) -> list[list[float]]:
    """``repeats`` rounds in which each of ``measures`` takes its turn: each round's measurements,
    side by side (a machine whose speed drifts during the run weighs on each of them alike)."""
    return [[measure() for measure in measures] for _ in range(repeats)]


def best_of(repeats: int, *measures: Callable[[], float]) -> list[float]:
    """For each of ``measures``, the best of ``repeats`` throughput measurements (the least disturbed
    by the rest of the machine), taken in turns (``in_rounds``)."""
    return [max(each) for each in zip(*in_rounds(repeats, *measures), strict=True)]


def rate(count: int, action: Callable[[], Any]) -> float:
    """``count`` divided by the seconds ``action`` took."""
    started = time.perf_counter()
    action()
    return count / (time.perf_counter() - started)


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import celery
    import sqlalchemy

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    memory_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                      if line.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory_kb / 2**20, 1),
            "python": platform.python_version(), "celery": celery.__version__, "sqlalchemy": sqlalchemy.__version__,
            "postgres": _postgres_version(), "redis": _redis_version()}


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def _postgres_version() -> str:
    try:
        import psycopg

        with psycopg.connect(POSTGRES_URL.replace("postgresql+psycopg", "postgresql"), connect_timeout=3) as conn:
            return conn.execute("SHOW server_version").fetchone()[0]
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"unavailable ({exc})"


def _redis_version() -> str:
    try:
        import redis

        return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).info()["redis_version"]
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"unavailable ({exc})"


def table(results: list[Result]) -> str:
    """The results as a Markdown table (what the README shows)."""
    lines = ["| benchmark | case | celery-outbox | plain Celery | ratio | target | met |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        plain = "" if r.plain is None else f"{_number(r.plain)} {r.unit}"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        target = "" if r.target is None else f"{r.target[0]} {r.target[1]:g}" + (" (ratio)" if r.plain else "")
        met = {None: "", True: "yes", False: "**no**"}[r.met]
        if r.floor_met is not None:  # what any implementation could reach here
            met += f" (floor {r.floor_ratio:.2f}: {'within' if r.floor_met else 'beyond'} this machine; " \
                   f"ours {r.of_floor:.2f} of it)"
        case = r.case + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.benchmark} | {case} | {_number(r.ours)} {r.unit} | {plain} | {ratio} | {target} | {met} |")
    return "\n".join(lines)


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


@dataclass(frozen=True)
class Options:
    """``quick``: small sizes, to check that a benchmark runs (its numbers mean little)."""

    quick: bool = False

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full
