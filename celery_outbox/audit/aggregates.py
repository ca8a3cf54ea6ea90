"""The delivery audit's numbers, computed with Spark from its de-duplicated inputs.

Lost messages: sent longer than the grace period ago, never handled, dead-lettered nor revoked,
and not still held by the live tables. Also the duplicates discarded, late deliveries, stuck rows
(live tables only), the latency from sent to handled (p50, p95, p99, max; per task and per hour,
and as a histogram), throughput over time (per second, minute or hour, by the window's length) and
dead letters by task and exception, and what the inputs held and cover (``inputs``). A sent
message and its inbox rows are matched by id, and by destination too when the inbox keyed by id and
queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta, timezone
from enum import Enum
from functools import reduce
from typing import Any

from celery_outbox.audit.inputs import Inputs, jdbc_url_of
from celery_outbox.audit.options import AuditOptions
from celery_outbox.vocabulary import IncomingStatus

__all__ = ["LATENCY_BUCKETS", "Aggregates", "Tracking", "aggregate", "iso", "quantiles"]

LATENCY_BUCKETS = [0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                   3600.0, 86400.0]

#: an attempt the message will not go past: handled, failed for good, or revoked unrun (a retried
#: attempt is followed by another)
_FINAL_STATUSES = (IncomingStatus.HANDLED.value, IncomingStatus.DEAD.value, IncomingStatus.REVOKED.value)


class Tracking(str, Enum):
    """How far the inputs follow a kind of message (the summary's ``inputs.coverage``)."""

    END_TO_END = "end_to_end"  #: each send is recorded: lost, late and latency are checked
    INBOX_ONLY = "inbox_only"  #: inbox rows alone: handled, duplicates and dead letters count; a loss cannot show


@dataclass
class Aggregates:
    """What the audit computed: the summary (plain data, ``summary.json``), the latency histogram,
    and the DataFrames the outputs write (latency per task and per hour with their quantiles in
    a ``q`` array, throughput per period, dead letters by task and exception, the lost messages)."""

    summary: dict[str, Any]
    histogram: list[tuple[float, float, int]]
    by_task: Any
    by_hour: Any
    throughput: Any
    dead_by_task: Any
    lost: Any


def aggregate(inputs: Inputs, options: AuditOptions, cached: list[Any], ran_on: dict[str, Any]) -> Aggregates:
    """Compute the audit from ``inputs``. The lost messages and the latencies are cached (each is
    read by several aggregates) and appended to ``cached`` for the caller to unpersist, with the
    live tables the inputs keep; ``ran_on`` is the summary's ``spark`` entry."""
    F = inputs.F
    now = options.now.astimezone(timezone.utc).replace(tzinfo=None)  # Spark timestamps are UTC, session tz UTC

    cached.extend(inputs.cached)
    ended = inputs.incoming.where(F.col("status").isin(*_FINAL_STATUSES))
    lost = _without(_without(inputs.sent, ended), inputs.dead.select("message_id", "destination"), by_id_only=True)
    lost = lost.where(F.col("sent_at") < F.lit(now - timedelta(seconds=options.grace_seconds)))
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

    handled = inputs.incoming.where(F.col("status") == IncomingStatus.HANDLED.value)
    latency = _matched(handled, inputs.sent).withColumn(
        "latency", F.col("handled_at").cast("double") - F.col("sent_at").cast("double"))
    latency = latency.where(F.col("latency").isNotNull()).cache()
    cached.append(latency)
    percentiles = F.percentile_approx("latency", [0.5, 0.95, 0.99], 10000)
    stats = [percentiles.alias("q"), F.max("latency").alias("max"), F.count(F.lit(1)).alias("count")]
    overall = latency.agg(*stats).first()
    by_task = latency.groupBy("task_name").agg(*stats).orderBy("task_name")
    by_hour = latency.groupBy(F.date_trunc("hour", "sent_at").alias("hour")).agg(*stats).orderBy("hour")
    histogram = _histogram(latency, F)
    window = inputs.sent.agg(F.min("sent_at"), F.max("sent_at")).first()
    unit = _throughput_unit(window[0], window[1])
    throughput = (inputs.sent.groupBy(F.date_trunc(unit, "sent_at").alias("period")).agg(F.count(F.lit(1))
                                                                                          .alias("sent"))
                  .join(handled.groupBy(F.date_trunc(unit, "handled_at").alias("period"))
                        .agg(F.count(F.lit(1)).alias("handled")), "period", "full_outer")
                  .na.fill(0).orderBy("period"))
    dead_by_task = (inputs.dead.groupBy("task_name", F.coalesce("exception_type", "reason").alias("exception"))
                    .count().orderBy(F.desc("count"), "task_name"))

    lost_rows = lost.orderBy("sent_at").limit(20).collect()
    sent_count = inputs.sent.count()
    summary = {
        "generated_at": options.now.isoformat(timespec="seconds"),
        "window_start": iso(window[0]), "window_end": iso(window[1]),
        "sent": sent_count,
        "handled": handled.count(),
        "lost": lost.count(),
        "duplicates_discarded": int(inputs.incoming.agg(F.coalesce(F.sum("duplicates"), F.lit(0))).first()[0]),
        "dead_lettered": inputs.dead.count(),
        "late": latency.where(F.col("latency") > options.late_after_seconds).count(),
        "late_threshold_seconds": options.late_after_seconds,
        "stuck": stuck,
        "latency_seconds": quantiles(overall),
        "throughput_unit": unit,
        "lost_examples": [{"message_id": r.message_id, "task_name": r.task_name, "destination": r.destination,
                           "sent_at": iso(r.sent_at)} for r in lost_rows],
        "inputs": _inputs_summary(inputs, options, pending, sent_count),
        "spark": ran_on,
    }
    return Aggregates(summary, histogram, by_task, by_hour, throughput, dead_by_task, lost)


def _inputs_summary(inputs: Inputs, options: AuditOptions, pending: dict[str, int] | None, sent: int) -> dict[str, Any]:
    """The summary's ``inputs``: the archive and the live tables read, with their rows (before
    de-duplication) and the live rows still holding a message, and what they cover. Durable
    queues are followed end to end when sends were recorded (an archive configured, or sent rows
    the outgoing table still holds); a plain queue's messages leave no send record, only inbox
    rows: messages with inbox rows and no send record are counted as ``plain_queues`` messages (a
    durable queue's too, when its sends were not recorded)."""
    inbox_only = inputs.incoming.join(inputs.sent.select("message_id").distinct(), "message_id", "left_anti")
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
            "plain_queues": {"tracked": Tracking.INBOX_ONLY.value, "messages": inbox_only.count()},
        },
    }


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


def _histogram(latency, F) -> list[tuple[float, float, int]]:
    """(low, high, count) of each latency bucket from the first to the last that holds a latency,
    the empty ones between them included: the plot's axis steps bucket by bucket."""
    bucket = reduce(lambda expr, i: expr.when(F.col("latency") < LATENCY_BUCKETS[i + 1], i),
                    range(len(LATENCY_BUCKETS) - 1), F).otherwise(len(LATENCY_BUCKETS) - 1)
    counts = dict(latency.groupBy(bucket.alias("bucket")).count().collect())
    edges = LATENCY_BUCKETS + [float("inf")]
    return [(edges[i], edges[i + 1], int(counts.get(i, 0))) for i in range(min(counts), max(counts) + 1)] \
        if counts else []


def quantiles(row) -> dict[str, float | None]:
    """p50, p95, p99 and max of a row of latency stats (None each when there were no latencies)."""
    q = row["q"] if row is not None else None
    if not q:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    return {"p50": float(q[0]), "p95": float(q[1]), "p99": float(q[2]), "max": float(row["max"])}


def iso(value) -> str | None:
    """A Spark timestamp (naive, UTC) as ISO 8601 text with its offset; None stays None."""
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat(timespec="seconds")
