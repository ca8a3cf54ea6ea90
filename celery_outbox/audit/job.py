"""The delivery audit, a Spark job: did every durable message arrive, once, and how late?

Run it with ``celery -A proj outbox audit --archive PATH --out DIR`` or on a cluster with
``spark-submit --master ... celery_outbox/audit/job.py --archive s3a://... --out ...``
(no local settings are hard-coded: the master comes from spark-submit, or ``--master``).

Inputs: the Parquet archive cleanup writes (``celery_outbox.audit.archive``) and,
optionally, the live tables over JDBC (``--jdbc-url``, with the PostgreSQL driver jar
given by ``--jdbc-jar``) for what is not archived yet. Archived rows may repeat
(archiving is at least once): every input is de-duplicated by its key.

It computes lost messages (sent longer than the grace period ago, never handled,
dead-lettered nor revoked, and not still held by the live tables), duplicates discarded, late
deliveries, stuck rows (live tables only), latency from sent to handled (p50, p95,
p99, max; per task and per hour), throughput over time (per second, minute or hour,
by the window's length) and dead letters by task
and exception. It writes ``summary.json``, Parquet aggregates under ``aggregates/``
and ``report.html``. Exit code: 0 clean, 1 when any message is lost, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import reduce
from pathlib import Path
from typing import Any

from celery_outbox.audit.archive import _COLUMNS, ARCHIVE_KINDS, archive_schema, filesystem
from celery_outbox.audit.report import render_report
from celery_outbox.store.engine import is_secret_name, safe_url
from celery_outbox.vocabulary import IncomingStatus

__all__ = ["AuditInputError", "AuditOptions", "main", "run_audit"]

EXIT_CLEAN, EXIT_LOST, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"  # Debian's libpostgresql-jdbc-java
LATENCY_BUCKETS = [0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                   3600.0, 86400.0]


class AuditInputError(Exception):
    """The audit's input is missing or unreadable; the message says what and where."""


@dataclass
class AuditOptions:
    out: str
    archive: str | None = None
    jdbc_url: str | None = None
    jdbc_jar: str | None = None
    table_prefix: str = "celery_outbox_"
    grace_seconds: float = 3600.0
    late_after_seconds: float = 60.0
    stuck_after_seconds: float = 3600.0
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    master: str | None = None
    # The driver JVM's heap (Spark's size syntax: 512m, 6g). Local mode runs everything in the
    # driver; Spark's default is 1g. Only when this job starts Spark: under spark-submit give
    # spark-submit's own --driver-memory.
    driver_memory: str | None = None
    # Partitions of each shuffle. None: the session's own setting, unless that is Spark's default
    # of 200, which is far too many for one machine; then 4 per core Spark has.
    shuffle_partitions: int | None = None

    def __post_init__(self) -> None:
        if self.driver_memory is not None and not _SIZE.fullmatch(self.driver_memory):
            raise AuditInputError(f"driver memory must be a size such as 4g or 512m, not {self.driver_memory!r}")
        if self.shuffle_partitions is not None and self.shuffle_partitions < 1:
            raise AuditInputError(f"shuffle partitions must be at least 1, not {self.shuffle_partitions}")


_SIZE = re.compile(r"[1-9][0-9]*[kmgt]?", re.IGNORECASE)
SPARK_DEFAULT_SHUFFLE_PARTITIONS = 200
PARTITIONS_PER_CORE = 4


# -- input -------------------------------------------------------------------------------------------


def check_archive(path: str) -> dict[str, list[str]]:
    """The Parquet files of each kind under ``path``; a clear error for a missing archive or a bad file."""
    import pyarrow.fs
    import pyarrow.parquet as pq

    fs, root = filesystem(path)
    if fs.get_file_info(root).type == pyarrow.fs.FileType.NotFound:
        raise AuditInputError(f"no archive at {path}: set outbox_archive_path and let cleanup run, "
                              "or give the path cleanup writes to")
    files: dict[str, list[str]] = {}
    for kind in ARCHIVE_KINDS:
        selector = pyarrow.fs.FileSelector(f"{root}/{kind}", allow_not_found=True, recursive=True)
        found = sorted(info.path for info in fs.get_file_info(selector) if info.path.endswith(".parquet"))
        expected = archive_schema(kind)
        for file_path in found:
            try:
                schema = pq.read_schema(file_path, filesystem=fs)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
                raise AuditInputError(f"archive file {file_path} is not readable Parquet: {exc}") from None
            for column in expected:
                if column.name not in schema.names:
                    raise AuditInputError(f"archive file {file_path} has a bad schema: no column {column.name!r} "
                                          f"(a {kind} file needs {', '.join(expected.names)})")
                actual = schema.field(column.name).type
                if actual != column.type and not (str(actual).startswith("timestamp")
                                                   and str(column.type).startswith("timestamp")):
                    raise AuditInputError(f"archive file {file_path} has a bad schema: column {column.name!r} is "
                                          f"{actual}, expected {column.type}")
        files[kind] = found
    return files


# libpq connection parameters and the PostgreSQL JDBC driver's property for each
_JDBC_PROPERTIES = {"user": "user", "password": "password", "sslmode": "sslmode", "sslrootcert": "sslrootcert",
                    "sslcert": "sslcert", "sslkey": "sslkey", "sslpassword": "sslpassword",
                    "application_name": "ApplicationName", "connect_timeout": "connectTimeout",
                    "options": "options"}


def jdbc_url_of(url: str) -> tuple[str, dict[str, str]]:
    """A JDBC URL and connection properties from a JDBC URL or an SQLAlchemy PostgreSQL URL.

    The SQLAlchemy URL's user, password and query parameters (TLS: ``sslmode``, ``sslrootcert``,
    ``sslcert``, ``sslkey``, ``sslpassword``...) become properties, so the JDBC URL holds no secret;
    a parameter JDBC cannot carry is refused, never dropped (a dropped ``sslmode`` would connect
    without TLS)."""
    properties = {"driver": "org.postgresql.Driver"}
    if url.startswith("jdbc:"):
        return url, properties
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise AuditInputError(f"--jdbc-url {safe_url(url)} is not a database URL ({type(exc).__name__})") from None
    if parsed.get_backend_name() != "postgresql":
        raise AuditInputError(f"--jdbc-url must name PostgreSQL, not {parsed.get_backend_name()!r}")
    unsupported = sorted(name for name in parsed.query if name not in _JDBC_PROPERTIES)
    repeated = sorted(name for name, value in parsed.query.items() if not isinstance(value, str))
    if unsupported or repeated:
        raise AuditInputError(
            f"--jdbc-url {safe_url(parsed)}: the connection parameter(s) {', '.join(unsupported + repeated)} "
            "cannot be carried into a JDBC URL; give a jdbc:postgresql:// URL with the equivalent driver "
            "properties instead")
    if parsed.username:
        properties["user"] = parsed.username
    if parsed.password:
        properties["password"] = str(parsed.password)
    for name, value in parsed.query.items():
        properties[_JDBC_PROPERTIES[name]] = value
    return f"jdbc:postgresql://{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database}", properties


def spark_session(options: AuditOptions):
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("celery-outbox-audit")
    if options.master:
        builder = builder.master(options.master)
    jar = options.jdbc_jar or (DEFAULT_JDBC_JAR if options.jdbc_url and os.path.exists(DEFAULT_JDBC_JAR) else None)
    if options.jdbc_url and not jar:
        raise AuditInputError("--jdbc-url needs the PostgreSQL JDBC driver: give its jar with --jdbc-jar "
                              "(Debian: apt install libpostgresql-jdbc-java)")
    if jar:
        if not os.path.exists(jar):
            raise AuditInputError(f"no JDBC driver jar at {jar}")
        builder = builder.config("spark.jars", jar).config("spark.driver.extraClassPath", jar)
    if options.driver_memory:
        builder = builder.config("spark.driver.memory", options.driver_memory)
    session = (builder.config("spark.sql.session.timeZone", "UTC").config("spark.ui.enabled", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def _spark_schema(kind: str):
    from pyspark.sql import types as T

    types = {"string": T.StringType(), "int32": T.IntegerType(), "int64": T.LongType(),
             "timestamp": T.TimestampType()}
    return T.StructType([T.StructField(name, types[type_name]) for name, type_name in _COLUMNS[kind].items()])


class Inputs:
    """The audit's DataFrames: archive and live rows of each kind, de-duplicated."""

    def __init__(self, spark, options: AuditOptions):
        from pyspark.sql import functions as F

        self.spark, self.options, self.F = spark, options, F
        files = check_archive(options.archive) if options.archive else {kind: [] for kind in ARCHIVE_KINDS}
        self.live = options.jdbc_url is not None
        if not self.live and not any(files.values()):
            raise AuditInputError(f"the archive at {options.archive} is empty: no incoming, sent or dead_letters "
                                  "files yet (cleanup archives rows once their keep-until passes); "
                                  "add --jdbc-url to audit the live tables")
        frames = {kind: self._archived(kind, files[kind]) for kind in ARCHIVE_KINDS}
        self.outgoing = None
        if self.live:
            frames = {kind: frames[kind].unionByName(self._table(kind)) for kind in ARCHIVE_KINDS}
            self.outgoing = self._read(f"{options.table_prefix}outgoing", ["message_id", "destination", "created_at",
                                                                           "sent_at"])
        self.incoming = (frames["incoming"].groupBy("message_id", "destination").agg(
            F.max_by("status", "handled_at").alias("status"), F.max("handled_at").alias("handled_at"),
            F.min("received_at").alias("received_at"), F.first("task_name").alias("task_name"),
            F.max("duplicates").alias("duplicates"), F.max("recoveries").alias("recoveries")))
        self.sent = frames["sent"].groupBy("message_id", "destination").agg(
            F.min("sent_at").alias("sent_at"), F.first("task_name").alias("task_name"))
        self.dead = frames["dead_letters"].dropDuplicates(["id"])

    def _archived(self, kind: str, paths: list[str]):
        schema = _spark_schema(kind)
        if not paths:
            return self.spark.createDataFrame([], schema)
        archive = self.options.archive.rstrip("/")
        frame = self.spark.read.schema(schema).option("basePath", f"{archive}/{kind}").parquet(f"{archive}/{kind}")
        return frame.select(*schema.names)

    def _table(self, kind: str):
        name = {"incoming": "incoming", "dead_letters": "dead_letters", "sent": "sent"}[kind]
        frame = self._read(f"{self.options.table_prefix}{name}", list(_COLUMNS[kind]))
        return frame.select(*[self.F.col(f.name).cast(f.dataType) for f in _spark_schema(kind)])

    def _read(self, table: str, columns: list[str]):
        url, properties = jdbc_url_of(self.options.jdbc_url)
        try:
            frame = self.spark.read.jdbc(url, table, properties=properties)
            return frame.select(*columns)
        except Exception as exc:  # noqa: BLE001 - Spark wraps the driver's error; its first line says it
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            reason = reason.split("on the operation: ")[-1].split(" SQLSTATE")[0]
            for secret in (value for name, value in properties.items() if is_secret_name(name) and value):
                reason = reason.replace(secret, "***")
            raise AuditInputError(f"cannot read the live table {table} at {url.split('?')[0]}: {reason[:300]}") \
                from None


# -- computation -------------------------------------------------------------------------------------


def run_audit(options: AuditOptions, spark=None) -> dict[str, Any]:
    """Compute the audit, write its outputs under ``options.out`` and return the summary.

    The de-duplicated inputs and the lost messages are cached: every aggregate reads them, and
    without the cache each would read and shuffle the whole archive again. A session passed in
    gets its shuffle partitions back afterwards.
    """
    spark = spark or spark_session(options)
    saved_partitions = spark.conf.get("spark.sql.shuffle.partitions")
    cached: list[Any] = []
    try:
        return _audit(spark, options, cached)
    finally:
        for frame in cached:
            frame.unpersist()
        spark.conf.set("spark.sql.shuffle.partitions", saved_partitions)


def shuffle_partitions(spark, options: AuditOptions) -> int:
    """The shuffle partitions the audit uses (see ``AuditOptions.shuffle_partitions``)."""
    if options.shuffle_partitions is not None:
        return options.shuffle_partitions
    configured = int(spark.conf.get("spark.sql.shuffle.partitions"))
    if configured != SPARK_DEFAULT_SHUFFLE_PARTITIONS:
        return configured
    return PARTITIONS_PER_CORE * spark.sparkContext.defaultParallelism


#: an attempt the message will not go past: handled, failed for good, or revoked unrun (a retried
#: attempt is followed by another)
_FINAL_STATUSES = (IncomingStatus.HANDLED.value, IncomingStatus.DEAD.value, IncomingStatus.REVOKED.value)


def _audit(spark, options: AuditOptions, cached: list[Any]) -> dict[str, Any]:
    partitions = shuffle_partitions(spark, options)
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    inputs = Inputs(spark, options)
    F = inputs.F
    for frame in (inputs.incoming, inputs.sent, inputs.dead):
        cached.append(frame.cache())
    now = options.now.astimezone(timezone.utc).replace(tzinfo=None)  # Spark timestamps are UTC, session tz UTC
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)

    ended = inputs.incoming.where(F.col("status").isin(*_FINAL_STATUSES))
    lost = _without(_without(inputs.sent, ended), inputs.dead.select("message_id", "destination"), by_id_only=True)
    lost = lost.where(F.col("sent_at") < F.lit(now - timedelta(seconds=options.grace_seconds)))
    stuck = None
    if inputs.live:
        held = inputs.outgoing.select("message_id").unionByName(
            inputs.incoming.where(F.col("status") == IncomingStatus.RUNNING.value).select("message_id"))
        lost = lost.join(held, "message_id", "left_anti")
    lost = lost.cache()  # its examples, its count and its aggregate
    cached.append(lost)
    if inputs.live:
        stuck_before = F.lit(now - timedelta(seconds=options.stuck_after_seconds))
        stuck = (inputs.outgoing.where(F.col("sent_at").isNull() & (F.col("created_at") < stuck_before)).count()
                 + inputs.incoming.where((F.col("status") == IncomingStatus.RUNNING.value)
                                         & (F.col("received_at") < stuck_before)).count())

    handled = inputs.incoming.where(F.col("status") == IncomingStatus.HANDLED.value)
    latency = _matched(handled, inputs.sent).withColumn(
        "latency", F.col("handled_at").cast("double") - F.col("sent_at").cast("double"))
    latency = latency.where(F.col("latency").isNotNull()).cache()
    cached.append(latency)
    quantiles = F.percentile_approx("latency", [0.5, 0.95, 0.99], 10000)
    stats = [quantiles.alias("q"), F.max("latency").alias("max"), F.count(F.lit(1)).alias("count")]
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
    summary = {
        "generated_at": options.now.isoformat(timespec="seconds"),
        "window_start": _iso(window[0]), "window_end": _iso(window[1]),
        "sent": inputs.sent.count(),
        "handled": handled.count(),
        "lost": lost.count(),
        "duplicates_discarded": int(inputs.incoming.agg(F.coalesce(F.sum("duplicates"), F.lit(0))).first()[0]),
        "dead_lettered": inputs.dead.count(),
        "late": latency.where(F.col("latency") > options.late_after_seconds).count(),
        "late_threshold_seconds": options.late_after_seconds,
        "stuck": stuck,
        "latency_seconds": _quantiles(overall),
        "throughput_unit": unit,
        "lost_examples": [{"message_id": r.message_id, "task_name": r.task_name, "destination": r.destination,
                           "sent_at": _iso(r.sent_at)} for r in lost_rows],
        "spark": _spark_facts(spark, partitions),
    }
    aggregates = out / "aggregates"
    for name, frame in (("latency_by_task", _flat(by_task, F)), ("latency_by_hour", _flat(by_hour, F)),
                        ("throughput", throughput), ("dead_letters", dead_by_task), ("lost", lost)):
        frame.write.mode("overwrite").parquet(str(aggregates / name))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.html").write_text(render_report(
        summary, histogram,
        [(_iso(r.period), int(r.sent), int(r.handled)) for r in throughput.collect()],
        [(r.task_name, r.exception or "", int(r["count"])) for r in dead_by_task.collect()],
        [{"task_name": r.task_name, "count": r["count"], **_quantiles(r)} for r in by_task.collect()],
    ))
    return summary


def _spark_facts(spark, partitions: int) -> dict[str, Any]:
    """Where the audit ran: the master, the shuffle partitions, and the driver's heap (the JVM's
    own maximum, whatever set it)."""
    heap = spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory()
    return {"master": spark.sparkContext.master, "shuffle_partitions": partitions,
            "driver_max_heap_mib": int(heap) // 2**20}


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
    bucket = reduce(lambda expr, i: expr.when(F.col("latency") < LATENCY_BUCKETS[i + 1], i),
                    range(len(LATENCY_BUCKETS) - 1), F).otherwise(len(LATENCY_BUCKETS) - 1)
    counts = dict(latency.groupBy(bucket.alias("bucket")).count().collect())
    edges = LATENCY_BUCKETS + [float("inf")]
    return [(edges[i], edges[i + 1], int(counts[i])) for i in sorted(counts)]


def _quantiles(row) -> dict[str, float | None]:
    q = row["q"] if row is not None else None
    if not q:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    return {"p50": float(q[0]), "p95": float(q[1]), "p99": float(q[2]), "max": float(row["max"])}


def _flat(frame, F):
    return frame.select(*[c for c in frame.columns if c != "q"], F.col("q")[0].alias("p50"),
                        F.col("q")[1].alias("p95"), F.col("q")[2].alias("p99"))


def _iso(value) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat(timespec="seconds")


# -- command line ------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="celery-outbox-audit", description="The delivery audit of celery-outbox.")
    p.add_argument("--archive", help="the archive cleanup writes (outbox_archive_path)")
    p.add_argument("--out", required=True, help="directory for summary.json, report.html, aggregates/")
    p.add_argument("--jdbc-url", help="also read the live tables: a jdbc:postgresql:// or postgresql:// URL")
    p.add_argument("--jdbc-jar", help=f"the PostgreSQL JDBC driver jar (default {DEFAULT_JDBC_JAR} if present)")
    p.add_argument("--table-prefix", default="celery_outbox_", help="outbox_table_prefix of the live tables")
    p.add_argument("--grace", type=float, default=3600.0, help="seconds before an unhandled sent message is lost")
    p.add_argument("--late-after", type=float, default=60.0, help="seconds from sent to handled counted as late")
    p.add_argument("--stuck-after", type=float, default=3600.0, help="seconds a live row may wait before stuck")
    p.add_argument("--master", help="Spark master (spark-submit's own when omitted)")
    p.add_argument("--driver-memory", help="the driver's heap when this job starts Spark, e.g. 6g (Spark's "
                   "default is 1g; under spark-submit use its own --driver-memory)")
    p.add_argument("--shuffle-partitions", type=int, help="partitions per shuffle (default: the session's setting, "
                   f"or {PARTITIONS_PER_CORE} per core when that is Spark's default of 200)")
    p.add_argument("--now", type=_moment, default=None, help="audit as of this ISO time (default: now)")
    return p


def _moment(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def main(argv: list[str] | None = None, spark=None) -> int:
    args = parser().parse_args(argv)
    if not args.archive and not args.jdbc_url:
        print("celery-outbox audit: give --archive, --jdbc-url or both", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        options = AuditOptions(out=args.out, archive=args.archive, jdbc_url=args.jdbc_url, jdbc_jar=args.jdbc_jar,
                               table_prefix=args.table_prefix, grace_seconds=args.grace,
                               late_after_seconds=args.late_after, stuck_after_seconds=args.stuck_after,
                               master=args.master, driver_memory=args.driver_memory,
                               shuffle_partitions=args.shuffle_partitions, **({"now": args.now} if args.now else {}))
        summary = run_audit(options, spark)
    except AuditInputError as exc:
        print(f"celery-outbox audit: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    latency = summary["latency_seconds"]
    print(f"audit: {summary['sent']} sent, {summary['handled']} handled, {summary['lost']} lost, "
          f"{summary['duplicates_discarded']} duplicates discarded, {summary['dead_lettered']} dead-lettered, "
          f"{summary['late']} late; latency p50 {_seconds(latency['p50'])}, p99 {_seconds(latency['p99'])}")
    print(f"report: {Path(options.out).resolve() / 'report.html'}")
    return EXIT_LOST if summary["lost"] else EXIT_CLEAN


if __name__ == "__main__":  # spark-submit celery_outbox/audit/job.py ...
    sys.exit(main())
