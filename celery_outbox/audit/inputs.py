"""The delivery audit's input: the Parquet archive cleanup writes, checked file by file before
Spark reads it, and optionally the live tables over JDBC, read as DataFrames and de-duplicated.

Archived rows may repeat (archiving is at least once), and a row may be both archived and still
in its live table: every input is de-duplicated by its key (``Inputs``). A missing archive, a file
that is not readable Parquet or lacks a column, or a live table that cannot be read is an
``AuditInputError`` saying what and where, with any password masked.
"""

from __future__ import annotations

from celery_outbox.audit.archive import _COLUMNS, ARCHIVE_KINDS, archive_schema, filesystem
from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.store.engine import is_secret_name, safe_url
from celery_outbox.vocabulary import IncomingStatus

__all__ = ["Inputs", "check_archive", "jdbc_url_of"]


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


#: the live tables, in the order they are read (see ``Inputs``)
_LIVE_ORDER = ("sent", "outgoing", "dead_letters", "incoming")


def _running(F):
    """Spark: an inbox row whose attempt has not ended."""
    return F.col("status") == IncomingStatus.RUNNING.value


def _spark_schema(kind: str):
    from pyspark.sql import types as T

    types = {"string": T.StringType(), "int32": T.IntegerType(), "int64": T.LongType(),
             "timestamp": T.TimestampType()}
    return T.StructType([T.StructField(name, types[type_name]) for name, type_name in _COLUMNS[kind].items()])


class Inputs:
    """The audit's DataFrames: archive and live rows of each kind, de-duplicated, and what was read.

    ``incoming``, ``sent`` and ``dead`` merge the archive with the live tables; a sent row the
    outgoing table still holds (delivery tracking keeps it until acknowledged) counts as a send
    even when no ``sent`` record of it exists (the publishers write those only with an archive).
    ``outgoing`` (every live outgoing row) and ``running`` (the live inbox's running rows) hold
    messages that are not lost yet; both are None without ``--jdbc-url``.

    Each live table is read once and kept (cached): every figure sees the same rows. They are
    read before the archive is listed, senders' tables first (``sent``, ``outgoing``, then
    ``dead_letters`` and ``incoming``): cleanup archives a row before it deletes it, and a
    message leaves the outgoing table only once the inbox has its row, so a message moving while
    the audit reads is met in one place or the other, never in neither. ``archive_rows`` and
    ``live_rows`` count the rows read per archive kind and per live table (before
    de-duplication); ``cached`` lists the frames kept, for the caller to unpersist.
    """

    def __init__(self, spark, options: AuditOptions):
        from pyspark.sql import functions as F

        self.spark, self.options, self.F = spark, options, F
        self.cached: list = []
        try:
            self._merge(options)
        except BaseException:
            for frame in self.cached:
                frame.unpersist()
            raise

    def _merge(self, options: AuditOptions) -> None:
        F = self.F
        self.outgoing = self.running = self.live_rows = self.archive_rows = None
        live = {}
        if options.jdbc_url is not None:
            read = {kind: self._table(kind) for kind in _LIVE_ORDER}  # one after the other, in this order
            live = {kind: frame for kind, (frame, _) in read.items()}
            self.live_rows = {self._table_name(kind): rows for kind, (_, rows) in read.items()}
        files = check_archive(options.archive) if options.archive else {kind: [] for kind in ARCHIVE_KINDS}
        if not live and not any(files.values()):
            raise AuditInputError(f"the archive at {options.archive} is empty: no incoming, sent or dead_letters "
                                  "files yet (cleanup archives rows once their keep-until passes); "
                                  "add --jdbc-url to audit the live tables")
        frames = {kind: self._archived(kind, files[kind]) for kind in ARCHIVE_KINDS}
        if options.archive:
            self.archive_rows = {kind: frame.count() for kind, frame in frames.items()}
        if live:
            self.outgoing, self.running = live["outgoing"], live["incoming"].where(_running(F))
            sent_unacknowledged = self.outgoing.where(F.col("sent_at").isNotNull()).select(*_COLUMNS["sent"])
            frames = {kind: frames[kind].unionByName(live[kind]) for kind in ARCHIVE_KINDS}
            frames["sent"] = frames["sent"].unionByName(sent_unacknowledged)
        # the latest state of each message: a running attempt (no end yet) outranks every ended one
        latest = F.struct(F.col("handled_at").isNull(), F.col("handled_at"))
        self.incoming = (frames["incoming"].groupBy("message_id", "destination").agg(
            F.max_by("status", latest).alias("status"), F.max("handled_at").alias("handled_at"),
            F.min("received_at").alias("received_at"), F.first("task_name").alias("task_name"),
            F.max("duplicates").alias("duplicates"), F.max("recoveries").alias("recoveries")))
        self.sent = frames["sent"].groupBy("message_id", "destination").agg(
            F.min("sent_at").alias("sent_at"), F.first("task_name").alias("task_name"))
        # a letter's id alone is no key: a table made again (another database, a new prefix)
        # numbers its letters from 1 again, while the archive keeps the old ones
        self.dead = frames["dead_letters"].dropDuplicates(["id", "message_id", "destination", "failed_at"])

    def _archived(self, kind: str, paths: list[str]):
        schema = _spark_schema(kind)
        if not paths:
            return self.spark.createDataFrame([], schema)
        archive = self.options.archive.rstrip("/")
        frame = self.spark.read.schema(schema).option("basePath", f"{archive}/{kind}").parquet(f"{archive}/{kind}")
        return frame.select(*schema.names)

    def _table_name(self, kind: str) -> str:
        return f"{self.options.table_prefix}{kind}"

    def _table(self, kind: str):
        """The live table of ``kind`` (an archive kind, with the archive's columns and types, or
        ``outgoing``), read now and cached, and its row count."""
        schema = _spark_schema("sent" if kind == "outgoing" else kind)
        table = self._table_name(kind)
        url, properties = jdbc_url_of(self.options.jdbc_url)
        try:
            frame = self.spark.read.jdbc(url, table, properties=properties).select(
                *[self.F.col(f.name).cast(f.dataType) for f in schema]).cache()
            self.cached.append(frame)
            return frame, frame.count()
        except Exception as exc:  # noqa: BLE001 - Spark wraps the driver's error; its first line says it
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            reason = reason.split("on the operation: ")[-1].split(" SQLSTATE")[0]
            for secret in (value for name, value in properties.items() if is_secret_name(name) and value):
                reason = reason.replace(secret, "***")
            raise AuditInputError(f"cannot read the live table {table} at {url.split('?')[0]}: {reason[:300]}") \
                from None
