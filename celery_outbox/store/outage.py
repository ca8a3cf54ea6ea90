"""Telling a store outage from a failure: the one rule every path of celery-outbox applies.

No transaction of its own. An outage says the database could not be used, not that the work was
wrong: a connection refused, dropped or invalidated (a restart, a failover, a server-side timeout,
a pooler recycling it), an engine pool that cannot hand out a connection in time, a server shutting
down or out of resources. Guarantee: work that meets an outage is done again later (its message
goes back to the broker), never acked away, recorded as a failure or dead-lettered. Judged by
exception type, SQLSTATE class and SQLite's result code (``sqlite_codes``), never by message text.
"""

from __future__ import annotations

import sqlite3
from typing import NoReturn

from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ..errors import StoreUnavailable
from .sqlite_codes import SqliteCode, sqlite_code

__all__ = ["is_outage", "raise_as_driver_error"]

# SQLSTATE classes of an unusable database: connection exception, insufficient resources,
# operator intervention (admin shutdown, crash shutdown, cannot connect now, idle session timeout)
_OUTAGE_SQLSTATE_PREFIXES = ("08", "53", "57P")
# SQLite primary result codes of a database that cannot be used now: busy, locked, I/O error,
# full, cannot open
_SQLITE_OUTAGE_CODES = frozenset({SqliteCode.BUSY, SqliteCode.LOCKED, SqliteCode.IOERR, SqliteCode.FULL,
                                  SqliteCode.CANTOPEN})
# Class 40 (a deadlock, a serialization failure): the transaction is rolled back and a retry
# of the same work succeeds; for the store's own statements it counts as an outage too.
_TRANSIENT_SQLSTATE_PREFIX = "40"


def _driver_error(exc: BaseException) -> BaseException:
    return getattr(exc, "orig", None) or exc


def _is_outage_error(exc: BaseException, transient: bool) -> bool:
    if isinstance(exc, (StoreUnavailable, PoolTimeout, DisconnectionError)):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    sqlstate = getattr(_driver_error(exc), "sqlstate", None)
    if sqlstate:
        return sqlstate.startswith(_OUTAGE_SQLSTATE_PREFIXES) or (
            transient and sqlstate.startswith(_TRANSIENT_SQLSTATE_PREFIX))
    driver = _driver_error(exc)
    if isinstance(driver, sqlite3.Error):
        code = sqlite_code(driver)
        return code is not None and code & 0xFF in _SQLITE_OUTAGE_CODES
    # no SQLSTATE: the driver lost the connection (psycopg's "the connection is closed",
    # "server closed the connection unexpectedly")
    return isinstance(exc, (OperationalError, InterfaceError)) or type(driver).__name__ in (
        "OperationalError", "InterfaceError")


def is_outage(exc: BaseException, *, transient: bool = False) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, is a store outage.

    ``transient=True`` also counts deadlocks and serialization failures (SQLSTATE class 40):
    for the store's own statements, whose retry is the message coming back."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _is_outage_error(error, transient):
            return True
        error = error.__cause__ or error.__context__
    return False


def raise_as_driver_error(exc: StoreUnavailable) -> NoReturn:
    """Raise the error SQLAlchemy raises for the driver's error ``exc`` was made from: a lost
    connection is an ``OperationalError`` with ``connection_invalidated`` set, as
    ``engine.begin()`` raises it, caused by the driver's error. For a user's own transaction,
    whose retry catches SQLAlchemy's errors; ``exc`` itself when no driver error caused it."""
    cause = exc.__cause__
    if cause is None:
        raise exc
    if isinstance(cause, DBAPIError):
        raise cause
    raise DBAPIError.instance(None, None, cause, Exception, connection_invalidated=True) from cause
