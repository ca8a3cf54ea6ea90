"""The delivery archive: Parquet files, partitioned by date, that cleanup writes before it deletes.

Transaction boundary: ``archive`` runs inside cleanup's deleting transaction and raises if it
cannot write, so the batch is not deleted and the next cleanup writes it again. Guarantee:
archiving is at least once (the audit de-duplicates), and each batch is a new file, never
rewritten. The layout (``incoming/``, ``dead_letters/``, ``sent/``, each by ``date=``) and the
locations it writes (``Location``) are in docs/audit.md.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Sequence

from ..core.setting_values import expected_member_of
from ..errors import ConfigurationError
from ..vocabulary import ArchiveKind
from .location import Location

__all__ = ["ADDED_COLUMNS", "ParquetArchiver", "archive_schema"]

# column -> arrow type name, per kind; the audit checks every file against these
_COLUMNS: dict[ArchiveKind, dict[str, str]] = {
    ArchiveKind.INCOMING: {
        "message_id": "string", "destination": "string", "task_name": "string", "queue": "string",
        "status": "string", "retries": "int32", "nesting": "int32", "replays": "int32",
        "duplicates": "int32", "recoveries": "int32", "received_at": "timestamp", "claimed_at": "timestamp",
        "handled_at": "timestamp",
    },
    ArchiveKind.DEAD_LETTERS: {
        "id": "int64", "message_id": "string", "destination": "string", "task_name": "string", "queue": "string",
        "reason": "string", "exception_type": "string", "exception_message": "string", "retries": "int32",
        "nesting": "int32", "replays": "int32", "failed_at": "timestamp", "replay_count": "int32",
    },
    ArchiveKind.SENT: {
        "message_id": "string", "destination": "string", "task_name": "string", "created_at": "timestamp",
        "sent_at": "timestamp", "deliver_at": "timestamp",
    },
}
#: columns added after files without them were written: such a file is read with the column NULL
ADDED_COLUMNS: dict[ArchiveKind, frozenset[str]] = {ArchiveKind.SENT: frozenset({"deliver_at"})}
_PARTITION_BY = {ArchiveKind.INCOMING: ("handled_at", "received_at"), ArchiveKind.DEAD_LETTERS: ("failed_at",),
                 ArchiveKind.SENT: ("sent_at",)}


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.fs
        import pyarrow.parquet
    except ModuleNotFoundError as exc:
        if exc.name != "pyarrow":
            raise _broken_pyarrow(exc) from None
        raise ConfigurationError(
            "outbox_archive_path needs pyarrow, which is not installed: pip install 'celery-outbox[spark]'"
        ) from None
    except ImportError as exc:  # installed, but it cannot load (a numpy it was not built for, say)
        raise _broken_pyarrow(exc) from None
    return pyarrow


def _broken_pyarrow(exc: ImportError) -> ConfigurationError:
    return ConfigurationError(f"outbox_archive_path needs pyarrow, which is installed but cannot be imported: {exc}; "
                              "pip install --upgrade 'celery-outbox[spark]'")


def archive_schema(kind: ArchiveKind):
    """The arrow schema of one kind of archive file."""
    pa = _pyarrow()
    types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(),
             "timestamp": pa.timestamp("us", tz="UTC")}
    return pa.schema([(name, types[type_name]) for name, type_name in _COLUMNS[kind].items()])


def _filesystem(path: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI; ``s3a://`` is read as ``s3://``.
    A URI pyarrow cannot write to is a ``ConfigurationError``, never a local folder named after it."""
    pa = _pyarrow()
    try:
        location = Location.of(path)
    except ValueError as exc:
        raise ConfigurationError(f"outbox_archive_path: {exc}") from None
    if location.local is not None:
        return pa.fs.LocalFileSystem(), location.local
    uri = "s3://" + location.text[len("s3a://"):] if location.text.startswith("s3a://") else location.text
    try:
        return pa.fs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigurationError(f"outbox_archive_path {location.text}: pyarrow cannot write there ({reason})") \
            from None


class ParquetArchiver:
    """Writes each batch cleanup hands over as one Parquet file per date partition."""

    def __init__(self, path: str):
        _pyarrow()
        self.fs, self.root = _filesystem(path)

    def archive(self, kind: ArchiveKind, rows: Sequence[Any]) -> None:
        try:
            kind = ArchiveKind(kind)
        except ValueError:
            raise ValueError(f"unknown archive kind {kind!r}; {expected_member_of(ArchiveKind)}") from None
        if not rows:
            return
        pa = _pyarrow()
        schema = archive_schema(kind)
        by_date: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            record = {name: _value(getattr(row, name, None), type_name) for name, type_name in _COLUMNS[kind].items()}
            moment = next((record[c] for c in _PARTITION_BY[kind] if record.get(c) is not None), None)
            by_date[(moment or datetime.now(timezone.utc)).date().isoformat()].append(record)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        for date, records in by_date.items():
            folder = f"{self.root}/{kind}/date={date}"
            self.fs.create_dir(folder, recursive=True)
            table = pa.Table.from_pylist(records, schema=schema)
            pa.parquet.write_table(table, f"{folder}/part-{stamp}-{uuid.uuid4().hex}.parquet", filesystem=self.fs)


def _value(value: Any, type_name: str) -> Any:
    if value is None:
        return None
    if type_name == "timestamp":
        return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    if type_name in ("int32", "int64"):
        return int(value)
    return str(value)
