"""The delivery audit's inputs, checked before any JVM starts: a bad one costs a second and one line.

No transaction: it reads files. Checked here: the options' locations, the archive when it is local
(holding files, each readable Parquet with the columns of its kind, or of an older release's:
pyarrow reads the footers), the JDBC URL's form and the JDBC driver's jar. An archive on a
filesystem only Spark reaches (``s3a://``, ``hdfs://``...) is left to Spark, which checks it as it
checks the live tables (``inputs``).
"""

from __future__ import annotations

from datetime import datetime, timezone

from celery_outbox.audit.archive import ADDED_COLUMNS, archive_schema
from celery_outbox.audit.jdbc import jdbc_url_of
from celery_outbox.audit.location import Location
from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.audit.session import jdbc_jar
from celery_outbox.vocabulary import ArchiveKind

__all__ = ["EARLIEST_MOMENT", "ArchiveFiles", "check_archive", "check_inputs", "check_moments", "early_moment",
           "empty_archive", "location_of", "missing_archive"]

#: the Parquet files of each kind of the archive, as found before Spark starts; None for an archive
#: on a filesystem only Spark reaches, which Spark lists itself
ArchiveFiles = dict[ArchiveKind, list[str]] | None


def check_inputs(options: AuditOptions) -> ArchiveFiles:
    """Check every input that can be checked without Spark; an ``AuditInputError`` names the first
    bad one. Returns the archive's files (``ArchiveFiles``)."""
    out = location_of("--out", options.out)
    if out.local is not None:
        import pyarrow.fs

        if pyarrow.fs.LocalFileSystem().get_file_info(out.local).type == pyarrow.fs.FileType.File:
            raise AuditInputError(f"--out {out} is a file, not a folder")
    if options.jdbc_url:
        jdbc_url_of(options.jdbc_url)
    jdbc_jar(options)
    if not options.archive:
        return {kind: [] for kind in ArchiveKind}
    archive = location_of("--archive", options.archive)
    if archive.local is None:
        return None
    files = check_archive(archive)
    if not options.jdbc_url and not any(files.values()):
        raise empty_archive(archive)
    return files


def location_of(option: str, text: str) -> Location:
    """The ``Location`` given to ``option``; a malformed one is an ``AuditInputError``."""
    try:
        return Location.of(text)
    except ValueError as exc:
        raise AuditInputError(f"{option} {exc}") from None


def check_archive(archive: Location) -> dict[ArchiveKind, list[str]]:
    """The Parquet files of each kind in the local ``archive``; a clear error for a missing archive
    or a bad file."""
    import pyarrow.fs
    import pyarrow.parquet as pq

    fs = pyarrow.fs.LocalFileSystem()
    if fs.get_file_info(archive.local).type == pyarrow.fs.FileType.NotFound:
        raise missing_archive(archive)
    files: dict[ArchiveKind, list[str]] = {}
    for kind in ArchiveKind:
        selector = pyarrow.fs.FileSelector(archive.child(kind).local, allow_not_found=True, recursive=True)
        found = sorted(info.path for info in fs.get_file_info(selector) if info.path.endswith(".parquet"))
        expected = archive_schema(kind)
        for file_path in found:
            try:
                schema = pq.read_schema(file_path, filesystem=fs)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
                raise AuditInputError(f"archive file {file_path} is not readable Parquet: {exc}") from None
            for column in expected:
                if column.name not in schema.names and column.name in ADDED_COLUMNS.get(kind, ()):
                    continue  # written before the column was
                if column.name not in schema.names:
                    raise AuditInputError(f"archive file {file_path} has a bad schema: no column {column.name!r} "
                                          f"(a {kind} file needs {', '.join(expected.names)})")
                actual = schema.field(column.name).type
                if actual != column.type and not (str(actual).startswith("timestamp")
                                                   and str(column.type).startswith("timestamp")):
                    raise AuditInputError(f"archive file {file_path} has a bad schema: column {column.name!r} is "
                                          f"{actual}, expected {column.type}")
            check_moments(file_path, fs, [c.name for c in expected if str(c.type).startswith("timestamp")])
        files[kind] = found
    return files


#: no node of a deployment stamped a row before this (the Unix epoch): an earlier moment, year 1
#: say, is a corrupted or forged row, which Spark reads but Python cannot turn into local time
EARLIEST_MOMENT = datetime(1970, 1, 1, tzinfo=timezone.utc)


def check_moments(file_path: str, fs, columns: list[str]) -> None:
    """Refuse a file whose timestamp ``columns`` hold a moment before ``EARLIEST_MOMENT``, naming
    the file, the row and the column. Reads the footer's statistics; a column is read only when
    they show such a moment."""
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(file_path, filesystem=fs).metadata
    names = [metadata.schema.column(i).name for i in range(metadata.num_columns)]
    for name in columns:
        if name not in names:
            continue
        index = names.index(name)
        earliest = None
        for group in range(metadata.num_row_groups):
            statistics = metadata.row_group(group).column(index).statistics
            if statistics is None or not statistics.has_min_max:
                earliest = None  # no statistics: read the column
                break
            low = _aware(statistics.min)
            earliest = low if earliest is None or low < earliest else earliest
        if earliest is not None and earliest >= EARLIEST_MOMENT:
            continue
        values = pq.read_table(file_path, columns=[name], filesystem=fs).column(name).to_pylist()
        for row, value in enumerate(values):
            if value is not None and _aware(value) < EARLIEST_MOMENT:
                raise early_moment(f"archive file {file_path}, row {row}", name, value.isoformat())


def early_moment(where: str, column: str, shown: str) -> AuditInputError:
    """The error for a row, named by ``where``, whose ``column`` holds ``shown``, a moment before
    ``EARLIEST_MOMENT``."""
    return AuditInputError(f"{where}: column {column!r} is {shown}, before {EARLIEST_MOMENT.date()}: a corrupted "
                           "or forged row (no node's clock gave it)")


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def missing_archive(archive: Location) -> AuditInputError:
    """The error for no archive at ``archive``."""
    return AuditInputError(f"no archive at {archive}: set outbox_archive_path and let cleanup run, "
                           "or give the path cleanup writes to")


def empty_archive(archive: Location) -> AuditInputError:
    """The error for an archive with no files, audited without the live tables."""
    return AuditInputError(f"the archive at {archive} is empty: no incoming, sent or dead_letters files yet "
                           "(cleanup archives rows once their keep-until passes); add --jdbc-url to audit "
                           "the live tables")
