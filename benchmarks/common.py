"""What every benchmark shares: the services, the result rows, the table and the JSON."""

from __future__ import annotations

import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

POSTGRES_URL = os.environ.get("CELERY_OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CELERY_OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")  # the tests take 15 and 14
RABBITMQ_URL = os.environ.get("CELERY_OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

_OPERATORS: dict[str, Callable[[float, float], bool]] = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
# The least confidence with which the table states a verdict; where the rounds' interval at this
# confidence straddles the target, the verdict is "undecided"
CONFIDENCE = 0.9


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A confidence interval of the median of the distribution ``values`` were drawn from, assuming
    nothing of its shape: the k-th smallest and the k-th largest value, for the largest k whose interval
    covers that median with at least ``confidence``. Each value falls on either side of the median
    with probability one half, so the interval misses it only when fewer than k values fall on one
    side: probability 2 P(Binomial(n, 1/2) < k). None when there are too few values to reach
    ``confidence`` (at 0.9: fewer than five; five give the lowest to the highest, at 0.94)."""
    ordered, n = sorted(values), len(values)
    chosen = None
    for k in range(1, n // 2 + 1):
        if 1 - 2 * sum(math.comb(n, below) for below in range(k)) / 2**n < confidence:
            break
        chosen = k
    return None if chosen is None else (ordered[chosen - 1], ordered[n - chosen])


@dataclass
class Result:
    """One line of the table. With ``plain``, the target applies to the ratio ours / plain (both
    measured in the same run); without, to ``ours`` itself.

    ``floor``, where the benchmark measures one, is the throughput of the least that any
    implementation of the same guarantee must do (plain Celery plus the database work the
    guarantee needs, written by hand), measured in the same run. A target that the floor
    itself misses (``floor_met`` False) is beyond what this machine allows.

    ``rounds``, where the benchmark measures in rounds, holds each round's (ours, plain, floor),
    measured side by side (plain and floor None where there are none); ``ours``, ``plain`` and
    ``floor`` are then their medians, and each ratio is the median of the rounds' own ratios: a
    drift of the machine's speed between rounds cancels out of them. The rounds also give each
    ratio a confidence interval (``median_interval``), and the verdict on a target is decided only
    where that interval lies wholly on one side of it: a difference smaller than the rounds'
    spread is the host's noise, not a measurement.

    ``versus`` names a peer library and its version (``"procrastinate 3.10.0"``): then ``plain`` is
    that peer's measurement, not plain Celery's, the ratio is ours / the peer's, and the row goes to
    the table's ``vs peer`` block.

    ``checks``, where a benchmark checks invariants as it measures, holds their counts by name."""

    benchmark: str
    case: str
    unit: str
    ours: float
    plain: float | None = None
    target: tuple[str, float] | None = None
    note: str = ""
    floor: float | None = None
    rounds: list[tuple[float, float | None, float | None]] | None = None
    versus: str | None = None
    checks: dict[str, int] | None = None

    @classmethod
    def of_rounds(cls, benchmark: str, case: str, unit: str,
                  rounds: list[tuple[float, float | None, float | None]], **fields: Any) -> "Result":
        """A row from rounds of (ours, plain, floor) measured side by side: the medians."""
        plains = [plain for _, plain, _ in rounds if plain is not None]
        floors = [floor for _, _, floor in rounds if floor is not None]
        return cls(benchmark, case, unit, statistics.median(ours for ours, _, _ in rounds),
                   plain=statistics.median(plains) if plains else None,
                   floor=statistics.median(floors) if floors else None, rounds=rounds, **fields)

    def _per_round(self, numerator: int, denominator: int | None = None) -> list[float]:
        """Field ``numerator`` of each round, divided by field ``denominator``."""
        assert self.rounds
        return [each[numerator] / (1.0 if denominator is None else each[denominator]) for each in self.rounds]

    def _paired(self, numerator: int, denominator: int) -> float:
        """The median over the rounds of field ``numerator`` / field ``denominator``."""
        return statistics.median(self._per_round(numerator, denominator))

    def _interval(self, numerator: int, denominator: int | None, present: bool) -> tuple[float, float] | None:
        if not self.rounds or not present:
            return None
        return median_interval(self._per_round(numerator, denominator))

    @property
    def interval(self) -> tuple[float, float] | None:
        """The confidence interval of what the target applies to (the ratio, or ours alone without
        plain Celery), from the rounds; None without rounds enough."""
        return self._interval(0, 1 if self.plain else None, True)

    @property
    def floor_interval(self) -> tuple[float, float] | None:
        return self._interval(2, 1, bool(self.plain) and self.floor is not None)

    @property
    def of_floor_interval(self) -> tuple[float, float] | None:
        return self._interval(0, 2, bool(self.floor))

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

    def _decided(self, met: bool | None, interval: tuple[float, float] | None) -> bool | None:
        """``met`` where the interval agrees at both ends (or there is none), else None: undecided."""
        if met is None or interval is None:
            return met
        low, high = (self._meets(end) for end in interval)
        return low if low == high else None

    @property
    def verdict(self) -> str | None:
        """On the target: "yes", "no", or "undecided" where the rounds' interval straddles it
        (None without a target). A row without rounds is judged by its one measurement."""
        decided = self._decided(self.met, self.interval)
        return None if self.target is None else {True: "yes", False: "no", None: "undecided"}[decided]

    @property
    def floor_verdict(self) -> str | None:
        """Whether the floor meets the target: "within" this machine, "beyond" it, or "undecided"."""
        decided = self._decided(self.floor_met, self.floor_interval)
        return None if self.floor_met is None else {True: "within", False: "beyond", None: "undecided"}[decided]

    @property
    def at_floor(self) -> bool | None:
        """Whether ours is at its floor within the host's noise: the interval of ours / floor reaches
        1 or beyond it on the target's side (without rounds enough for an interval, the one
        measurement does; None without a floor)."""
        if self.of_floor is None:
            return None
        interval = self.of_floor_interval or (self.of_floor, self.of_floor)
        higher_is_better = self.target is None or self.target[0] == ">="
        return interval[1] >= 1.0 if higher_is_better else interval[0] <= 1.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Result":
        """The row ``as_dict`` wrote (its derived fields are computed again, not read)."""
        target = data.get("target")
        if target is not None:
            operator, value = target.split()
            target = (operator, float(value))
        rounds = data.get("rounds")
        return cls(data["benchmark"], data["case"], data["unit"], data["ours"], plain=data.get("plain"),
                   target=target, note=data.get("note", ""), floor=data.get("floor"),
                   rounds=None if rounds is None else [tuple(each) for each in rounds], versus=data.get("versus"),
                   checks=data.get("checks"))

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ratio=self.ratio, met=self.met, floor_ratio=self.floor_ratio, floor_met=self.floor_met,
                    of_floor=self.of_floor, verdict=self.verdict, interval=self.interval,
                    floor_verdict=self.floor_verdict, floor_interval=self.floor_interval,
                    of_floor_interval=self.of_floor_interval, at_floor=self.at_floor,
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


ROOT = Path(__file__).parents[1]


def worker_until(app_module: str, queue: str, env: dict[str, str], done: Callable[[], bool], limit: float,
                 waiting_for: str, concurrency: int = 2) -> None:
    """A benchmark worker of ``app_module`` (prefork, ``concurrency`` processes) on ``queue``, with
    ``env`` added to the environment, stopped once ``done()`` (SIGTERM; its process group killed
    if it has not ended a minute later); ``RuntimeError`` naming ``waiting_for`` when it exits
    first or ``limit`` seconds pass."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", app_module, "worker", "-P", "prefork", "-c", str(concurrency),
         "-Q", queue, "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "WARNING",
         "-n", f"bench-{uuid.uuid4().hex[:8]}@%h"],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + limit
        while not done():
            if worker.poll() is not None:
                raise RuntimeError(f"the benchmark worker exited: {worker.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not {waiting_for} in {limit:.0f} s")
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)


def drop_store(outbox: Any) -> None:
    """Drop the outbox's tables (those that exist), once this process's node (a sender's) is
    deregistered, and close its engine."""
    outbox.node.deregister()
    store = outbox.store
    with store.begin() as conn:
        for table in reversed(store.tables.all()):
            table.drop(conn, checkfirst=True)
    store.engine.dispose()


def in_rounds(repeats: int, *measures: Callable[[], float]) -> list[list[float]]:
    """``repeats`` rounds in which each of ``measures`` takes its turn, in order in one round and in
    reverse in the next (``in_turn``): each round's measurements, side by side, in the order given
    (a machine whose speed drifts during the run weighs on each of them alike)."""
    rounds = []
    for number in range(repeats):
        measured = {index: measures[index]() for index in in_turn(range(len(measures)), number)}
        rounds.append([measured[index] for index in range(len(measures))])
    return rounds


def in_turn(items: Sequence[T], number: int) -> list[T]:
    """The order of round ``number``: as given, and reversed every other round."""
    return list(items) if number % 2 == 0 else list(items)[::-1]


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
    """The results as a Markdown table (what the README shows): the rows against plain Celery, then,
    under ``vs peer``, the rows against a peer library (its name and version in their own column)."""
    ours = [r for r in results if r.versus is None]
    peers = [r for r in results if r.versus is not None]
    blocks = []
    if ours or not peers:
        lines = ["| benchmark | case | celery-outbox | plain Celery | ratio | target | met |",
                 "|---|---|---|---|---|---|---|"]
        blocks.append("\n".join(lines + [_line(r) for r in ours]))
    if peers:
        lines = ["vs peer: the denominator is the peer named, not plain Celery (ratio = celery-outbox / peer)",
                 "",
                 "| benchmark | case | celery-outbox | peer | peer's | ratio | target | met |",
                 "|---|---|---|---|---|---|---|---|"]
        blocks.append("\n".join(lines + [_line(r) for r in peers]))
    return "\n\n".join(blocks)


def _line(r: Result) -> str:
    """A row of the table (with the peer's column where ``r`` is measured against one)."""
    plain = "" if r.plain is None else f"{_number(r.plain)} {r.unit}"
    ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
    target = "" if r.target is None else f"{r.target[0]} {r.target[1]:g}" + (" (ratio)" if r.plain else "")
    met = {None: "", "yes": "yes", "no": "**no**", "undecided": "undecided"}[r.verdict]
    if r.verdict is not None and r.interval is not None:
        met += f", {_span(r.interval, ratio=r.plain is not None)}"
    if r.floor_verdict is not None:  # what any implementation could reach here
        at_floor = "" if r.of_floor_interval is None else ": at its floor" if r.at_floor else ": short of its floor"
        met += f" (floor {r.floor_ratio:.2f}{_spanned(r.floor_interval)}: {_WHERE[r.floor_verdict]}; " \
               f"ours {r.of_floor:.2f} of it{_spanned(r.of_floor_interval)}{at_floor})"
    case = r.case + (f" ({r.note})" if r.note else "")
    peer = "" if r.versus is None else f" {r.versus} |"
    return f"| {r.benchmark} | {case} | {_number(r.ours)} {r.unit} |{peer} {plain} | {ratio} | {target} | {met} |"


def verdicts(results: list[Result]) -> str:
    """What the table says of the targets, in a few lines: which hold, which miss where their floor
    misses too (no implementation can meet them on this machine), which the host's noise leaves
    undecided, and which miss: at a floor that the host's noise leaves undecided, or not."""
    rows = [r for r in results if r.verdict is not None]
    groups = {
        "met": [r for r in rows if r.verdict == "yes"],
        "beyond this machine (missed or undecided; the floor misses too), ours at its floor":
            [r for r in rows if r.verdict != "yes" and r.floor_verdict == "beyond" and r.at_floor],
        "beyond this machine (missed or undecided; the floor misses too), ours short of its floor":
            [r for r in rows if r.verdict != "yes" and r.floor_verdict == "beyond" and not r.at_floor],
        "undecided (the rounds straddle the target)":
            [r for r in rows if r.verdict == "undecided" and r.floor_verdict != "beyond"],
        "missed, ours at its floor (whether the floor meets the target, this host cannot tell)":
            [r for r in rows if r.verdict == "no" and r.floor_verdict == "undecided" and r.at_floor],
        "missed": [r for r in rows if r.verdict == "no" and r.floor_verdict != "beyond"
                   and not (r.floor_verdict == "undecided" and r.at_floor)],
    }
    lines = [f"{len(rows)} targets, judged at {CONFIDENCE:.0%} confidence or more where a row has rounds enough:"]
    lines += [f"- {label}: {len(group)}" + "".join(f"\n  - {_named(r)}" for r in group)
              for label, group in groups.items() if group]
    return "\n".join(lines)


def _named(r: Result) -> str:
    return f"{r.benchmark}, {r.case}" + ("" if r.versus is None else f" (vs {r.versus})")


_WHERE = {"within": "within this machine", "beyond": "beyond this machine", "undecided": "undecided here"}


def _span(interval: tuple[float, float], ratio: bool = True) -> str:
    low, high = (f"{end:.2f}" if ratio else _number(end) for end in interval)
    return f"{low}–{high}"


def _spanned(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f", {_span(interval)}"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


@dataclass(frozen=True)
class Options:
    """``quick``: small sizes, to check that a benchmark runs (its numbers mean little). ``scale``:
    the share of its full count of units of work a round runs, set by the host's pace
    (``pace.Budget``) so that a full run takes about as long on a slower host."""

    quick: bool = False
    scale: float = 1.0

    def size(self, full: T, quick: T) -> T:
        """A size that does not follow the host's pace: rounds, seconds, a size a case names."""
        return quick if self.quick else full

    def units(self, full: int, quick: int) -> int:
        """A count of units of work (messages, rows, jobs) a round or warm-up runs: ``full`` scaled
        by ``scale`` (never below ``quick``), or ``quick`` in a quick run."""
        return quick if self.quick else max(quick, round(full * self.scale))
