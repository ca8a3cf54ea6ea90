"""The delivery audit's input: the Parquet archive cleanup writes (checked before Spark starts,
``checks``) and optionally the live tables over JDBC, read as DataFrames and de-duplicated.

Archived rows may repeat (archiving is at least once), and a row may be both archived and still
in its live table: every input is de-duplicated by its key (``Inputs``). An archive only Spark
reaches that is missing or empty, or a live table that cannot be read, is an ``AuditInputError``
saying what and where, with any password masked.
"""

from __future__ import annotations

from celery_outbox.audit.archive import _COLUMNS, ARCHIVE_KINDS
from celery_outbox.audit.checks import ArchiveFiles, empty_archive, missing_archive
from celery_outbox.audit.hadoop import exists
from celery_outbox.audit.jdbc import jdbc_url_of
from celery_outbox.audit.location import Location
from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.store.engine import is_secret_name

__all__ = ["Inputs"]


def _spark_schema(kind: str):
    from pyspark.sql import types as T

    types = {"string": T.StringType(), "int32": T.IntegerType(), "int64": T.LongType(),
             "timestamp": T.TimestampType()}
    return T.StructType([T.StructField(name, types[type_name]) for name, type_name in _COLUMNS[kind].items()])


class Inputs:
    """The audit's DataFrames: archive and live rows of each kind, de-duplicated."""

    def __init__(self, spark, options: AuditOptions, files: ArchiveFiles):
        """Read the inputs: ``files`` are the archive's as ``check_inputs`` found them."""
        from pyspark.sql import functions as F

        self.spark, self.options, self.F = spark, options, F
        self.live = options.jdbc_url is not None
        self.archive = Location.of(options.archive) if options.archive else None
        present = self._present(files)
        frames = {kind: self._archived(kind) if kind in present else spark.createDataFrame([], _spark_schema(kind))
                  for kind in ARCHIVE_KINDS}
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

    def _present(self, files: ArchiveFiles) -> set[str]:
        """The kinds the archive holds: those with files, or, for an archive only Spark reaches,
        those with a folder (its absence and emptiness are refused here, as the checks do locally)."""
        if files is not None:
            return {kind for kind, found in files.items() if found}
        if not exists(self.spark, self.archive.uri):
            raise missing_archive(self.archive)
        present = {kind for kind in ARCHIVE_KINDS if exists(self.spark, self.archive.child(kind).uri)}
        if not present and not self.live:
            raise empty_archive(self.archive)
        return present

    def _archived(self, kind: str):
        schema = _spark_schema(kind)
        folder = self.archive.child(kind).uri
        return self.spark.read.schema(schema).option("basePath", folder).parquet(folder).select(*schema.names)

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
