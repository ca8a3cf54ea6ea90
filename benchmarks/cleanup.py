"""Cleanup: how fast it deletes handled inbox rows, and what it costs the inbox inserts running meanwhile.

1 M handled rows whose ``keep_until`` passed are loaded straight into the inbox table, vacuumed and
checkpointed (setup, not measured). In production these rows were written a day before and their
pages are on disk; without the checkpoint, the one that the load's 500 MB of WAL sets off writes
those pages while the cleanup runs. Then ``outbox.cleanup()`` deletes them in its batches while
another process keeps claiming new messages the way a worker does (one short transaction per claim,
into the same table). Their p99 is compared with the p99 of the same claims with no cleanup running,
in windows right before and right after each cleanup (the machine's other load drifts). Five rounds;
rows/s is their median, and the p99 ratio the median of the rounds' own ratios (on a shared machine
one round's tail can be another's double; the note gives each round's).

Each round of that series also runs the floor: the gentlest deletion that meets the rate target,
written by hand with no library code (``_floor_cleanup``): plain ``DELETE`` statements of 500
rows, no row locks, each its own transaction not waiting for the WAL flush, one every 5 ms,
exactly 100 k rows/s. Its rows are loaded anew and it runs with claims in windows of its own; its
p99 is set against the same windows without cleanup as ours (those of each round, around both).
Where the floor misses the p99 target too, deleting rows at the target rate misses it on this
machine however little else the deletion does; its pace is not the only one possible, so ours,
faster and in bigger batches, can come out ahead of it.

A second series runs the same claims committing without waiting for the WAL flush: it shows where
the difference comes from. A claim's commit must flush the log up to its own record, and so every
record the cleanup wrote before it: per deleted row a row-lock record and a delete record (54 bytes
each), and per heap page first touched since the last checkpoint an 8 kB page image (about 170 bytes
a row). The claims pay for flushing the deletes: a claim whose commit falls inside a cleanup
batch can wait in ``fdatasync`` until the batch ends, the more so while the cleanup writes out the
pages it deleted from to make room in ``shared_buffers``.

The claims run in a process of their own, as a worker's do: a thread next to the cleanup would measure
Python's GIL hand-over (up to its 5 ms switch interval whenever both threads want it), not the database.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

from celery import Celery
from sqlalchemy import text

from celery_outbox import Outbox
from celery_outbox.store import Store, build_engine, utcnow
from celery_outbox.store.schema import UNOWNED

from .common import POSTGRES_URL, Options, Result, drop_store, percentile, unique_prefix

# The floor's pace: the rate target, in batches of 500 rows, one every 5 ms
FLOOR_RATE = 100_000
FLOOR_BATCH = 500


def run(options: Options) -> list[Result]:
    rows = options.units(1_000_000, 50_000)
    rounds = options.size(5, 1)
    window = options.size(3.0, 0.5)  # seconds of claims without cleanup, right before and right after it
    app = Celery(f"bench-cleanup-{uuid.uuid4().hex[:6]}", broker="memory://")
    prefix = unique_prefix()
    outbox = Outbox(app, database_url=POSTGRES_URL, table_prefix=prefix)
    try:
        outbox.ready()
        rates, samples, written = _rounds(outbox, rows, rounds, window, durable=True, floor=True)
        _, flushless, _ = _rounds(outbox, rows, rounds, window, durable=False, floor=False)
        spread = f"median of {rounds}: {', '.join(f'{r:,.0f}' for r in rates)}" if rounds > 1 else ""
        return [
            Result.of_rounds("cleanup", "delete 1 M handled inbox rows", "rows/s",
                             [(rate, None, None) for rate in rates], target=(">=", 100_000),
                             note=f"{rows:,} rows" if options.quick else spread),
            _p99("p99 of concurrent inbox inserts, during cleanup vs without", samples, window, target=("<=", 2.0),
                 extra=f"floor: hand-written DELETEs of {FLOOR_BATCH} rows paced at {FLOOR_RATE:,} rows/s; "
                       f"shared_buffers {_setting(outbox, 'shared_buffers')}; pages written out by backends "
                       f"during each cleanup: {', '.join(f'{n:,}' for n in written)}"),
            _p99("the same inserts committing without waiting for the WAL flush", flushless, window),
        ]
    finally:
        drop_store(outbox)


def _rounds(outbox: Outbox, rows: int, rounds: int, window: float, durable: bool, floor: bool,
            ) -> tuple[list[float], dict[tuple[str, int], list[float]], list[int]]:
    """``rounds`` cleanups of ``rows`` rows, with claims (committing durably or not) running
    during each and in windows right before and after it, and with ``floor`` the floor's
    cleanup of as many rows after each, likewise; the rates, the claims' latencies by kind of
    window ("during", "floor", "without") and round, and the pages backends wrote out during each
    of ours (to make room in ``shared_buffers``: the write-out the claims' flushes wait behind)."""
    batch = outbox.settings.cleanup_batch_size
    claims = _Claims(outbox.store.prefix, outbox.settings.keep_after_handling, durable)
    try:
        rates: list[float] = []
        written: list[int] = []
        for n in range(1, rounds + 1):
            with _loaded_between_quiet_windows(outbox, rows, claims, n, window):
                before = _pages_written_by_backends(outbox)
                with claims.window("during", n):
                    started = time.perf_counter()
                    result = outbox.cleanup(max_batches=rows // batch + 2)
                    seconds = time.perf_counter() - started
                written.append(_pages_written_by_backends(outbox) - before)
            if result.incoming_deleted != rows:
                raise RuntimeError(f"cleanup deleted {result.incoming_deleted} rows, expected {rows}")
            rates.append(rows / seconds)
            _progress(f"  round {n}/{rounds}: {rows:,} rows in {seconds:.2f}s ({rows / seconds:,.0f} rows/s, "
                      f"{result.batches} batches of {batch})")
            if floor:
                with _loaded_between_quiet_windows(outbox, rows, claims, n, window), claims.window("floor", n):
                    deleted, seconds = _floor_cleanup(outbox)
                if deleted != rows:
                    raise RuntimeError(f"the floor's cleanup deleted {deleted} rows, expected {rows}")
                _progress(f"  round {n}/{rounds}, floor: {rows:,} rows in {seconds:.2f}s "
                          f"({rows / seconds:,.0f} rows/s)")
        samples = claims.finish()
    finally:
        claims.close()
    during, without = _pooled(samples, "during"), _pooled(samples, "without")
    _progress(f"  claims ({'durable' if durable else 'not waiting for the WAL flush'}) p99 "
              f"{_ms(during, 0.99)} during cleanup ({len(during)}), {_ms(without, 0.99)} without "
              f"({len(without)}); p50 {_ms(during, 0.5)} / {_ms(without, 0.5)}")
    return rates, samples, written


def _ms(latencies: list[float], share: float) -> str:
    """A percentile of claim latencies in milliseconds; a cleanup quicker than every claim of
    its window leaves none ("none ended")."""
    return f"{percentile(latencies, share) * 1000:.2f} ms" if latencies else "none ended"


@contextmanager
def _loaded_between_quiet_windows(outbox: Outbox, rows: int, claims: "_Claims", round_: int,
                                  window: float) -> Iterator[None]:
    """``rows`` expired rows loaded, then claims for ``window`` seconds with no cleanup; the block
    (a cleanup in a window of its own); then claims for ``window`` seconds again."""
    _load(outbox, rows)
    with claims.window("without", round_):
        time.sleep(window)
    yield
    with claims.window("without", round_):
        time.sleep(window)


def _floor_cleanup(outbox: Outbox) -> tuple[int, float]:
    """The floor: delete the inbox's expired rows by hand, as gently as the rate target allows.
    ``DELETE`` statements of ``FLOOR_BATCH`` rows each, oldest first from where the batch before
    ended (as ours, so that no batch wades through the index entries of the rows deleted before
    it), with no row locks, each in its own transaction that does not wait for the WAL flush,
    started on a schedule of exactly ``FLOOR_RATE`` rows a second. Returns the rows deleted and
    the seconds it took."""
    table = outbox.store.tables.incoming.name
    batch = text(f"""
        WITH gone AS (DELETE FROM {table} WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM {table} WHERE keep_until < now() AND keep_until >= :after
            ORDER BY keep_until LIMIT :limit)) RETURNING keep_until)
        SELECT count(*), max(keep_until) FROM gone
    """)
    after, deleted = datetime(1, 1, 1, tzinfo=timezone.utc), 0
    with outbox.store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("SET synchronous_commit TO off"))
        try:
            started = time.monotonic()
            while True:
                count, last = conn.execute(batch, {"after": after, "limit": FLOOR_BATCH}).one()
                deleted, after = deleted + count, last or after
                if count < FLOOR_BATCH:
                    return deleted, time.monotonic() - started
                time.sleep(max(0.0, started + deleted / FLOOR_RATE - time.monotonic()))
        finally:  # the session goes back to the pool: its later commits wait for the flush again
            conn.execute(text("RESET synchronous_commit"))


def _pages_written_by_backends(outbox: Outbox) -> int:
    """Buffers the server's backends have written out themselves since its statistics were reset."""
    with outbox.store.engine.connect() as conn:
        return conn.execute(text("SELECT buffers_backend FROM pg_stat_bgwriter")).scalar_one()


def _setting(outbox: Outbox, name: str) -> str:
    with outbox.store.engine.connect() as conn:
        return conn.execute(text("SELECT current_setting(:name)"), {"name": name}).scalar_one()


def _p99(case: str, samples: dict[tuple[str, int], list[float]], window: float,
         target: tuple[str, float] | None = None, extra: str = "") -> Result:
    """Each round's p99 of the claims during cleanup (and during the floor's, where it ran) against
    that of its claims without it (right before and after each): the medians, and the median of the
    rounds' ratios; ``extra`` ends the note."""
    rounds = sorted(n for kind, n in samples if kind == "during" and samples[kind, n] and samples.get(("without", n)))
    if not rounds:  # every cleanup ended before a claim it could slow began (a quick run on a busy host)
        return Result("cleanup", case, "ms", float("nan"),
                      note=f"no round had claims both during its cleanup and right before and after it: nothing to "
                           f"compare ({len(_pooled(samples, 'during'))} claims during, "
                           f"{len(_pooled(samples, 'without'))} without)")
    p99s = [(_p99_ms(samples, "during", n), _p99_ms(samples, "without", n), _p99_ms(samples, "floor", n))
            for n in rounds]
    each = ", ".join(f"{during / without:.2f}" for during, without, _ in p99s)
    floors = ", ".join(f"{floor / without:.2f}" for _, without, floor in p99s if floor is not None)
    return Result.of_rounds("cleanup", case, "ms", p99s, target=target,
                            note=f"{len(_pooled(samples, 'during'))} claims during, "
                                 f"{len(_pooled(samples, 'without'))} in {window:g} s right before and after; "
                                 f"each round's ratio: {each}" + (f"; the floor's: {floors}" if floors else "")
                                 + (f"; {extra}" if extra else ""))


def _p99_ms(samples: dict[tuple[str, int], list[float]], kind: str, round_: int) -> float | None:
    """The p99 of round ``round_``'s claims in windows of ``kind``, in ms (None where there were none)."""
    latencies = samples.get((kind, round_))
    return percentile(latencies, 0.99) * 1000 if latencies else None


def _pooled(samples: dict[tuple[str, int], list[float]], kind: str) -> list[float]:
    """The latencies of every round's windows of ``kind``."""
    return [latency for (k, _), latencies in samples.items() if k == kind for latency in latencies]


def _load(outbox: Outbox, rows: int) -> None:
    """``rows`` handled rows, random task ids (Celery's uuid4), ``keep_until`` over a day that ended 20 h ago;
    vacuumed and checkpointed, as rows written a day before are (the checkpoint needs a superuser or
    ``pg_checkpoint``)."""
    table = outbox.store.tables.incoming.name
    with outbox.store.engine.begin() as conn:
        conn.execute(text(f"""
            INSERT INTO {table} (message_id, destination, task_name, queue, status, owner, received_at,
                                 claimed_at, handled_at, keep_until)
            SELECT gen_random_uuid()::text, '', 'benchmarks.task', 'celery', 'handled', {UNOWNED},
                   t - interval '7 days', t - interval '7 days', t - interval '7 days', t
            FROM (SELECT now() - interval '2 days' + g * interval '100 milliseconds' AS t
                  FROM generate_series(1, :rows) AS g) AS s
        """), {"rows": rows})
    with outbox.store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text(f"VACUUM ANALYZE {table}"))
        conn.execute(text("CHECKPOINT"))


class _Claims:
    """A process claiming fresh messages as an optimistic worker does (``claim_incoming`` with status
    handled, each in its own short transaction), timing begin..commit, from its start to ``finish``;
    a cleanup's window keeps the claims that overlap it, a quiet one those that started inside it
    (``finish``). The claims never wait for a window to open, so a cleanup shorter than a wake-up on
    a busy host still has the claims that ran beside it, and none opens before the first claim."""

    def __init__(self, prefix: str, keep_seconds: float, durable: bool = True) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._claiming = context.Event(), context.Event()
        self._samples, sender = context.Pipe(duplex=False)
        self._windows: list[tuple[str, int, float, float]] = []
        self._process = context.Process(target=_claim, name="claims", daemon=True,
                                        args=(prefix, keep_seconds, durable, self._stop, self._claiming, sender))
        self._process.start()
        if not self._claiming.wait(120):  # spawned and importing: no window opens before it claims
            raise RuntimeError("the claims process made no claim in 120 s")

    class _Window:
        def __init__(self, claims: "_Claims", kind: str, round_: int) -> None:
            self.claims, self.kind, self.round = claims, kind, round_

        def __enter__(self) -> None:
            self.started = time.monotonic()

        def __exit__(self, *exc: Any) -> None:
            self.claims._windows.append((self.kind, self.round, self.started, time.monotonic()))

    def window(self, kind: str, round_: int) -> "_Claims._Window":
        return self._Window(self, kind, round_)

    def finish(self) -> dict[tuple[str, int], list[float]]:
        """Stop claiming; the latencies of each kind of window's claims, by (kind, round): a cleanup's
        window (ours, the floor's) has every claim that ran during any part of it (one the cleanup
        held up from before it began to after it ended too), a window without cleanup those that
        started inside it."""
        self._stop.set()
        if not self._samples.poll(60):
            raise RuntimeError("the claims process did not answer")
        samples: list[tuple[float, float]] | str = self._samples.recv()
        if isinstance(samples, str):
            raise RuntimeError(f"the claims process failed: {samples}")
        windows: dict[tuple[str, int], list[float]] = {}
        for started, latency in samples:
            key = next(((k, n) for k, n, begin, end in self._windows
                        if k != "without" and started < end and started + latency > begin), None)
            if key is None:
                key = next(((k, n) for k, n, begin, end in self._windows
                            if k == "without" and begin <= started < end), None)
            if key is not None:
                windows.setdefault(key, []).append(latency)
        return windows

    def close(self) -> None:
        self._stop.set()
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()


def _claim(prefix: str, keep_seconds: float, durable: bool, stop: Any, claiming: Any, sender: Any) -> None:
    """The claims process: (monotonic start, seconds) of every claim made until ``stop`` is set.
    Without ``durable`` each commits without waiting for the WAL flush."""
    store = Store(build_engine(POSTGRES_URL), prefix)
    samples: list[tuple[float, float]] = []
    try:
        while not stop.is_set():
            now = utcnow()
            row = {"message_id": str(uuid.uuid4()), "destination": "", "task_name": "benchmarks.task",
                   "queue": "celery", "status": "handled", "owner": UNOWNED, "retries": 0, "nesting": 0,
                   "replays": 0, "received_at": now, "claimed_at": now, "handled_at": now,
                   "keep_until": now + timedelta(seconds=keep_seconds)}
            started = time.monotonic()
            with store.begin(durable=durable) as conn:
                claimed = store.claim_incoming(conn, row)
            samples.append((started, time.monotonic() - started))
            claiming.set()
            if not claimed:
                raise RuntimeError("a fresh message id was taken for a duplicate")
    except Exception as exc:  # noqa: BLE001 - reported by finish()
        sender.send(f"{type(exc).__name__}: {exc}")
    else:
        sender.send(samples)
    finally:
        store.engine.dispose()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
