"""The delivery audit's outputs under ``--out``: ``summary.json``, the aggregates, ``report.html``.

Transaction boundary: none; each output is written whole, overwriting the last run's, through
Spark's Hadoop filesystem layer, so ``--out`` may be any location Spark can write (``Location``).
The Parquet aggregates under ``aggregates/``: latency by task and by hour (each per timing,
immediate or scheduled), throughput, dead letters and the lost messages.
"""

from __future__ import annotations

import json

from celery_outbox.audit.aggregates import Aggregates, iso, quantiles
from celery_outbox.audit.hadoop import write_text
from celery_outbox.audit.location import Location
from celery_outbox.audit.report import render_report

__all__ = ["write_outputs"]


def write_outputs(spark, out: Location, result: Aggregates) -> None:
    """Write the audit's outputs under ``out``."""
    for name, frame in (("latency_by_task", _flat(result.by_task)), ("latency_by_hour", _flat(result.by_hour)),
                        ("throughput", result.throughput), ("dead_letters", result.dead_by_task),
                        ("lost", result.lost)):
        frame.write.mode("overwrite").parquet(out.child("aggregates", name).uri)
    write_text(spark, out.child("summary.json").uri, json.dumps(result.summary, indent=2) + "\n")
    write_text(spark, out.child("report.html").uri, render_report(
        result.summary, result.histogram,
        [(iso(r.period), int(r.sent), int(r.handled)) for r in result.throughput.collect()],
        [(r.task_name, r.exception or "", int(r["count"])) for r in result.dead_by_task.collect()],
        [{"task_name": r.task_name, "timing": r.timing, "count": r["count"], **quantiles(r)}
         for r in result.by_task.collect()],
    ))


def _flat(frame):
    """Latency stats with their quantiles (the ``q`` array) as columns ``p50``, ``p95``, ``p99``."""
    from pyspark.sql import functions as F

    return frame.select(*[c for c in frame.columns if c != "q"], F.col("q")[0].alias("p50"),
                        F.col("q")[1].alias("p95"), F.col("q")[2].alias("p99"))
