"""The delivery audit's entry point: ``run_audit`` and the command line spark-submit runs.

Transaction boundary: none; it reads the archive and, with ``--jdbc-url``, each live table once,
and writes only under ``--out``. Guarantee: input that can be checked without Spark is checked
before the JVM starts (``checks``: one line on stderr, exit code 2), and the exit code is 1 when a
message is lost. The parts are ``options``, ``checks``, ``session``, ``inputs``, ``aggregates``
and ``outputs``; what the job computes and writes is in docs/audit.md. spark-submit runs this file
as a script, outside its package, so every import here is absolute.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Callable

from celery_outbox.audit.aggregates import aggregate
from celery_outbox.audit.checks import check_inputs
from celery_outbox.audit.inputs import Inputs
from celery_outbox.audit.ledger import drop_replaced, read_ledger, record_ledger
from celery_outbox.audit.location import Location
from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.audit.outputs import write_outputs
from celery_outbox.audit.session import (
    DEFAULT_JDBC_JAR,
    PARTITIONS_PER_CORE,
    shuffle_partitions,
    spark_facts,
    spark_session,
    starts_jvm,
)
from celery_outbox.vocabulary import ArchiveKind

__all__ = ["AuditInputError", "AuditOptions", "Mode", "Stage", "main", "run_audit"]

EXIT_CLEAN, EXIT_LOST, EXIT_BAD_INPUT = 0, 1, 2
SPARK_LOG = "spark.log"


class Stage(Enum):
    """The audit's stages after its checks, each announced as it begins so a long run never
    looks hung."""

    STARTING_SPARK = "starting Spark"  #: only when no session is given
    READING = "reading the inputs"
    AGGREGATING = "aggregating"
    SETTLING = "settling the ledger"
    WRITING = "writing the outputs"


class Mode(str, Enum):
    """How much of the archive a run read (the summary's ``ledger.mode``)."""

    FULL = "full"  #: all of it
    INCREMENTAL = "incremental"  #: the files its ledger had not covered, and the messages it carried


#: what ``run_audit`` tells of its progress: the stage beginning, and a detail (possibly empty)
Progress = Callable[[Stage, str], None]


def _quiet(stage: Stage, detail: str) -> None:
    """The progress of an audit run as a library call: not told."""


def run_audit(options: AuditOptions, spark=None, progress: Progress = _quiet) -> dict[str, Any]:
    """Compute the audit, write its outputs under ``options.out`` and return the summary.

    The inputs are checked before any Spark starts (an ``AuditInputError`` names the first bad
    one). The de-duplicated inputs and the lost messages are cached: every aggregate reads them,
    and without the cache each would read and shuffle the whole archive again. A session passed
    in gets its shuffle partitions back afterwards.

    The ledger under ``options.out`` (``ledger``) makes the run incremental: it reads the archive
    files the ledger has not covered and the messages it carried, and writes the next ledger
    before the outputs. Without a ledger of the same basis, or with ``options.full``, the run
    reads everything; the summary's ``ledger`` entry says which and why. With ``options.ledger``
    off it reads everything and keeps no ledger.
    """
    files = check_inputs(options)
    out = Location.of(options.out)
    if out.local is not None:
        _make_folder(out)
    spark = spark or _start_spark(options, out, progress)
    saved_partitions = spark.conf.get("spark.sql.shuffle.partitions")
    cached: list[Any] = []
    recorded = False
    try:
        partitions = shuffle_partitions(spark, options)
        spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
        ledger, why_full = read_ledger(spark, out, options) if options.ledger else (None, "--no-ledger")
        progress(Stage.READING, f"(the files the ledger has not covered, of {len(ledger.files)} covered)"
                 if ledger is not None else f"(all of them: {why_full})")
        inputs = Inputs(spark, options, files, ledger)
        frames = [inputs.incoming, inputs.sent, inputs.dead]
        if inputs.live:
            frames += [inputs.archived[kind] for kind in ArchiveKind]
        for frame in frames:
            cached.append(frame.cache())
            frame.count()  # read now, so that the next stage announced is the one running
        progress(Stage.AGGREGATING, "")
        result = aggregate(inputs, options, cached, spark_facts(spark, partitions),
                           ledger.settled if ledger is not None else None)
        told: dict[str, Any] = {"recorded": False}
        if options.ledger:
            progress(Stage.SETTLING, "")
            told = {"recorded": True, **record_ledger(spark, out, options, inputs, result, ledger, cached)}
            recorded = True
        result.summary["ledger"] = {"mode": (Mode.INCREMENTAL if ledger is not None else Mode.FULL).value,
                                    "why_full": why_full or None, **told}
        progress(Stage.WRITING, f"to {out}")
        write_outputs(spark, out, result)
        return result.summary
    finally:
        for frame in cached:
            frame.unpersist()
        spark.conf.set("spark.sql.shuffle.partitions", saved_partitions)
        if recorded:
            drop_replaced(spark, out)


def _make_folder(out: Location) -> None:
    """Make the local ``--out`` folder, where Spark's log goes before Spark runs."""
    import pyarrow.fs

    try:
        pyarrow.fs.LocalFileSystem().create_dir(out.local, recursive=True)
    except OSError as exc:
        raise AuditInputError(f"cannot make the --out folder {out}: {exc}") from None


def _start_spark(options: AuditOptions, out: Location, progress: Progress):
    """Start the session; a JVM started here prints into a log file unless ``options.verbose``."""
    master = options.master or "the configured master"
    if options.verbose or not starts_jvm():
        progress(Stage.STARTING_SPARK, f"({master})")
        return spark_session(options)
    if out.local is not None:
        log = out.child(SPARK_LOG).local
    else:
        handle, log = tempfile.mkstemp(prefix="celery-outbox-audit-", suffix=".log")
        os.close(handle)
    progress(Stage.STARTING_SPARK, f"({master}); its log: {log}")
    return spark_session(options, log)


# -- command line ------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="celery-outbox-audit", description="The delivery audit of celery-outbox.")
    p.add_argument("--archive", help="the archive cleanup writes (outbox_archive_path): a path or a URI")
    p.add_argument("--out", required=True, help="folder for summary.json, report.html, aggregates/: a path or a "
                   "URI Spark can write")
    p.add_argument("--jdbc-url", help="also read the live tables: a jdbc:postgresql:// or postgresql:// URL")
    p.add_argument("--jdbc-jar", help=f"the PostgreSQL JDBC driver jar (default {DEFAULT_JDBC_JAR} if present)")
    p.add_argument("--table-prefix", default="celery_outbox_", help="outbox_table_prefix of the live tables")
    p.add_argument("--schema", help="the PostgreSQL schema of the live tables (a tenant placed in a schema)")
    p.add_argument("--grace", type=float, default=3600.0, help="seconds before an unhandled sent message is lost")
    p.add_argument("--late-after", type=float, default=60.0, help="seconds from sent to handled counted as late")
    p.add_argument("--stuck-after", type=float, default=3600.0, help="seconds a live row may wait before stuck")
    p.add_argument("--master", help="Spark master (spark-submit's own when omitted)")
    p.add_argument("--driver-memory", help="the driver's heap when this job starts Spark, e.g. 6g (Spark's "
                   "default is 1g; under spark-submit use its own --driver-memory)")
    p.add_argument("--shuffle-partitions", type=int, help="partitions per shuffle (default: the session's setting, "
                   f"or {PARTITIONS_PER_CORE} per core when that is Spark's default of 200)")
    p.add_argument("--full", action="store_true", help="read the whole archive again, not only what the ledger "
                   "in --out has not covered")
    p.add_argument("--no-ledger", action="store_true", help="a one-off audit: read everything, keep no ledger in "
                   "--out for the next run (and skip the pass that settles it)")
    p.add_argument("--horizon", type=float, default=86400.0, help="seconds after a message's newest row that the "
                   "ledger still matches repeats of its rows before settling it")
    p.add_argument("--now", type=_moment, default=None, help="audit as of this ISO time (default: now)")
    p.add_argument("--verbose", action="store_true", help="Spark's own log on the console rather than in "
                   f"{SPARK_LOG} in --out")
    return p


def _moment(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _say(stage: Stage, detail: str) -> None:
    print(f"celery-outbox audit: {stage.value}{' ' + detail if detail else ''}", file=sys.stderr, flush=True)


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def main(argv: list[str] | None = None, spark=None) -> int:
    args = parser().parse_args(argv)
    if not args.archive and not args.jdbc_url:
        print("celery-outbox audit: give --archive, --jdbc-url or both", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        options = AuditOptions(out=args.out, archive=args.archive, jdbc_url=args.jdbc_url, jdbc_jar=args.jdbc_jar,
                               table_prefix=args.table_prefix, schema=args.schema, grace_seconds=args.grace,
                               late_after_seconds=args.late_after, stuck_after_seconds=args.stuck_after,
                               master=args.master, driver_memory=args.driver_memory,
                               shuffle_partitions=args.shuffle_partitions, verbose=args.verbose,
                               full=args.full, ledger=not args.no_ledger, horizon_seconds=args.horizon,
                               **({"now": args.now} if args.now else {}))
        summary = run_audit(options, spark, _say)
    except AuditInputError as exc:
        print(f"celery-outbox audit: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    latency = summary["latency_seconds"]
    print(f"audit: {summary['sent']} sent, {summary['handled']} handled, {summary['lost']} lost, "
          f"{summary['duplicates_discarded']} duplicates discarded, {summary['dead_lettered']} dead-lettered, "
          f"{summary['late']} late; latency (sent at once) p50 {_seconds(latency['p50'])}, "
          f"p99 {_seconds(latency['p99'])}")
    print(f"report: {Location.of(options.out).child('report.html')}")
    return EXIT_LOST if summary["lost"] else EXIT_CLEAN


if __name__ == "__main__":  # spark-submit celery_outbox/audit/job.py ...
    sys.exit(main())
