"""What every statement family builds on: the engine, its short transactions, the store's errors.

Transaction boundary: ``StoreBase.begin`` opens a transaction of its own (``_Transaction``): it
commits when its block ends, rolls back on an error, and turns a database that cannot be reached
into ``StoreUnavailable``; ``ping`` runs in one. The SQL pieces more than one family uses
(``_id_predicate``, the node liveness predicates, ``_release_incoming``) run inside the caller's
transaction. PostgreSQL gets its fast paths (``= ANY(array)``, advisory locks); SQLite's
equivalents are correct because every SQLite transaction of the store is ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import zlib
from datetime import datetime, timezone
from typing import Sequence

from sqlalchemy import BigInteger, Connection, bindparam, case, false, func, literal_column, select, tuple_, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from ..errors import StoreUnavailable
from ..vocabulary import Attempt
from .engine import SQLITE_BUSY_TIMEOUT_MS, redact, safe_url, unpooled_sibling
from .schema import UNOWNED, Tables, _incoming_key, build_tables, is_running
from .sqlite_codes import SqliteCode, sqlite_code

__all__ = ["StoreBase", "as_utc", "is_content_error", "is_lock_timeout", "is_statement_timeout", "is_unique_violation",
           "utcnow"]

PG_UNIQUE_VIOLATION = "23505"
PG_LOCK_NOT_AVAILABLE = "55P03"
PG_QUERY_CANCELED = "57014"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes: the store only ever writes UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


def is_unique_violation(exc: BaseException) -> bool:
    """True when ``exc`` is a primary-key or unique violation, judged by SQLSTATE / driver error code."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) == PG_UNIQUE_VIOLATION:
        return True
    return sqlite_code(orig) in (SqliteCode.CONSTRAINT_PRIMARYKEY, SqliteCode.CONSTRAINT_UNIQUE)


def is_lock_timeout(exc: BaseException) -> bool:
    """True when a statement gave up waiting for a row another transaction holds (PostgreSQL's
    ``lock_timeout``), or a transaction for the write lock another one holds (SQLite's busy
    timeout), as ``begin(lock_wait=...)`` bounds them: the database works, the row is busy."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) == PG_LOCK_NOT_AVAILABLE:
        return True
    code = sqlite_code(orig)
    return code is not None and code & 0xFF == SqliteCode.BUSY  # SQLITE_BUSY and its extended codes


def is_statement_timeout(exc: BaseException) -> bool:
    """True when PostgreSQL cancelled a statement that ran past its ``statement_timeout``."""
    return getattr(getattr(exc, "orig", exc), "sqlstate", None) == PG_QUERY_CANCELED


def is_content_error(exc: BaseException) -> bool:
    """True when the database (or its driver) refused a statement for the values it carried: a
    data exception or constraint violation (SQLSTATE classes 22 and 23, the DBAPI's
    ``DataError``/``IntegrityError``), or text the driver cannot encode. Anything else (a lost
    connection, a pool timeout, a missing table) is not the values' fault."""
    if isinstance(exc, (DataError, IntegrityError, UnicodeError)):
        return True
    sqlstate = getattr(getattr(exc, "orig", exc), "sqlstate", None) or ""
    return sqlstate[:2] in ("22", "23")


def node_lock_namespace(lock_scope: str) -> int:
    """High 32 bits of the advisory lock keys of one store's nodes (``StoreBase.lock_scope``: node
    ids repeat across table prefixes and schemas)."""
    return zlib.crc32(f"celery_outbox.node:{lock_scope}".encode()) & 0x7FFFFFFF


def node_lock_key(node_id: int, lock_scope: str) -> int:
    """The advisory lock key of a node's liveness lock: one 64-bit key per node id and store."""
    return (node_lock_namespace(lock_scope) << 32) | (node_id & 0xFFFFFFFF)


class StoreBase:
    """The tables of one table prefix on one engine; the statement families of ``Store`` are its
    subclasses."""

    def __init__(self, engine: Engine, table_prefix: str = "celery_outbox_", tables: Tables | None = None,
                 schema: str | None = None):
        self.engine = engine
        self.tables = tables if tables is not None else build_tables(table_prefix)
        self.prefix = table_prefix
        #: the PostgreSQL schema the engine's connections search first (a tenant's), created by ``migrate``
        self.schema = schema
        #: what tells this store's advisory locks from another's in one database (node ids repeat
        #: across table prefixes and schemas)
        self.lock_scope = table_prefix if schema is None else f"{schema}.{table_prefix}"
        self.dialect = engine.dialect.name
        self.is_postgres = self.dialect == "postgresql"
        self._unpooled: Engine | None = None

    # -- connections ---------------------------------------------------------------------------

    def describe(self) -> str:
        return safe_url(self.engine.url)

    def connect_outside_pool(self) -> Connection:
        """A new connection of the store's database, outside the engine's pool, closed when it
        is closed (``unpooled_sibling``): for one held for the process's life."""
        if self._unpooled is None:
            self._unpooled = unpooled_sibling(self.engine)
        return self._unpooled.connect()

    def unavailable(self, exc: BaseException) -> StoreUnavailable:
        """A ``StoreUnavailable`` naming the store and the driver's reason, with no password in it."""
        reason = getattr(exc, "orig", None) or exc
        message = " ".join(str(reason).split())
        return StoreUnavailable(
            f"cannot use the message store at {self.describe()}: {redact(message, self.engine.url)}"
        )

    def begin(self, durable: bool = True, lock_wait: float | None = None, on: Connection | None = None):
        """A short transaction of its own: ``with store.begin() as conn: ...``, on a pooled
        connection, or on ``on``, a connection between transactions that the caller holds
        (so that the caller takes no second connection from the pool).

        ``durable=False`` is for bookkeeping that no irreversible act (an ack, a reply,
        an effect) waits for, and whose loss in a database crash only makes a message
        go out again, for the inbox to discard: on PostgreSQL it commits without
        waiting for the WAL flush (``synchronous_commit = off``). The next durable
        commit of any session makes it durable too: the WAL is flushed in order.

        ``lock_wait`` (seconds) bounds how long the transaction waits for what another one
        holds: on PostgreSQL a statement for a row (``lock_timeout``), on SQLite the BEGIN for
        the write lock, which every transaction takes (the busy timeout, for this transaction
        only). Past it the transaction raises an error ``is_lock_timeout`` recognises, instead
        of holding up its caller.
        """
        return _Transaction(self, durable, lock_wait, on)

    def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the database answers."""
        with self.begin() as conn:
            conn.execute(select(literal_column("1")))

    # -- shared SQL ------------------------------------------------------------------------------

    def _id_predicate(self, column, ids: Sequence[int]):
        if self.is_postgres:
            return column == func.any(bindparam("ids", list(ids), type_=postgresql.ARRAY(BigInteger)))
        return column.in_(list(ids))

    def database_now(self, conn: Connection) -> datetime:
        """The one clock that heartbeats and the checks of them are read on: PostgreSQL's (its
        transaction's start, one round trip), so that a node whose clock is skewed is neither
        stale nor fresh for it; on SQLite, embedded in one host, this host's."""
        if not self.is_postgres:
            return utcnow()
        return conn.execute(select(func.now())).scalar_one()

    def _clock(self, now: datetime | None):
        """``now``, or the database's clock as SQL (PostgreSQL's ``now()``; this host's on SQLite)."""
        if now is not None:
            return now
        return func.now() if self.is_postgres else utcnow()

    def _silent_and_unlocked(self, silent, node_id_column):
        """SQL: ``silent`` and the node's liveness lock free, the lock tried only for a silent node
        (trying it takes it for the rest of the transaction)."""
        return case((silent, self._liveness_lock_free(node_id_column)), else_=false())

    def _liveness_lock_free(self, node_id_column):
        """SQL (PostgreSQL): the node's process no longer holds its liveness lock. Takes the
        lock for the rest of the transaction when it is free."""
        lock_key = literal_column(str(node_lock_namespace(self.lock_scope) << 32), BigInteger) + node_id_column
        return func.pg_try_advisory_xact_lock(lock_key)

    def _running_claim(self, message_id: str, destination: str, attempt: Attempt, send_id: str):
        """The inbox row of the message that is a running claim of this attempt (nesting, replays,
        retries)."""
        table = self.tables.incoming
        nesting, replays, retries = attempt
        return (is_running(table) & (table.c.message_id == message_id) & (table.c.destination == destination)
                & (table.c.send_id == send_id) & (table.c.nesting == nesting) & (table.c.replays == replays)
                & (table.c.retries == retries))

    def _release_incoming(self, conn: Connection, where, limit: int, recover_after: datetime) -> int:
        """Release up to ``limit`` claims matching ``where`` (skipping locked rows), due for recovery
        at ``recover_after``."""
        table = self.tables.incoming
        keys = select(*_incoming_key(table)).where(where).limit(limit)
        if self.is_postgres:
            keys = keys.with_for_update(skip_locked=True)
        return conn.execute(
            update(table).where(tuple_(*_incoming_key(table)).in_(keys))
            .values(owner=UNOWNED, recover_after=recover_after)
        ).rowcount


class _Transaction:
    """``with store.begin() as conn``: commit on success, roll back on error, and turn a
    database that cannot be reached into ``StoreUnavailable`` naming the store."""

    def __init__(self, store: StoreBase, durable: bool = True, lock_wait: float | None = None,
                 on: Connection | None = None):
        self.store = store
        self.durable = durable
        self.lock_wait = lock_wait
        self.on = on
        self._conn: Connection | None = None
        self._context = None
        #: SQLite: the wait is the connection's busy timeout, set for this transaction only
        self._sets_busy_timeout = lock_wait is not None and not store.is_postgres

    def __enter__(self) -> Connection:
        wait_ms = None if self.lock_wait is None else max(1, int(self.lock_wait * 1000))
        try:
            conn = self._conn = self.on if self.on is not None else self.store.engine.connect()
            if self._sets_busy_timeout:  # before the BEGIN that waits for the lock
                _set_busy_timeout(conn, wait_ms)
            self._context = conn.begin()
            self._context.__enter__()
            if not self.durable and self.store.is_postgres:
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            if wait_ms is not None and self.store.is_postgres:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {wait_ms}")
            return conn
        except BaseException as exc:
            if self._context is not None and self._context.is_active:
                try:  # a transaction begun on the caller's connection ends here: it stays the caller's
                    self._context.rollback()
                except Exception:  # noqa: BLE001 - the error that stopped the BEGIN is the one to raise
                    pass
            self._end()
            if isinstance(exc, OperationalError):
                raise self._error(exc) from exc
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._context.__exit__(exc_type, exc, tb)
        except OperationalError as error:
            if exc is None:
                raise self._error(error) from error
            raise
        finally:
            self._end()

    def _error(self, exc: OperationalError) -> Exception:
        """``exc`` itself for a lock wait that ran out, else ``StoreUnavailable`` naming the store."""
        return exc if self.lock_wait is not None and is_lock_timeout(exc) else self.store.unavailable(exc)

    def _end(self) -> None:
        """The connection as it was: the engine's busy timeout back; a pooled one given back."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if self._sets_busy_timeout and not conn.closed and not conn.invalidated:
                try:
                    _set_busy_timeout(conn, SQLITE_BUSY_TIMEOUT_MS)
                except Exception:  # noqa: BLE001 - a connection with the short timeout must not be pooled
                    conn.invalidate()
        finally:
            if self.on is None:
                conn.close()


def _set_busy_timeout(conn: Connection, milliseconds: int) -> None:
    """SQLite: the busy timeout of ``conn``, set on the driver's connection itself (a statement
    through SQLAlchemy would begin a transaction, and with it wait for the write lock)."""
    conn.connection.dbapi_connection.execute(f"PRAGMA busy_timeout = {milliseconds}")
