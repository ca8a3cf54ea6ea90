"""Latency quantiles that add up: a log-bucket sketch (as DDSketch) in Spark columns.

A latency ``x`` goes to bucket ``ceil(log_γ x)`` with ``γ = (1 + α) / (1 − α)``; a bucket's count
is exact and counts add, so the sketch of two sets of messages is the sum of theirs. That is what
lets an incremental audit keep the latencies of settled messages as bucket counts (``ledger``)
and still report p50, p95 and p99 over the whole history. A quantile is read as the value of the
bucket holding its rank, ``2γ^i / (γ + 1)``, capped by the exact maximum: within ``α`` (0.5 %) of
the true latency. Latencies under a microsecond, including negative ones from clocks that
disagree, fall in one bucket read as 0.

Full and incremental audits read their quantiles the same way, so they report the same numbers.
"""

from __future__ import annotations

import math

__all__ = ["QUANTILES", "bucket_of", "quantile_columns"]

ACCURACY = 0.005  #: α, the relative error of a quantile
GAMMA = (1 + ACCURACY) / (1 - ACCURACY)
SMALLEST = 1e-6  #: seconds; at or below: the zero bucket
ZERO_BUCKET = -(2**30)
QUANTILES = (0.5, 0.95, 0.99)


def bucket_of(F, latency):
    """Spark: the sketch bucket (an int) of a latency column in seconds."""
    return F.when(latency <= SMALLEST, F.lit(ZERO_BUCKET)).otherwise(
        F.ceil(F.log(latency) / math.log(GAMMA)).cast("int"))


def quantile_columns(F, counts, keys: list[str]):
    """Spark: from bucket counts (``keys``, ``bucket``, ``count``, ``max``: one row per key and bucket,
    or several, which add), per key the quantiles as a ``q`` array (p50, p95, p99), the ``max`` and
    the ``count``: the shape the outputs write."""
    from pyspark.sql import Window

    counts = counts.groupBy(*keys, "bucket").agg(F.sum("count").alias("count"), F.max("max").alias("max"))
    group = Window.partitionBy(*keys) if keys else Window.partitionBy()
    running = group.orderBy("bucket").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    ranked = counts.select(*keys, "bucket", "max", F.col("count"), F.sum("count").over(running).alias("below"),
                           F.sum("count").over(group).alias("total"), F.max("max").over(group).alias("top"))
    reached = [F.min(F.when(F.col("below") >= F.greatest(F.ceil(F.col("total") * q), F.lit(1)), F.col("bucket")))
               for q in QUANTILES]
    stats = ranked.groupBy(*keys).agg(*[r.alias(f"b{i}") for i, r in enumerate(reached)],
                                      F.first("top").alias("max"), F.sum("count").alias("count"))
    values = [F.when(F.col(f"b{i}") == ZERO_BUCKET, F.lit(0.0)).otherwise(F.least(
        F.pow(F.lit(GAMMA), F.col(f"b{i}")) * (2 / (GAMMA + 1)), F.col("max"))) for i in range(len(QUANTILES))]
    return stats.select(*keys, F.array(*values).alias("q"), F.col("max").cast("double").alias("max"),
                        F.col("count").cast("long").alias("count"))
