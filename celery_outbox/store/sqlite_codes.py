"""SQLite's result code of a driver error, on every Python the library runs on.

Python's ``sqlite3`` carries the code (``sqlite_errorcode``, the extended one where SQLite gave
one) from 3.11 on. Before, the error carries SQLite's text alone: the code is read back from it
for the codes the store tells apart (a busy or locked database, a disk that fails or is full, a
file that cannot be opened, a unique or primary-key violation)."""

from __future__ import annotations

import sqlite3
from enum import IntEnum

__all__ = ["SqliteCode", "sqlite_code"]


class SqliteCode(IntEnum):
    """The SQLite result codes the store tells apart (a primary code is the low byte of its
    extended codes)."""

    BUSY = 5  #: another connection holds the write lock
    LOCKED = 6  #: a table is locked within the same connection
    IOERR = 10
    FULL = 13
    CANTOPEN = 14
    CONSTRAINT_PRIMARYKEY = 1555
    CONSTRAINT_UNIQUE = 2067


#: the start of SQLite's text for each code the store tells apart (sqlite3_errstr, and the
#: unique violation's "UNIQUE constraint failed: table.column", also a primary key's)
_BY_TEXT = (
    ("database is locked", SqliteCode.BUSY),
    ("database table is locked", SqliteCode.LOCKED),
    ("disk I/O error", SqliteCode.IOERR),
    ("database or disk is full", SqliteCode.FULL),
    ("unable to open database file", SqliteCode.CANTOPEN),
    ("UNIQUE constraint failed", SqliteCode.CONSTRAINT_UNIQUE),
)


def sqlite_code(error: BaseException) -> int | None:
    """The SQLite result code of the driver error ``error``; None for an error not SQLite's, or one
    without a code whose text is none of ``_BY_TEXT``'s."""
    if not isinstance(error, sqlite3.Error):
        return None
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code
    text = str(error)
    return next((known for prefix, known in _BY_TEXT if text.startswith(prefix)), None)
