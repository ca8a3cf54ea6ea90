"""audit: the delivery audit's Spark job on 10 M archived envelopes, and an incremental second run on
10 M plus 1 M new against a full run of the same (envelopes per second).

Setup, not measured: a synthetic archive written straight with pyarrow, in vectorised chunks of
1 M messages, in exactly the files ``ParquetArchiver`` writes (``archive_schema(kind)``,
``<kind>/date=YYYY-MM-DD/part-<time>-<hex>.parquet``, the date of the same column, the same writer):

* ``sent``: one row per message (uuid4 ids, 8 tasks on 4 queues, 7 days of traffic), plus one cleanup
  batch per chunk archived twice, as an at-least-once archive may;
* ``incoming``: the inbox rows (identity "id": destination ``''``), ``handled`` but for a share ``dead``;
  2 % with ``duplicates`` > 0, 0.5 % late (> 60 s), some retried or recovered; the same batch twice;
* ``dead_letters``: the dead-lettered messages, and a few poison messages that were never sent.

Planted: ``LOST`` messages sent long ago and never handled, and ``IN_FLIGHT`` sent within the grace
period (not lost yet). The benchmark raises unless the job reports exactly those lost messages and the
other counts the generator knows (a wrong answer must not pass as a speed).

Measured: ``run_audit`` (the whole job: the archive check, the Spark computation, the ledger, the
outputs) on a ``local[2]`` session started once, warmed up on a small archive, reused for every run.
After the 10 M run, 1 M messages of the next day are archived beside them: the second run into the
same --out reads the new files and what its ledger carried (an incremental run), and a full run of
the 11 M that keeps no ledger (the cheapest full run) is timed beside it; both must give the
planted answer, in which the first archive's messages in flight are lost by then.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone

from .common import Options, Result

CHUNK = 1_000_000  # messages generated and written at once
DAYS = 7  # the archive's window (the throughput then comes per hour)
START = datetime(2026, 11, 2, tzinfo=timezone.utc)
QUEUES = ("celery", "payments", "emails", "reports")
TASKS = (("shop.pay", 1), ("shop.refund", 1), ("shop.ship", 0), ("shop.invoice", 0), ("mail.send", 2),
         ("mail.digest", 2), ("reports.daily", 3), ("reports.export", 3))  # (task, index of its queue)
EXCEPTIONS = ("ValueError", "TimeoutError", "KeyError")
DEAD_SHARE, LATE_SHARE, DUPLICATE_SHARE, RETRY_SHARE, RECOVERY_SHARE = 0.001, 0.005, 0.02, 0.02, 0.001
LOST, IN_FLIGHT, POISON = 7, 5, 3
REARCHIVED = 5000  # one cleanup batch (cleanup_batch_size) per chunk archived twice
GRACE = 3600.0  # the job's default --grace; "now" is 30 min after the last send
# 2 cores: 8 shuffle partitions (AQE coalesces them further); Spark's default 200 made the 1 M job ~70 % slower
SHUFFLE_PARTITIONS = 8
DRIVER_MEMORY = "6g"  # local mode: the driver is the executor (Spark's default is 1g)
US = 1_000_000
DAY_US = 86_400 * US
VARIANT = bytes.maketrans(b"0123456789abcdef", b"89ab89ab89ab89ab")


@dataclass
class Expected:
    """What the audit must report on the generated archive."""

    sent: int
    handled: int
    lost: int
    dead_lettered: int
    duplicates_discarded: int
    late: int
    lost_ids: set[str]
    now: datetime
    files: int = 0
    in_flight_ids: set[str] = field(default_factory=set)

    def then(self, later: "Expected") -> "Expected":
        """What the audit must report once ``later``'s messages are archived after these: this
        archive's messages in flight are lost by then."""
        counts = {key: getattr(self, key) + getattr(later, key) for key in ("sent", "handled", "dead_lettered",
                                                                             "duplicates_discarded", "late")}
        return Expected(**counts, lost=self.lost + len(self.in_flight_ids) + later.lost,
                        lost_ids=self.lost_ids | self.in_flight_ids | later.lost_ids, now=later.now,
                        in_flight_ids=later.in_flight_ids)


def run(options: Options) -> list[Result]:
    from celery_outbox.audit.job import AuditOptions
    from celery_outbox.audit.session import spark_session

    root = tempfile.mkdtemp(prefix="celery-outbox-audit-bench-", dir="/tmp")
    watch = DiskWatch(root)
    log = f"{root}/spark.log"
    results: list[Result] = []
    try:
        # spark.local.dir only takes effect before the JVM starts, and spark_session has no option for
        # it: spark-submit's arguments, which pyspark reads when it launches the JVM
        saved = os.environ.get("PYSPARK_SUBMIT_ARGS")
        os.environ["PYSPARK_SUBMIT_ARGS"] = (
            f"--conf spark.local.dir={root}/spark-local "
            "--conf spark.ui.showConsoleProgress=false pyspark-shell")
        try:
            began = time.perf_counter()
            # the JVM's start-up chatter and later errors go to the log: shown on failure only
            spark = spark_session(AuditOptions(out=f"{root}/unused", master="local[2]", driver_memory=DRIVER_MEMORY),
                                  log=log)
        finally:
            if saved is None:
                del os.environ["PYSPARK_SUBMIT_ARGS"]
            else:
                os.environ["PYSPARK_SUBMIT_ARGS"] = saved
        try:
            memory = spark.sparkContext.getConf().get("spark.driver.memory")
            if memory != DRIVER_MEMORY:
                raise RuntimeError(f"audit benchmark: a Spark session existed already (driver memory {memory})")
            _progress(f"spark session in {time.perf_counter() - began:.1f}s")
            if not options.quick:  # --quick checks the answers only: its times need no warm JVM
                _progress("warming up")
                measure(spark, root, 20_000, watch)  # JIT, codegen, class loading: not part of any run measured
            results += measure_incremental(spark, root, options.units(10_000_000, 20_000),
                                           options.units(1_000_000, 2_000), watch)
        finally:
            spark.stop()
    except Exception as exc:
        if not isinstance(exc, AssertionError) and os.path.exists(log):
            with open(log, errors="replace") as handle:
                _progress("the JVM's last words:\n" + "".join(handle.readlines()[-30:]))
        raise
    finally:
        watch.stop()
        shutil.rmtree(root, ignore_errors=True)
    _progress(f"peak disk use under {root}: {watch.peak / 2**20:,.0f} MiB")
    return results


def measure(spark, root: str, n: int, watch: DiskWatch) -> Result:
    """Generate an archive of ``n`` messages, audit it, check the answer; the job's envelopes per second
    (the warm-up's run)."""
    archive, out = f"{root}/archive-{n}", f"{root}/out-{n}"
    try:
        expected, size = prepare(archive, n, watch)
        seconds = audit(spark, archive, out, expected, watch, f"{n:,} messages")
    finally:
        shutil.rmtree(archive, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return Result(benchmark="audit", case=f"Spark job on {_count(n)} archived envelopes", unit="envelopes/s",
                  ours=n / seconds, note=f"local[2], {seconds:.0f} s; archive {size / 2**20:,.0f} MiB")


def measure_incremental(spark, root: str, n: int, new: int, watch: DiskWatch) -> list[Result]:
    """The full run on ``n`` messages (which leaves its ledger), then ``new`` messages of the day
    after archived: the second run into the same --out (incremental) against a full run of the whole
    archive, both checked."""
    archive, out, again = f"{root}/archive-{n}", f"{root}/out-{n}", f"{root}/out-{n}-full"
    try:
        expected, size = prepare(archive, n, watch)
        seconds = audit(spark, archive, out, expected, watch, f"{n:,} messages")
        first = Result(benchmark="audit", case=f"Spark job on {_count(n)} archived envelopes", unit="envelopes/s",
                       ours=n / seconds, note=f"local[2], {seconds:.0f} s; archive {size / 2**20:,.0f} MiB")
        began = time.perf_counter()
        later = generate(archive, new, seed=20261109, start=START + timedelta(days=DAYS), days=1)
        _progress(f"{new:,} messages of the next day archived in {time.perf_counter() - began:.1f}s")
        both = expected.then(later)
        incremental = audit(spark, archive, out, both, watch, f"{n:,} + {new:,} messages, incremental",
                            mode="incremental")
        full = audit(spark, archive, again, both, watch, f"{n:,} + {new:,} messages, full, no ledger", mode="full",
                     ledger=False)
    finally:
        for path in (archive, out, again):
            shutil.rmtree(path, ignore_errors=True)
    total = n + new
    second = Result(benchmark="audit", case=f"second run, {_count(n)} archived + {_count(new)} new: incremental",
                    unit="envelopes/s", ours=total / incremental,
                    note=f"local[2], {incremental:.0f} s against {full:.0f} s for a full run of the same archive that "
                         f"keeps no ledger (the cheapest full run): {full / incremental:.1f}x faster")
    return [first, second]


def prepare(archive: str, n: int, watch: DiskWatch) -> tuple[Expected, int]:
    """Generate the archive of ``n`` messages; what the audit must find, and the archive's size."""
    from celery_outbox.audit.checks import check_archive
    from celery_outbox.audit.location import Location

    began = time.perf_counter()
    expected = generate(archive, n)
    generated = time.perf_counter() - began
    files = check_archive(Location.of(archive))  # the job checks it too (timed there); fail early and clearly here
    expected.files = sum(len(paths) for paths in files.values())
    size = watch.usage(archive)
    _progress(f"{n:,} messages: archive of {expected.files} files, {size / 2**20:,.0f} MiB in {generated:.1f}s")
    return expected, size


def audit(spark, archive: str, out: str, expected: Expected, watch: DiskWatch, what: str, mode: str = "full",
          ledger: bool = True) -> float:
    """Audit ``archive`` into ``out`` (a full or an incremental run, as ``mode`` says it must be;
    keeping a ledger or not), check the answer; the seconds it took."""
    from celery_outbox.audit.job import AuditOptions, run_audit

    watch.reset()
    began = time.perf_counter()
    summary = run_audit(AuditOptions(out=out, archive=archive, now=expected.now, grace_seconds=GRACE,
                                     master="local[2]", shuffle_partitions=SHUFFLE_PARTITIONS, ledger=ledger), spark)
    seconds = time.perf_counter() - began
    verify(summary, expected)
    if summary["ledger"]["mode"] != mode:
        raise AssertionError(f"audit benchmark: a {summary['ledger']['mode']} run where a {mode} one was meant")
    kept = summary["ledger"]
    carried = f"{kept['files_read']} files read, {kept['messages_carried']:,} messages carried" \
        if kept["recorded"] else "no ledger"
    _progress(f"{what}: audit in {seconds:.1f}s, {carried}, peak disk {watch.peak / 2**20:,.0f} MiB")
    return seconds


def verify(summary: dict, expected: Expected) -> None:
    wanted = {key: getattr(expected, key) for key in ("sent", "handled", "lost", "dead_lettered",
                                                      "duplicates_discarded", "late")}
    got = {key: summary[key] for key in wanted}
    if got != wanted:
        raise AssertionError(f"audit benchmark: the job's summary {got} is not the planted {wanted}")
    reported = {example["message_id"] for example in summary["lost_examples"]}
    if reported != expected.lost_ids:
        raise AssertionError(f"audit benchmark: lost examples {sorted(reported)}, planted {sorted(expected.lost_ids)}")


# -- the synthetic archive ---------------------------------------------------------------------------


def generate(path: str, n: int, seed: int = 20261102, start: datetime = START, days: int = DAYS) -> Expected:
    """Write the archive of ``n`` messages sent over ``days`` from ``start`` under ``path`` (beside
    any files there); what the audit must find in it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    step = days * DAY_US // n
    first = start
    start = int(start.timestamp()) * US
    lost = [(j + 1) * n // (LOST + 1) for j in range(LOST)]  # spread over the window, long past the grace
    missing = pa.array(lost + list(range(n - IN_FLIGHT, n)), pa.int64())  # never handled (yet)
    now = datetime.fromtimestamp((start + (n - 1) * step) / US, timezone.utc) + timedelta(seconds=GRACE / 2)
    expected = Expected(sent=n, handled=0, lost=LOST, dead_lettered=POISON, duplicates_discarded=0, late=0,
                        lost_ids=set(), now=now)
    rng = random.Random(seed)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    dead_ids = 0
    for lo in range(0, n, CHUNK):
        k = min(CHUNK, n - lo)
        seeds = iter(range(seed + lo, seed + lo + 100))
        uniform = functools.partial(_uniform, k, seeds)
        index = pa.array(range(lo, lo + k), pa.int64())
        ids = uuid4_strings(k, rng)
        task = _below(uniform(), len(TASKS))
        task_name = pick([t for t, _ in TASKS], task)
        queue = pick([QUEUES[q] for _, q in TASKS], task)
        sent_us = pc.add(pc.add(pc.multiply(index, step), start), _below(uniform(), step))
        created_us = pc.subtract(sent_us, _below(uniform(), 50_000))  # committed, then published within 50 ms
        sent = pa.table({"message_id": ids, "destination": queue, "task_name": task_name,
                         "created_at": _timestamps(created_us), "sent_at": _timestamps(sent_us),
                         "deliver_at": pa.nulls(len(ids), pa.timestamp("us", tz="UTC"))})  # sent at once

        late = pc.less(uniform(), LATE_SHARE)
        transit_s = pc.if_else(late, pc.add(pc.multiply(uniform(), 600.0), 61.0),
                               pc.exp(pc.add(pc.multiply(_normal(uniform(), uniform()), 0.8), -3.5)))  # ~30 ms
        received_us = pc.add(sent_us, pc.cast(pc.floor(pc.multiply(transit_s, US)), pa.int64()))
        claimed_us = pc.add(received_us, _below(uniform(), 2_000))
        handled_us = pc.add(claimed_us, _below(uniform(), 20_000))
        dead = pc.less(uniform(), DEAD_SHARE)
        retries = pc.if_else(dead, 3, pc.if_else(pc.less(uniform(), RETRY_SHARE), _below(uniform(), 3, 1), 0))
        duplicates = pc.if_else(pc.less(uniform(), DUPLICATE_SHARE), _below(uniform(), 3, 1), 0)
        zeros = pa.nulls(k, pa.int32()).fill_null(0)
        incoming = pa.table({
            "message_id": ids, "destination": pa.nulls(k, pa.string()).fill_null(""), "task_name": task_name,
            "queue": queue, "status": pc.if_else(dead, "dead", "handled"), "retries": _int32(retries),
            "nesting": zeros, "replays": zeros, "duplicates": _int32(duplicates),
            "recoveries": _int32(pc.if_else(pc.less(uniform(), RECOVERY_SHARE), 1, 0)),
            "received_at": _timestamps(received_us), "claimed_at": _timestamps(claimed_us),
            "handled_at": _timestamps(handled_us)})
        arrived = pc.invert(pc.is_in(index, value_set=missing))
        incoming = incoming.filter(arrived)
        dead, late = dead.filter(arrived), late.filter(arrived)

        letters = incoming.filter(dead)
        count = letters.num_rows
        exception = _below(pc.random(count, initializer=next(seeds)), len(EXCEPTIONS))
        letters = pa.table({
            "id": pa.array(range(dead_ids + 1, dead_ids + count + 1), pa.int64()),
            "message_id": letters["message_id"], "destination": letters["destination"],
            "task_name": letters["task_name"], "queue": letters["queue"], "reason": pa.repeat("failed", count),
            "exception_type": pick(EXCEPTIONS, exception), "exception_message": pa.repeat("boom", count),
            "retries": letters["retries"], "nesting": letters["nesting"], "replays": letters["replays"],
            "failed_at": letters["handled_at"], "replay_count": pa.nulls(count, pa.int32()).fill_null(0)})
        dead_ids += count
        if lo == 0:  # malformed messages the inbox refused: dead letters of no sent message
            poison = letters.slice(0, 1).to_pylist()[0] if count else None
            letters = pa.concat_tables([letters, pa.Table.from_pylist([
                dict(poison or {}, id=10**12 + i, message_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                     destination="", reason="poison", exception_type=None, failed_at=first + timedelta(hours=i))
                for i in range(POISON)], schema=letters.schema)])

        expected.handled += incoming.num_rows - count
        expected.dead_lettered += count
        expected.duplicates_discarded += pc.sum(incoming["duplicates"]).as_py() or 0
        expected.late += pc.sum(pc.and_(late, pc.invert(dead))).as_py() or 0
        expected.lost_ids.update(sent.filter(pc.is_in(index, value_set=pa.array(lost, pa.int64())))
                                 ["message_id"].to_pylist())
        expected.in_flight_ids.update(sent.filter(pc.is_in(index, value_set=pa.array(range(n - IN_FLIGHT, n),
                                                                                       pa.int64())))
                                      ["message_id"].to_pylist())
        for kind, table, column in (("sent", sent, "sent_at"), ("incoming", incoming, "handled_at"),
                                    ("dead_letters", letters, "failed_at")):
            write(path, kind, table, column, stamp)
            if kind != "dead_letters":  # archived, then the delete failed: the next cleanup archives it again
                write(path, kind, table.slice(0, REARCHIVED), column, stamp)
    return expected


def write(path: str, kind: str, table, column: str, stamp: str) -> None:
    """``table`` as ParquetArchiver writes a batch: one file per date of ``column``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from celery_outbox.audit.archive import archive_schema

    table = table.cast(archive_schema(kind))
    days = pc.divide(pc.cast(table[column], pa.int64()), DAY_US)
    for day in pc.unique(days).to_pylist():
        folder = f"{path}/{kind}/date={(date(1970, 1, 1) + timedelta(days=day)).isoformat()}"
        os.makedirs(folder, exist_ok=True)
        pq.write_table(table.filter(pc.equal(days, day)), f"{folder}/part-{stamp}-{uuid.uuid4().hex}.parquet")


def uuid4_strings(k: int, rng: random.Random):
    """``k`` random ``str(uuid.uuid4())`` as an arrow string array, without a Python loop over them."""
    import pyarrow as pa

    digits = rng.randbytes(16 * k).hex().encode()
    text = bytearray(36 * k)
    source = 0
    for position in range(36):
        if position in (8, 13, 18, 23):
            text[position::36] = b"-" * k
        else:
            text[position::36] = digits[source::32]
            source += 1
    text[14::36] = b"4" * k  # the version
    text[19::36] = bytes(text[19::36]).translate(VARIANT)  # the variant
    offsets = pa.array(range(0, 36 * k + 1, 36), pa.int32())
    return pa.StringArray.from_buffers(k, offsets.buffers()[1], pa.py_buffer(bytes(text)))


def _uniform(k: int, seeds):
    """``k`` uniform doubles in [0, 1), each call from the next seed."""
    import pyarrow.compute as pc

    return pc.random(k, initializer=next(seeds))


def pick(values, index):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.take(pa.array(values), index)


def _below(uniform, limit: int, low: int = 0):
    """Integers in [low, low + limit) from uniform doubles in [0, 1)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.add(pc.cast(pc.floor(pc.multiply(uniform, float(limit))), pa.int64()), low)


def _normal(u1, u2):
    """Standard normal samples (Box-Muller)."""
    import math

    import pyarrow.compute as pc

    radius = pc.sqrt(pc.multiply(pc.ln(pc.subtract(1.0, u1)), -2.0))
    return pc.multiply(radius, pc.cos(pc.multiply(u2, 2 * math.pi)))


def _timestamps(micros):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(micros, pa.timestamp("us", tz="UTC"))


def _int32(values):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(values, pa.int32())


def _count(n: int) -> str:
    return f"{n // 1_000_000} M" if n % 1_000_000 == 0 else f"{n // 1000} k" if n % 1000 == 0 else str(n)


def _progress(text: str) -> None:
    print(f"  audit: {text}", file=sys.stderr, flush=True)


class DiskWatch:
    """The peak size of a directory tree, sampled every 2 s in a thread (a walk of Spark's shuffle files)."""

    def __init__(self, root: str):
        self.root, self.peak = root, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="audit-disk-watch", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.peak = self.usage(self.root)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            self.peak = max(self.peak, self.usage(self.root))

    @staticmethod
    def usage(root: str) -> int:
        total = 0
        for folder, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.stat(os.path.join(folder, name)).st_blocks * 512
                except OSError:
                    pass
        return total
