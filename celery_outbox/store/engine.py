"""Building the SQLAlchemy engine of the message store, with clear errors for bad input.

Transaction boundary: every SQLite transaction of an engine built here is ``BEGIN IMMEDIATE`` in
WAL mode with a busy timeout, so several processes (worker, beat, web) share one file without
lock-upgrade deadlocks. A pooled connection idle for ``PING_AFTER_IDLE`` seconds is pinged before
it is handed out; PostgreSQL connections get ``POSTGRES_CONNECT_ARGS`` (keepalives,
``tcp_user_timeout``) unless the URL or the engine options set them. Guarantee: a dropped or
silent connection fails its statement within about a minute, like any database error (the inbox
hands its message back, maintenance runs again): see docs/store.md and docs/faults.md.
PostgreSQL needs psycopg 3 (``celery-outbox[postgres]``); a missing driver is reported as such.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
import time
from typing import Any, Mapping

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, NoSuchModuleError

from ..errors import ConfigurationError

__all__ = ["POSTGRES_CONNECT_ARGS", "build_engine", "is_secret_name", "masked_options", "ping_when_idle", "safe_url",
           "redact", "tune_sqlite", "unpooled_sibling"]

MASK = "***"
_QUOTED_MASK = "%2A%2A%2A"  # the mask as a URL's query renders it
_SECRET_NAME = re.compile(r"pass|secret|token", re.IGNORECASE)

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: libpq's connection options the library sets (over TCP; a Unix socket ignores the keepalives):
#: give up connecting after 5 s; probe a connection idle for 30 s every 10 s; and fail one whose
#: sent data, or probes, the server has not acknowledged for 30 s
POSTGRES_CONNECT_ARGS: Mapping[str, int] = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 30,
                                            "keepalives_interval": 10, "keepalives_count": 3,
                                            "tcp_user_timeout": 30_000}
PING_AFTER_IDLE = 0.05  # seconds a pooled connection may sit idle before it is pinged on checkout
_IDLE_SINCE = "celery_outbox_idle_since"


def is_secret_name(name: Any) -> bool:
    """Whether a connection parameter or engine option of this name holds a secret
    (``password``, ``sslpassword``, ``passfile``, a token...)."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def safe_url(url: str | URL) -> str:
    """The URL as text with its password and every secret query parameter (``password``,
    ``sslpassword``...) masked: the only form that reaches output or logs."""
    try:
        parsed = make_url(url)
        query = {name: MASK if is_secret_name(name) else value for name, value in parsed.query.items()}
        return parsed.set(query=query).render_as_string(hide_password=True).replace(_QUOTED_MASK, MASK)
    except (ArgumentError, ValueError, TypeError):
        return "<unparseable URL>"


def masked_options(options: Any) -> Any:
    """Engine options (``connect_args`` and the like) with the value of every secret-named key masked."""
    if isinstance(options, Mapping):
        return {key: MASK if is_secret_name(key) else masked_options(value) for key, value in options.items()}
    return options


def _secrets(url: str | URL | None) -> list[str]:
    try:
        parsed = make_url(url) if url is not None else None
    except (ArgumentError, ValueError, TypeError):
        return []
    if parsed is None:
        return []
    found = [str(parsed.password)] if parsed.password else []
    for name, value in parsed.query.items():
        if is_secret_name(name):
            found += [value] if isinstance(value, str) else list(value)
    return [secret for secret in found if secret]


def redact(text: str, url: str | URL | None) -> str:
    """``text`` with the URL's password and secret query parameters, if any, replaced by ``***``."""
    for secret in sorted(_secrets(url), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _normalise_postgres(url: URL) -> URL:
    if url.get_backend_name() != "postgresql":
        return url
    driver = url.drivername.partition("+")[2]  # named in the URL: SQLAlchemy's default differs by version
    if driver not in ("", "psycopg"):
        raise ConfigurationError(
            f"setting outbox_database_url = {safe_url(url)!r} names the driver {driver!r}: "
            "celery-outbox uses psycopg 3, write postgresql+psycopg://..."
        )
    if importlib.util.find_spec("psycopg") is None:
        raise ConfigurationError(
            f"setting outbox_database_url = {safe_url(url)!r} needs psycopg 3, which is not installed: "
            "pip install 'celery-outbox[postgres]'"
        )
    return url.set(drivername="postgresql+psycopg")


def _switch_to_wal(cursor) -> None:
    """Put the database file in WAL mode, waiting out other connections doing the same.

    Switching the journal mode needs an exclusive lock and SQLite does not always call
    the busy handler for it, so a fresh file opened by several processes at once can
    answer "database is locked" at once. The mode is stored in the file: once one
    connection has switched it, the others find it set.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode")  # then fetchone(): aiosqlite's adapted cursor too
            if cursor.fetchone()[0].lower() == "wal":
                return
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def tune_sqlite(engine: Engine) -> None:
    """Every connection in WAL mode with a busy timeout, every transaction ``BEGIN IMMEDIATE``."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # pragma: no cover - exercised by every SQLite test
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        if engine.url.database not in (None, "", ":memory:"):
            _switch_to_wal(cursor)
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # pragma: no cover - exercised by every SQLite test
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection on checkout only when it sat idle for ``PING_AFTER_IDLE`` seconds."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection, record) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection, record, _proxy) -> None:
        idle_since = record.info.pop(_IDLE_SINCE, None)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE:
            return  # a new connection, or one in steady use
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            if _lost_connection(engine, exc, dbapi_connection):
                raise DisconnectionError(str(exc)) from exc  # the pool connects afresh
            raise


def _lost_connection(engine: Engine, exc: BaseException, dbapi_connection: Any) -> bool:
    """Whether a failed ping says the connection is gone: the dialect says so of the error, or
    of one it was raised while handling (SQLAlchemy's psycopg ping restores the connection's
    autocommit after a failed query, which on a connection just cut raises a ProgrammingError
    before libpq has marked it bad), or one of them is an OperationalError."""
    dbapi = engine.dialect.loaded_dbapi
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dbapi.OperationalError) or (
                isinstance(seen, dbapi.Error) and engine.dialect.is_disconnect(seen, dbapi_connection, None)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def unpooled_sibling(engine: Engine) -> Engine:
    """An engine whose every connection is a new one of ``engine``'s database (its dialect and
    the function its pool connects with: the same URL, connect arguments and driver), outside
    ``engine``'s pool, closed when it is closed, with none of ``engine``'s event listeners. For a
    connection held for a process's life (a node's liveness session): it takes no slot that a
    unit of work waits for, however small the pool."""
    from sqlalchemy.pool import NullPool

    return Engine(NullPool(engine.pool._creator, dialect=engine.dialect), engine.dialect, engine.url)


def build_engine(database_url: str, options: Mapping[str, Any] | None = None) -> Engine:
    """Create the engine for ``database_url``; raise ``ConfigurationError`` naming what is wrong."""
    try:
        url = make_url(database_url)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(
            f"setting outbox_database_url = {safe_url(database_url)!r} is not a database URL: {exc}; "
            "expected e.g. postgresql+psycopg://user@host/db or sqlite:///path/to/file.sqlite3"
        ) from None
    backend = url.get_backend_name()
    if backend not in ("postgresql", "sqlite"):
        raise ConfigurationError(
            f"setting outbox_database_url = {safe_url(url)!r} names the database {backend!r}: "
            "celery-outbox supports postgresql (production) and sqlite (embedded)"
        )
    url = _normalise_postgres(url)
    kwargs: dict[str, Any] = dict(options or {})
    if backend == "postgresql":  # the URL's query and a given connect_args override the library's options
        library = {name: value for name, value in POSTGRES_CONNECT_ARGS.items() if name not in url.query}
        kwargs["connect_args"] = {**library, **kwargs.get("connect_args", {})}
    try:
        engine = create_engine(url, **kwargs)
    except (ArgumentError, NoSuchModuleError, TypeError) as exc:
        raise ConfigurationError(
            f"cannot build an engine for outbox_database_url = {safe_url(url)!r}: {redact(str(exc), url)}"
        ) from None
    if backend == "sqlite":
        tune_sqlite(engine)
    if not kwargs.get("pool_pre_ping"):
        ping_when_idle(engine)
    return engine
