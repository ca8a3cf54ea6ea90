"""The delivery audit's inputs as de-duplicated DataFrames: the archive and, optionally, live tables.

Transaction boundary: none of its own; each live table is read once over JDBC, before the archive
is listed. Guarantee: every input is de-duplicated by its key (``Inputs``), so a row archived
twice, or both archived and still live, counts once, whether its message's rows came in one run or
over several (``ledger``). An input that is missing, empty or unreadable, or a row stamped before
``EARLIEST_MOMENT``, is an ``AuditInputError`` naming the file or table (and the message id), with
any password masked.
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from urllib.parse import unquote

from celery_outbox.audit.archive import _COLUMNS, ADDED_COLUMNS
from celery_outbox.audit.checks import EARLIEST_MOMENT, ArchiveFiles, early_moment, empty_archive, missing_archive
from celery_outbox.audit.hadoop import exists, parquet_files
from celery_outbox.audit.jdbc import jdbc_url_of
from celery_outbox.audit.location import Location
from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.store.engine import is_secret_name
from celery_outbox.vocabulary import ArchiveKind, IncomingStatus

__all__ = ["KEPT_COLUMNS", "Inputs", "deduplicated"]


#: the live outbox table, read beside the tables of the archive's kinds (its rows are not archived)
_OUTGOING = "outgoing"

#: the columns the check of early moments adds: an archive row's file, a column's verdict (suffix)
_FILE, _EARLY = "celery_outbox_file", "_is_early"

#: the live tables, in the order they are read (see ``Inputs``)
_LIVE_ORDER = (ArchiveKind.SENT, _OUTGOING, ArchiveKind.DEAD_LETTERS, ArchiveKind.INCOMING)

#: the columns of each kind that the audit keeps after de-duplication (a carried message's)
KEPT_COLUMNS = {
    ArchiveKind.SENT: ("message_id", "destination", "sent_at", "task_name", "deliver_at"),
    ArchiveKind.INCOMING: ("message_id", "destination", "status", "handled_at", "received_at", "task_name",
                           "duplicates", "recoveries"),
    ArchiveKind.DEAD_LETTERS: tuple(_COLUMNS[ArchiveKind.DEAD_LETTERS]),
}


def _running(F):
    """Spark: an inbox row whose attempt has not ended."""
    return F.col("status") == IncomingStatus.RUNNING.value


def _spark_schema(kind: ArchiveKind):
    from pyspark.sql import types as T

    types = {"string": T.StringType(), "int32": T.IntegerType(), "int64": T.LongType(),
             "timestamp": T.TimestampType()}
    return T.StructType([T.StructField(name, types[type_name]) for name, type_name in _COLUMNS[kind].items()])


def kept_schema(kind: ArchiveKind):
    """The Spark schema of a de-duplicated frame of ``kind``."""
    from pyspark.sql import types as T

    schema = _spark_schema(kind)
    return T.StructType([schema[name] for name in KEPT_COLUMNS[kind]])


def deduplicated(F, frames: dict) -> dict:
    """Each kind's rows (with at least its ``KEPT_COLUMNS``) de-duplicated by its key: one row per
    message and destination for ``incoming`` (its latest state) and ``sent`` (its first send), one
    per letter for ``dead_letters``. Applying it again to its own output with more rows gives what
    applying it once to all of them gives: a message whose rows came over several runs is counted
    as one whose rows came at once."""
    incoming, sent, dead = (frames[kind].select(*KEPT_COLUMNS[kind])
                            for kind in (ArchiveKind.INCOMING, ArchiveKind.SENT, ArchiveKind.DEAD_LETTERS))
    # the latest state of each message: a running attempt (no end yet) outranks every ended one
    latest = F.struct(F.col("handled_at").isNull(), F.col("handled_at"))
    return {
        ArchiveKind.INCOMING: incoming.groupBy("message_id", "destination").agg(
            F.max_by("status", latest).alias("status"), F.max("handled_at").alias("handled_at"),
            F.min("received_at").alias("received_at"), F.first("task_name").alias("task_name"),
            F.max("duplicates").alias("duplicates"), F.max("recoveries").alias("recoveries")),
        ArchiveKind.SENT: sent.groupBy("message_id", "destination").agg(
            F.min("sent_at").alias("sent_at"), F.first("task_name").alias("task_name"),
            F.min_by("deliver_at", "sent_at").alias("deliver_at")),
        # a letter's id alone is no key: a table made again (another database, a new prefix)
        # numbers its letters from 1 again, while the archive keeps the old ones
        ArchiveKind.DEAD_LETTERS: dead.dropDuplicates(["id", "message_id", "destination", "failed_at"]),
    }


class Inputs:
    """The audit's DataFrames: archive and live rows of each kind, de-duplicated, and what was read.

    ``incoming``, ``sent`` and ``dead`` merge the archive with the live tables; a sent row the
    outgoing table still holds (delivery tracking keeps it until acknowledged) counts as a send
    even when no ``sent`` record of it exists (the publishers write those only with an archive).
    ``archived`` holds the archive's part alone, de-duplicated, by kind: what a ledger carries.
    ``outgoing`` (every live outgoing row) and ``running`` (the live inbox's running rows) hold
    messages that are not lost yet; both are None without ``--jdbc-url``; ``live_ids`` are the
    message ids the live tables hold.

    With a ``carried`` ledger, the archive is the files it has not covered (``files_read``) and
    the messages it carried; ``files_covered`` are every archive file, by its path inside the
    archive, for the next ledger.

    Each live table is read once and kept (cached): every figure sees the same rows. They are
    read before the archive is listed, senders' tables first (``sent``, ``outgoing``, then
    ``dead_letters`` and ``incoming``): cleanup archives a row before it deletes it, and a
    message leaves the outgoing table only once the inbox has its row, so a message moving while
    the audit reads is met in one place or the other, never in neither. ``archive_rows`` and
    ``live_rows`` count the rows read per archive kind and per live table (before
    de-duplication); ``cached`` lists the frames kept, for the caller to unpersist.
    """

    def __init__(self, spark, options: AuditOptions, files: ArchiveFiles, carried=None):
        """Read the inputs: ``files`` are the archive's as ``check_inputs`` found them; ``carried``
        is the last run's ``Ledger``, or None for a full run."""
        from pyspark.sql import functions as F

        self.spark, self.options, self.F = spark, options, F
        self.cached: list = []
        try:
            self._merge(options, files, carried)
        except BaseException:
            for frame in self.cached:
                frame.unpersist()
            raise

    def _merge(self, options: AuditOptions, files: ArchiveFiles, carried) -> None:
        F = self.F
        self.outgoing = self.running = self.live_rows = self.archive_rows = self.live_ids = None
        self.live = options.jdbc_url is not None
        self.archive = Location.of(options.archive) if options.archive else None
        live = {}
        if self.live:
            read = {kind: self._table(kind) for kind in _LIVE_ORDER}  # one after the other, in this order
            live = {kind: frame for kind, (frame, _) in read.items()}
            self.live_rows = {self._table_name(kind): rows for kind, (_, rows) in read.items()}
        found = self._files(files)
        covered = carried.files if carried is not None else set()
        self.files_covered = sorted(path for paths in found.values() for path in paths)
        new = {kind: [uri for path, uri in paths.items() if path not in covered] for kind, paths in found.items()}
        self.files_read = sum(len(uris) for uris in new.values())
        frames = {kind: self._archived(kind, new[kind]) for kind in ArchiveKind}
        if files is None and self.archive is not None:  # no check before Spark could read these
            for frame in frames.values():
                self._refuse_early_moments(frame.withColumn(_FILE, F.input_file_name()), "archive file")
        if self.archive is not None:
            self.archive_rows = {kind: frame.count() for kind, frame in frames.items()}
        if carried is not None:
            frames = {kind: frames[kind].select(*KEPT_COLUMNS[kind]).unionByName(carried.frame(self.spark, kind))
                      for kind in ArchiveKind}
        self.archived = deduplicated(F, frames)
        merged = self.archived
        if live:
            self.outgoing, self.running = live[_OUTGOING], live[ArchiveKind.INCOMING].where(_running(F))
            sent_unacknowledged = self.outgoing.where(F.col("sent_at").isNotNull())
            merged = {kind: self.archived[kind].unionByName(live[kind].select(*KEPT_COLUMNS[kind]))
                      for kind in ArchiveKind}
            merged[ArchiveKind.SENT] = merged[ArchiveKind.SENT].unionByName(
                sent_unacknowledged.select(*KEPT_COLUMNS[ArchiveKind.SENT]))
            merged = deduplicated(F, merged)
            self.live_ids = reduce(lambda a, b: a.unionByName(b),
                                   [frame.select("message_id") for frame in live.values()]).distinct()
        self.incoming, self.sent, self.dead = (merged[ArchiveKind.INCOMING], merged[ArchiveKind.SENT],
                                               merged[ArchiveKind.DEAD_LETTERS])

    def _files(self, files: ArchiveFiles) -> dict[str, dict[str, str]]:
        """Per kind, the archive's files: {path inside the archive: what Spark reads}. For an
        archive only Spark reaches, Spark lists them (its absence and emptiness are refused
        here, as the checks do locally)."""
        if self.archive is None:
            return {kind: {} for kind in ArchiveKind}
        if files is None:
            if not exists(self.spark, self.archive.uri):
                raise missing_archive(self.archive)
            files = {kind: parquet_files(self.spark, self.archive.child(kind).uri) for kind in ArchiveKind}
            if not any(files.values()) and not self.live:
                raise empty_archive(self.archive)
        return {kind: {f"{kind}/{name.rsplit(f'/{kind}/', 1)[1]}": name for name in names}
                for kind, names in files.items()}

    def _archived(self, kind: ArchiveKind, uris: list[str]):
        """The rows of ``kind`` in the archive files ``uris``."""
        schema = _spark_schema(kind)
        if not uris:
            return self.spark.createDataFrame([], schema)
        folder = self.archive.child(kind).uri
        return self.spark.read.schema(schema).option("basePath", folder).parquet(*uris).select(*schema.names)

    def _table_name(self, kind: str) -> str:
        """The live table of ``kind``, in ``options.schema`` when one is given (a tenant's)."""
        table = f"{self.options.table_prefix}{kind}"
        return table if self.options.schema is None else f"{self.options.schema}.{table}"

    def _table(self, kind: str):
        """The live table of ``kind`` (an archive kind, with the archive's columns and types, or
        ``outgoing``), read now and cached, and its row count. A column added since (``ADDED_COLUMNS``)
        that a table not migrated yet lacks is read as NULL."""
        schema = _spark_schema(ArchiveKind.SENT if kind == _OUTGOING else kind)
        table = self._table_name(kind)
        url, properties = jdbc_url_of(self.options.jdbc_url)
        try:
            read = self.spark.read.jdbc(url, table, properties=properties)
            added = ADDED_COLUMNS.get(ArchiveKind.SENT if kind == _OUTGOING else kind, frozenset())
            frame = read.select(*[(self.F.col(f.name) if f.name in read.columns or f.name not in added
                                   else self.F.lit(None)).cast(f.dataType).alias(f.name) for f in schema]).cache()
            self.cached.append(frame)
            rows = frame.count()
        except Exception as exc:  # noqa: BLE001 - Spark wraps the driver's error; its first line says it
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            reason = reason.split("on the operation: ")[-1].split(" SQLSTATE")[0]
            for secret in (value for name, value in properties.items() if is_secret_name(name) and value):
                reason = reason.replace(secret, "***")
            raise AuditInputError(f"cannot read the live table {table} at {url.split('?')[0]}: {reason[:300]}") \
                from None
        self._refuse_early_moments(frame, f"live table {table}")
        return frame, rows

    def _refuse_early_moments(self, frame, where: str) -> None:
        """Refuse ``frame``'s rows if one holds a moment before ``EARLIEST_MOMENT`` (Spark reads
        it, but Python cannot take it from Spark): the error names it by ``where`` (a live table,
        or ``"archive file"`` and the file in the frame's ``_FILE`` column), its message id and the
        column. One query, which stops at the first such row: Parquet's statistics spare it the
        row groups that hold none, and a live table's rows are read from its cache."""
        from pyspark.sql import types as T

        F = self.F
        columns = [f.name for f in frame.schema if isinstance(f.dataType, T.TimestampType)]
        if not columns:
            return
        earliest = F.lit(EARLIEST_MOMENT)
        shown = [F.date_format(F.col(name), "yyyy-MM-dd'T'HH:mm:ssxxx").alias(name) for name in columns]
        found = frame.where(reduce(or_, [F.col(name) < earliest for name in columns])).select(
            *([F.col(_FILE)] if _FILE in frame.columns else []), F.col("message_id"),
            *[(F.col(name) < earliest).alias(f"{name}{_EARLY}") for name in columns], *shown).limit(1).collect()
        if not found:
            return
        row = found[0].asDict()
        name = next(name for name in columns if row[f"{name}{_EARLY}"])
        place = f"{where} {unquote(row[_FILE])}" if _FILE in row else where  # Spark gives it as a URI
        raise early_moment(f"{place}, message {row['message_id']!r}", name, row[name])
