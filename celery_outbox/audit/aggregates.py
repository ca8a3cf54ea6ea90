"""The delivery audit's numbers, computed with Spark from its de-duplicated inputs.

No transaction: it reads DataFrames and returns figures. Lost, duplicate, late and stuck messages,
latency to handled (per task and per hour, kept apart by ``Timing``: immediate or scheduled),
throughput over time and dead letters by task and exception are defined in docs/audit.md; a sent
message and its inbox rows are matched by id, and by destination too when the inbox keyed by id
and queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta, timezone
from enum import Enum
from functools import reduce
from typing import Any

from celery_outbox.audit.inputs import Inputs, jdbc_url_of
from celery_outbox.audit.options import AuditOptions
from celery_outbox.audit.sketch import bucket_of, quantile_columns
from celery_outbox.vocabulary import ArchiveKind, IncomingStatus

__all__ = ["COUNTS", "FINAL_STATUSES", "LATENCY_BUCKETS", "TIMINGS", "Aggregates", "Tally", "Timing", "Tracking",
           "aggregate", "filled_buckets", "iso", "latencies", "merged_window", "open_sends", "quantiles", "sends_of",
           "tally"]

LATENCY_BUCKETS = [0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                   3600.0, 86400.0]

#: an attempt the message will not go past: handled, failed for good, or revoked unrun (a retried
#: attempt is followed by another)
FINAL_STATUSES = (IncomingStatus.HANDLED.value, IncomingStatus.DEAD.value, IncomingStatus.REVOKED.value)


class Tracking(str, Enum):
    """How far the inputs follow a kind of message (the summary's ``inputs.coverage``)."""

    END_TO_END = "end_to_end"  #: each send is recorded: lost, late and latency are checked
    INBOX_ONLY = "inbox_only"  #: inbox rows alone: handled, duplicates and dead letters count; a loss cannot show


class Timing(str, Enum):
    """When a message was meant to run, which says where its latency starts (the ``timing`` column)."""

    IMMEDIATE = "immediate"  #: sent without countdown or eta: latency from its send
    SCHEDULED = "scheduled"  #: sent with countdown or eta: latency from its due time (or its send, if later)


TIMINGS = tuple(timing.value for timing in Timing)

#: the counts a ``Tally`` adds up
COUNTS = ("sent", "handled", "dead_lettered", "duplicates_discarded", "late", "inbox_only")


@dataclass
class Tally:
    """What a set of messages adds to the audit's figures, in a form that adds up: the figures of
    two sets with no message in common are the sum of their tallies (``plus``). A ledger keeps
    the tally of the messages it has settled.

    ``counts`` (``COUNTS``), the sent window (first and last ``sent_at``, naive UTC, or None), the
    latency ``histogram`` per ``Timing`` value (a count per ``LATENCY_BUCKETS`` bucket), and
    DataFrames: ``latency`` (``task_name``, ``timing``, ``hour``, ``bucket``, ``count``, ``max``:
    the ``sketch``), ``throughput``
    (``period``, ``sent``, ``handled``, per ``unit``) and ``dead_letters`` (``task_name``,
    ``exception``, ``count``)."""

    counts: dict[str, int]
    window: tuple[Any, Any]
    histogram: dict[str, list[int]]
    latency: Any
    throughput: Any
    dead_letters: Any

    def plus(self, other: "Tally", unit: str) -> "Tally":
        """The tally of both sets (with no message in common), its throughput per ``unit`` (this
        tally's, or a coarser one)."""
        from pyspark.sql import functions as F

        periods = self.throughput.unionByName(other.throughput).groupBy(
            F.date_trunc(unit, "period").alias("period")).agg(F.sum("sent").alias("sent"),
                                                               F.sum("handled").alias("handled"))
        letters = self.dead_letters.unionByName(other.dead_letters).groupBy("task_name", "exception").agg(
            F.sum("count").alias("count"))
        return Tally({key: self.counts[key] + other.counts[key] for key in COUNTS},
                     merged_window(self.window, other.window),
                     {t: [a + b for a, b in zip(self.histogram[t], other.histogram[t], strict=True)]
                      for t in TIMINGS},
                     self.latency.unionByName(other.latency), periods, letters)

    def minus(self, part: "Tally", unit: str) -> "Tally":
        """The tally of this set without ``part``, a subset of it. The window and each latency
        maximum stay this set's: both are extremes, and the messages of ``part`` stay in the
        inputs of the runs to come (a ledger carries them), whose extremes include theirs."""
        from pyspark.sql import functions as F

        def less(mine, theirs, keys: list[str], measures: list[str]):
            negated = theirs.select(*keys, *[(-F.col(m)).alias(m) for m in measures])
            summed = mine.select(*keys, *measures).unionByName(negated).groupBy(*keys).agg(
                *[F.sum(m).alias(m) for m in measures])
            return summed.where(reduce(lambda a, b: a | b, [F.col(m) != 0 for m in measures]))

        keys = ["task_name", "timing", "hour", "bucket"]
        latency = less(self.latency, part.latency, keys, ["count"]).join(
            self.latency.groupBy(*keys).agg(F.max("max").alias("max")), keys)
        periods = self.throughput.select(F.date_trunc(unit, "period").alias("period"), "sent", "handled")
        return Tally({key: self.counts[key] - part.counts[key] for key in COUNTS}, self.window,
                     {t: [a - b for a, b in zip(self.histogram[t], part.histogram[t], strict=True)]
                      for t in TIMINGS}, latency,
                     less(periods, part.throughput, ["period"], ["sent", "handled"]),
                     less(self.dead_letters, part.dead_letters, ["task_name", "exception"], ["count"]))


@dataclass
class Aggregates:
    """What the audit computed: the summary (plain data, ``summary.json``), the latency histogram
    per ``Timing`` value (its buckets from the first filled to the last: low, high, count), and the
    DataFrames the outputs write (latency per task and per hour, each per timing, with their
    quantiles in a ``q`` array, throughput per period, dead letters by task and exception, the lost messages);
    ``unit`` is the throughput's period, ``total`` the tally of every message, settled or read."""

    summary: dict[str, Any]
    histogram: dict[str, list[tuple[float, float, int]]]
    by_task: Any
    by_hour: Any
    throughput: Any
    dead_by_task: Any
    lost: Any
    unit: str
    total: Tally


def sends_of(sent) -> tuple[int, tuple[Any, Any]]:
    """How many de-duplicated sends there are, and their window: (first, last) ``sent_at`` (naive
    UTC; None without sends). One Spark job."""
    from pyspark.sql import functions as F

    row = sent.agg(F.count(F.lit(1)), F.min("sent_at"), F.max("sent_at")).first()
    return row[0], (row[1], row[2])


def merged_window(*windows: tuple[Any, Any]) -> tuple[Any, Any]:
    """The window that spans ``windows``: the first start and the last end present (None if none)."""
    return (min((w[0] for w in windows if w[0] is not None), default=None),
            max((w[1] for w in windows if w[1] is not None), default=None))


def tally(frames: dict, options: AuditOptions, unit: str, cached: list[Any],
          sends: tuple[int, tuple[Any, Any]] | None = None) -> Tally:
    """The tally of the messages in the de-duplicated ``frames`` (by ``ArchiveKind``), its
    throughput per ``unit``; ``sends`` is ``sends_of(frames[ArchiveKind.SENT])`` when
    the caller has it already. The latencies and the tally's frames are cached (several figures
    read them) and appended to ``cached`` for the caller to unpersist."""
    from pyspark.sql import functions as F

    incoming, sent, dead = frames[ArchiveKind.INCOMING], frames[ArchiveKind.SENT], frames[ArchiveKind.DEAD_LETTERS]
    handled = incoming.where(F.col("status") == IncomingStatus.HANDLED.value)
    latency = latencies(F, _matched(handled, sent)).cache()
    cached.append(latency)
    sketch = latency.groupBy("task_name", "timing", F.date_trunc("hour", "sent_at").alias("hour"),
                             bucket_of(F, F.col("latency")).alias("bucket")).agg(
        F.count(F.lit(1)).alias("count"), F.max("latency").alias("max"))
    throughput = (sent.groupBy(F.date_trunc(unit, "sent_at").alias("period")).agg(F.count(F.lit(1)).alias("sent"))
                  .join(handled.groupBy(F.date_trunc(unit, "handled_at").alias("period"))
                        .agg(F.count(F.lit(1)).alias("handled")), "period", "full_outer").na.fill(0))
    letters = dead.groupBy("task_name", F.coalesce("exception_type", "reason").alias("exception")).count()
    sent_count, window = sends if sends is not None else sends_of(sent)
    inbox = incoming.agg(F.count_if(F.col("status") == IncomingStatus.HANDLED.value),
                         F.coalesce(F.sum("duplicates"), F.lit(0))).first()
    histogram, late = _histogram(latency, F, options.late_after_seconds)
    counts = {
        "sent": sent_count, "handled": inbox[0], "dead_lettered": dead.count(), "duplicates_discarded": int(inbox[1]),
        "late": late, "inbox_only": incoming.join(sent.select("message_id").distinct(), "message_id",
                                                  "left_anti").count(),
    }
    small = [frame.cache() for frame in (sketch, throughput, letters)]  # read again by every figure that adds them
    cached.extend(small)
    return Tally(counts, window, histogram, *small)


def latencies(F, matched):
    """Spark: the rows of ``matched`` (handled rows with their sends: ``handled_at``, ``sent_at``,
    ``deliver_at``) that have a latency, with their ``timing`` (a ``Timing`` value) and, in
    seconds, their ``latency``: from the send, or from the due time (``deliver_at``) when later."""
    start = F.greatest(F.col("sent_at"), F.coalesce(F.col("deliver_at"), F.col("sent_at")))
    timing = F.when(F.col("deliver_at").isNull(), F.lit(Timing.IMMEDIATE.value)).otherwise(Timing.SCHEDULED.value)
    return matched.withColumn("latency", F.col("handled_at").cast("double") - start.cast("double")).withColumn(
        "timing", timing).where(F.col("latency").isNotNull())


def aggregate(inputs: Inputs, options: AuditOptions, cached: list[Any], ran_on: dict[str, Any],
              settled: Tally | None = None) -> Aggregates:
    """Compute the audit from ``inputs``, and from the ``settled`` tally of the messages earlier
    runs settled (``ledger``) when there is one. The lost messages and the latencies are cached
    (each is read by several aggregates) and appended to ``cached`` for the caller to unpersist,
    with the live tables the inputs keep; ``ran_on`` is the summary's ``spark`` entry."""
    F = inputs.F
    now = options.now.astimezone(timezone.utc).replace(tzinfo=None)  # Spark timestamps are UTC, session tz UTC

    cached.extend(inputs.cached)
    lost = open_sends(F, inputs.sent, inputs.incoming, inputs.dead).where(
        F.col("sent_at") < F.lit(now - timedelta(seconds=options.grace_seconds)))
    stuck = pending = None
    if inputs.outgoing is not None:
        held = inputs.outgoing.select("message_id").unionByName(inputs.running.select("message_id"))
        lost = lost.join(held, "message_id", "left_anti")
        stuck_before = F.lit(now - timedelta(seconds=options.stuck_after_seconds))
        stuck = (inputs.outgoing.where(F.col("sent_at").isNull() & (F.col("created_at") < stuck_before)).count()
                 + inputs.running.where(F.col("received_at") < stuck_before).count())
        unsent = inputs.outgoing.where(F.col("sent_at").isNull()).count()
        pending = {"outgoing_unsent": unsent, "outgoing_unacknowledged": inputs.outgoing.count() - unsent,
                   "incoming_running": inputs.running.count()}
    lost = lost.cache()  # its examples, its count and its aggregate
    cached.append(lost)

    sends = sends_of(inputs.sent)
    unit = _throughput_unit(*(sends[1] if settled is None else merged_window(sends[1], settled.window)))
    frames = {ArchiveKind.INCOMING: inputs.incoming, ArchiveKind.SENT: inputs.sent,
              ArchiveKind.DEAD_LETTERS: inputs.dead}
    total = tally(frames, options, unit, cached, sends)
    if settled is not None:
        total = settled.plus(total, unit)
    overall = {row.timing: row for row in quantile_columns(F, total.latency, ["timing"]).collect()}
    by_task = quantile_columns(F, total.latency, ["task_name", "timing"]).orderBy("task_name", "timing")
    by_hour = quantile_columns(F, total.latency, ["hour", "timing"]).orderBy("hour", "timing")
    throughput = total.throughput.orderBy("period")
    dead_by_task = total.dead_letters.orderBy(F.desc("count"), "task_name", "exception")
    counts = total.counts
    histogram = {timing: filled_buckets(counts) for timing, counts in total.histogram.items()}

    lost_rows = lost.orderBy("sent_at", "message_id").limit(20).collect()
    summary = {
        "generated_at": options.now.isoformat(timespec="seconds"),
        "window_start": iso(total.window[0]), "window_end": iso(total.window[1]),
        "sent": counts["sent"],
        "handled": counts["handled"],
        "lost": lost.count(),
        "duplicates_discarded": counts["duplicates_discarded"],
        "dead_lettered": counts["dead_lettered"],
        "late": counts["late"],
        "late_threshold_seconds": options.late_after_seconds,
        "stuck": stuck,
        "latency_seconds": quantiles(overall.get(Timing.IMMEDIATE.value)),
        "scheduled_latency_seconds": quantiles(overall.get(Timing.SCHEDULED.value)),
        "throughput_unit": unit,
        "lost_examples": [{"message_id": r.message_id, "task_name": r.task_name, "destination": r.destination,
                           "sent_at": iso(r.sent_at)} for r in lost_rows],
        "inputs": _inputs_summary(inputs, options, pending, counts),
        "spark": ran_on,
    }
    return Aggregates(summary, histogram, by_task, by_hour, throughput, dead_by_task, lost, unit, total)


def _inputs_summary(inputs: Inputs, options: AuditOptions, pending: dict[str, int] | None,
                    counts: dict[str, int]) -> dict[str, Any]:
    """The summary's ``inputs``: the archive and the live tables read, with their rows (before
    de-duplication) and the live rows still holding a message, and what they cover. Durable
    queues are followed end to end when sends were recorded (an archive configured, or sent rows
    the outgoing table still holds); a plain queue's messages leave no send record, only inbox
    rows: messages with inbox rows and no send record are counted as ``plain_queues`` messages (a
    durable queue's too, when its sends were not recorded)."""
    sent = counts["sent"]
    live = None
    if inputs.live_rows is not None:
        url, _ = jdbc_url_of(options.jdbc_url)
        live = {"url": url.split("?")[0], "rows": inputs.live_rows, "pending": pending}
    return {
        "archive": {"path": str(inputs.archive), "rows": inputs.archive_rows} if inputs.archive else None,
        "live": live,
        "coverage": {
            "durable_queues": {"tracked": (Tracking.END_TO_END if sent else Tracking.INBOX_ONLY).value,
                               "messages": sent},
            "plain_queues": {"tracked": Tracking.INBOX_ONLY.value, "messages": counts["inbox_only"]},
        },
    }


def open_sends(F, sent, incoming, dead):
    """The de-duplicated ``sent`` rows whose message has not ended: no final inbox row (handled,
    dead or revoked) and no dead letter."""
    ended = incoming.where(F.col("status").isin(*FINAL_STATUSES))
    return _without(_without(sent, ended), dead.select("message_id", "destination"), by_id_only=True)


def _without(sent, ended, by_id_only: bool = False):
    """``sent`` rows with no ``ended`` row: matched by id when the inbox keyed by id alone
    (destination ``''``), else by id and destination."""
    if by_id_only:
        return sent.join(ended.select("message_id").distinct(), "message_id", "left_anti")
    by_id = ended.where(ended.destination == "").select("message_id").distinct()
    by_queue = ended.where(ended.destination != "").select("message_id", "destination").distinct()
    return sent.join(by_id, "message_id", "left_anti").join(by_queue, ["message_id", "destination"], "left_anti")


def _matched(handled, sent):
    """Handled rows with their send time, by the same identity rule as ``_without``."""
    sent = sent.withColumnRenamed("destination", "sent_destination").withColumnRenamed("task_name", "sent_task")
    joined = handled.join(sent, "message_id").where(
        (handled.destination == "") | (handled.destination == sent.sent_destination))
    return joined.dropDuplicates(["message_id", "destination"])


def _throughput_unit(first, last) -> str:
    """Seconds for a window of minutes (a demo, a test), minutes up to two days, hours beyond."""
    span = (last - first).total_seconds() if first is not None and last is not None else 0
    return "second" if span <= 600 else "minute" if span <= 2 * 86400 else "hour"


def _histogram(latency, F, late_after: float) -> tuple[dict[str, list[int]], int]:
    """Per ``Timing`` value, the count of latencies in each ``LATENCY_BUCKETS`` bucket (the last one
    open-ended), and how many are over ``late_after`` seconds: one pass."""
    bucket = reduce(lambda expr, i: expr.when(F.col("latency") < LATENCY_BUCKETS[i + 1], i),
                    range(len(LATENCY_BUCKETS) - 1), F).otherwise(len(LATENCY_BUCKETS) - 1)
    rows = latency.groupBy("timing", bucket.alias("bucket")).agg(F.count(F.lit(1)),
                                                                 F.count_if(F.col("latency") > late_after))
    counts = {(row[0], row[1]): (int(row[2]), int(row[3])) for row in rows.collect()}
    histogram = {t: [counts.get((t, i), (0, 0))[0] for i in range(len(LATENCY_BUCKETS))] for t in TIMINGS}
    return histogram, sum(late for _, late in counts.values())


def filled_buckets(counts: list[int]) -> list[tuple[float, float, int]]:
    """A histogram's buckets (low, high, count), from its first filled one to its last; [] if none is."""
    edges = LATENCY_BUCKETS + [float("inf")]
    filled = [i for i, count in enumerate(counts) if count]
    return [(edges[i], edges[i + 1], counts[i]) for i in range(filled[0], filled[-1] + 1)] if filled else []


def quantiles(row) -> dict[str, float | None]:
    """p50, p95, p99 and max of a row of latency stats (None each when there were no latencies)."""
    q = row["q"] if row is not None else None
    if not q or q[0] is None:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    return {"p50": float(q[0]), "p95": float(q[1]), "p99": float(q[2]), "max": float(row["max"])}


def iso(value) -> str | None:
    """A Spark timestamp (naive, UTC) as ISO 8601 text with its offset; None stays None."""
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat(timespec="seconds")
