"""The delivery audit's outputs under ``--out``: ``summary.json``, the Parquet aggregates under
``aggregates/`` (latency by task and by hour, throughput, dead letters, the lost messages) and the
self-contained ``report.html``. Each is written whole, overwriting the last run's.
"""

from __future__ import annotations

import json
from pathlib import Path

from celery_outbox.audit.aggregates import Aggregates, iso, quantiles
from celery_outbox.audit.report import render_report

__all__ = ["write_outputs"]


def write_outputs(out: Path, result: Aggregates) -> None:
    """Write the audit's outputs under ``out``, which exists."""
    aggregates = out / "aggregates"
    for name, frame in (("latency_by_task", _flat(result.by_task)), ("latency_by_hour", _flat(result.by_hour)),
                        ("throughput", result.throughput), ("dead_letters", result.dead_by_task),
                        ("lost", result.lost)):
        frame.write.mode("overwrite").parquet(str(aggregates / name))
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    (out / "report.html").write_text(render_report(
        result.summary, result.histogram,
        [(iso(r.period), int(r.sent), int(r.handled)) for r in result.throughput.collect()],
        [(r.task_name, r.exception or "", int(r["count"])) for r in result.dead_by_task.collect()],
        [{"task_name": r.task_name, "count": r["count"], **quantiles(r)} for r in result.by_task.collect()],
    ))


def _flat(frame):
    """Latency stats with their quantiles (the ``q`` array) as columns ``p50``, ``p95``, ``p99``."""
    from pyspark.sql import functions as F

    return frame.select(*[c for c in frame.columns if c != "q"], F.col("q")[0].alias("p50"),
                        F.col("q")[1].alias("p95"), F.col("q")[2].alias("p99"))
