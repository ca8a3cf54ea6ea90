"""The audit's ledger in ``--out``: what past runs covered, so the next run reads only new files.

Transaction boundary: a run writes its ledger into a folder of its own, then replaces
``ledger/current.json``, one small file; the replaced folder, and any a failed run left, are
deleted after the run's outputs are written. Guarantee: a run that fails before ``current.json``
is replaced leaves the last ledger in force, so no archive file is skipped that was not counted;
the figures equal a full run's, but for a row archived again more than ``--horizon`` after its
message's newest row. Layout, settling and basis: docs/audit.md (Incremental runs).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import reduce
from typing import Any

from celery_outbox.audit.aggregates import FINAL_STATUSES, Aggregates, Tally, tally
from celery_outbox.audit.hadoop import children, delete, read_text, write_text
from celery_outbox.audit.inputs import Inputs, kept_schema
from celery_outbox.audit.location import Location
from celery_outbox.audit.options import AuditOptions
from celery_outbox.audit.sketch import ACCURACY
from celery_outbox.vocabulary import ArchiveKind

__all__ = ["Ledger", "drop_replaced", "read_ledger", "record_ledger"]

FORMAT = 2  # 2: the latency sketch and histogram kept per timing (immediate, scheduled)
FOLDER = "ledger"
_SETTLED_SCHEMAS = {
    "latency": "task_name string, timing string, hour timestamp, bucket int, count long, max double",
    "throughput": "period timestamp, sent long, handled long",
    "dead_letters": "task_name string, exception string, count long",
}


@dataclass
class Ledger:
    """The ledger in force: its ``folder``, the archive ``files`` covered (paths inside the
    archive), the ``watermark`` (naive UTC, or None) and the ``settled`` messages' tally."""

    folder: Location
    files: set[str]
    watermark: datetime | None
    settled: Tally

    def frame(self, spark, kind: ArchiveKind):
        """The carried, de-duplicated rows of ``kind``."""
        return spark.read.schema(kept_schema(kind)).parquet(self.folder.child("carried", kind).uri)


def basis_of(options: AuditOptions) -> dict[str, Any]:
    """What a ledger's figures depend on: a ledger of another basis is not used."""
    return {"format": FORMAT, "archive": Location.of(options.archive).uri if options.archive else None,
            "late_after_seconds": options.late_after_seconds, "horizon_seconds": options.horizon_seconds,
            "sketch_accuracy": ACCURACY}


def read_ledger(spark, out: Location, options: AuditOptions) -> tuple[Ledger | None, str]:
    """The ledger in force under ``out`` and "" — or None and why this run is a full one."""
    if options.full:
        return None, "--full"
    folder = _in_force(spark, out)
    if folder is None:
        return None, "no ledger yet"
    record = json.loads(read_text(spark, folder.child("ledger.json").uri) or "null")
    if record is None:
        return None, f"the ledger's folder {folder} is gone"
    basis = basis_of(options)
    changed = [key for key in basis if record["basis"].get(key) != basis[key]]
    if changed:
        key = changed[0]
        return None, f"the ledger was made with {key} {record['basis'].get(key)!r}, this run has {basis[key]!r}"
    settled = record["settled"]
    frames = {name: spark.read.schema(schema).parquet(folder.child("settled", name).uri)
              for name, schema in _SETTLED_SCHEMAS.items()}
    tallied = Tally(settled["counts"], (_moment(settled["window"][0]), _moment(settled["window"][1])),
                    settled["histogram"], frames["latency"], frames["throughput"], frames["dead_letters"])
    return Ledger(folder, set(record["files"]), _moment(record["watermark"]), tallied), ""


def _in_force(spark, out: Location) -> Location | None:
    """The folder of the ledger in force under ``out``, if any."""
    pointer = read_text(spark, out.child(FOLDER, "current.json").uri)
    return out.child(FOLDER, json.loads(pointer)["run"]) if pointer else None


def record_ledger(spark, out: Location, options: AuditOptions, inputs: Inputs, result: Aggregates,
                  previous: Ledger | None, cached: list[Any]) -> dict[str, Any]:
    """Settle what can be settled, write the new ledger and put it in force; what it says (the
    summary's ``ledger`` entry). The folder it replaces stays until ``drop_replaced``: the run's
    cached frames may still read from it.

    The settled tally is every message's (``result.total``) less the carried messages': the
    carried are the fewer, so that costs a tally of them, not of all that settle. With the live
    tables read, ``result.total`` holds their rows too, and the archive's own part is tallied."""
    F = inputs.F
    archived = inputs.archived
    newest = max((m for m in (*_newest(F, archived), previous.watermark if previous else None) if m), default=None)
    # never past the run's own clock: one row stamped ahead (a node's clock running fast) would
    # otherwise carry the watermark, kept across runs, into the future and settle at once every
    # message: their rows archived again later (cleanup archives at least once) would count twice
    ceiling = options.now.astimezone(timezone.utc).replace(tzinfo=None)
    watermark = None if newest is None else min(newest, ceiling)
    carried_per = _carried(F, archived, watermark, options.horizon_seconds, inputs.live_ids).cache()
    cached.append(carried_per)
    carried = {kind: carried_per.select(F.explode(kind.value).alias("row")).select("row.*") for kind in ArchiveKind}
    unit = result.unit
    everything = result.total
    if inputs.live:
        everything = tally(archived, options, unit, cached)
        if previous is not None:
            everything = previous.settled.plus(everything, unit)
    settled = everything.minus(tally(carried, options, unit, cached), unit)

    folder = out.child(FOLDER, f"run-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}")
    for kind, frame in carried.items():
        frame.write.mode("overwrite").parquet(folder.child("carried", kind).uri)
    for name, frame in (("latency", settled.latency), ("throughput", settled.throughput),
                        ("dead_letters", settled.dead_letters)):
        frame.coalesce(1).write.mode("overwrite").parquet(folder.child("settled", name).uri)
    record = {
        "basis": basis_of(options), "watermark": _text(watermark), "files": inputs.files_covered,
        "settled": {"counts": settled.counts, "window": [_text(settled.window[0]), _text(settled.window[1])],
                    "histogram": settled.histogram},
    }
    write_text(spark, folder.child("ledger.json").uri, json.dumps(record) + "\n")
    write_text(spark, out.child(FOLDER, "current.json").uri, json.dumps({"run": folder.text.rsplit("/", 1)[1]}))
    return {
        "watermark": _text(watermark), "files_read": inputs.files_read,
        "files_covered_before": len(previous.files) if previous is not None else 0,
        "messages_carried": carried_per.count(), "sends_settled": settled.counts["sent"],
        "sends_settled_before": previous.settled.counts["sent"] if previous is not None else 0,
    }


def _newest(F, archived: dict) -> list[datetime | None]:
    """The newest moment of each kind of archived row (naive UTC), in one Spark job: the three
    one-row aggregates side by side."""
    moments = _moments(F)
    newest = reduce(lambda a, b: a.crossJoin(b), [archived[kind].agg(F.max(moments[kind]).alias(kind.value))
                                                 for kind in ArchiveKind]).first()
    return [newest[kind.value] for kind in ArchiveKind]


def _moments(F) -> dict:
    """The moment of a row of each kind: when it was sent, when its attempt ended (or began), when it
    failed."""
    return {ArchiveKind.SENT: F.col("sent_at"), ArchiveKind.INCOMING: F.coalesce("handled_at", "received_at"),
            ArchiveKind.DEAD_LETTERS: F.col("failed_at")}


def _carried(F, archived: dict, watermark: datetime | None, horizon_seconds: float, live_ids):
    """One row per archived message that can still change, with its rows of each kind (arrays named
    after the kinds), found in one pass over the rows: a row within the horizon of the watermark
    (or with no moment at all), an attempt not ended, a send not ended (no dead letter, no final
    inbox row keyed by id alone or by its destination: the rule ``open_sends`` applies), or a
    message the live tables hold (``live_ids``, None when they were not read)."""
    moments = _moments(F)
    rows = None
    for kind in ArchiveKind:
        frame = archived[kind]
        status = F.col("status") if kind is ArchiveKind.INCOMING else F.lit(None).cast("string")
        payloads = [(F.struct(*frame.columns) if other is kind else F.lit(None).cast(archived[other].schema))
                    .alias(other.value) for other in ArchiveKind]
        projected = frame.select("message_id", "destination", moments[kind].alias("moment"),
                                 F.lit(kind.value).alias("kind"), status.alias("status"), *payloads)
        rows = projected if rows is None else rows.unionByName(projected)
    final = F.col("status").isin(*FINAL_STATUSES)
    per = rows.groupBy("message_id").agg(
        F.max("moment").alias("moment"), (F.count("moment") < F.count(F.lit(1))).alias("undated"),
        F.collect_set(F.when(F.col("kind") == ArchiveKind.SENT.value, F.col("destination"))).alias("sent_to"),
        F.collect_set(F.when((F.col("kind") == ArchiveKind.INCOMING.value) & final, F.col("destination")))
        .alias("ended_at"),
        F.max((F.col("kind") == ArchiveKind.INCOMING.value) & ~final).alias("running"),
        F.max(F.col("kind") == ArchiveKind.DEAD_LETTERS.value).alias("lettered"),
        *[F.collect_list(kind.value).alias(kind.value) for kind in ArchiveKind])
    open_send = ((F.size("sent_to") > 0) & ~F.col("lettered") & ~F.array_contains("ended_at", "")
                 & (F.size(F.array_except("sent_to", "ended_at")) > 0))
    changing = F.col("undated") | F.col("running") | open_send
    if watermark is not None:
        changing = changing | (F.col("moment") >= F.lit(watermark - timedelta(seconds=horizon_seconds)))
    if live_ids is not None:
        per = per.join(live_ids.withColumn("live", F.lit(True)), "message_id", "left")
        changing = changing | F.col("live").isNotNull()
    return per.where(changing).select("message_id", *(kind.value for kind in ArchiveKind))


def drop_replaced(spark, out: Location) -> None:
    """Delete every ledger folder but the one in force: the one a run replaced (once its outputs are
    written) and any a failed run left."""
    in_force = _in_force(spark, out)
    for name in children(spark, out.child(FOLDER).uri):
        if name.startswith("run-") and (in_force is None or out.child(FOLDER, name) != in_force):
            delete(spark, out.child(FOLDER, name).uri)


def _text(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _moment(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None

