"""The message store: the only SQL of celery-outbox.

Every method that takes a ``conn`` runs inside the caller's transaction (a unit of
work, a relay batch) and never commits; methods without one open their own short
transaction. PostgreSQL gets its fast paths (INSERT from one JSON parameter, ``= ANY(array)``
deletes, ``FOR UPDATE SKIP LOCKED`` claims, ``ON CONFLICT``, advisory locks);
SQLite gets equivalents that are correct because every SQLite transaction of the
store is ``BEGIN IMMEDIATE`` (one writer at a time).
"""

from __future__ import annotations

import base64
import functools
import json
import re
import select as io_select
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    LargeBinary,
    Row,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    delete,
    false,
    func,
    inspect,
    literal_column,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.schema import CreateIndex, CreateTable

from ..errors import IncompatibleSchema, StoreUnavailable
from .engine import redact, safe_url
from .schema import SCHEMA_VERSION, SEND_ID_SIZE, UNOWNED, Tables, build_tables, is_running

__all__ = ["Store", "MigrationResult", "is_content_error", "is_unique_violation", "utcnow"]

# envelope columns are only overwritten by a claim that carries them
#: the inbox's primary key, as column names
_INCOMING_KEY = ("message_id", "destination", "send_id")


def _incoming_key(table: Table) -> tuple[Any, ...]:
    """The inbox's primary key columns."""
    return tuple(table.c[name] for name in _INCOMING_KEY)


_ENVELOPE_KEYS = frozenset({"exchange", "routing_key", "body", "content_type", "content_encoding", "headers",
                            "properties"})

# Rows per INSERT statement: keeps every statement under both databases' parameter limits.
INSERT_CHUNK = 1000
# The columns of an outgoing row a record of its send (the ``sent`` table) keeps.
RECORD_COLUMNS = ("message_id", "destination", "task_name", "created_at")
PG_UNIQUE_VIOLATION = "23505"
# psycopg.pq values, without importing psycopg for SQLite
_PSYCOPG_IDLE = 0  # TransactionStatus.IDLE
_COMMAND_OK = 1  # ExecStatus.COMMAND_OK
_TUPLES_OK = 2  # ExecStatus.TUPLES_OK
_PIPELINE_SYNC = 10  # ExecStatus.PIPELINE_SYNC
_PSYCOPG_CONNECTION_OK = 0  # ConnStatus.OK
_PSYCOPG_INTRANS = 2  # TransactionStatus.INTRANS
_PG_NO_SUCH_PREPARED = "26000"
_PG_PREPARED_EXISTS = "42P05"
_PG_DIVISION_BY_ZERO = "22012"
# Seconds a claim interrupted by a signal waits for its cancelled query to end
CANCEL_WAIT = 5.0
# Per pooled connection: the names of the statements prepared on it by ``_send_one_message``, and
# the statements to prepare before its next message that opens a transaction (None: not followed)
_PREPARED = "celery_outbox_prepared"
_TO_PREPARE = "celery_outbox_to_prepare"
SQLITE_CONSTRAINT_PRIMARYKEY = 1555
SQLITE_CONSTRAINT_UNIQUE = 2067


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class _PipelinedQuery:
    """A statement with positional parameters (``$1``, ...) for libpq's pipeline mode:
    ``statement`` takes the values of ``keys`` in that order; ``name`` is the name it is
    prepared under on a connection."""

    name: str
    statement: str
    keys: tuple[str, ...]


@functools.lru_cache(maxsize=16)
def _pipelined_query(statement: Any, dialect: Any, names: tuple[str, ...], kind: str) -> _PipelinedQuery:
    """PostgreSQL: ``statement`` (the inbox claim's INSERT, or the eager finish) taking the
    parameters ``names``, prepared as ``celery_outbox_<kind>_<checksum>``."""
    compiled = statement.compile(dialect=dialect, column_keys=list(names))
    if set(compiled.binds) != set(names):  # every value must be a plain bound value
        raise ValueError(f"cannot send the {kind} of parameters {names} as one message")
    order: list[str] = []

    def number(match: re.Match) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    positional = re.sub(r"%\((\w+)\)s", number, compiled.string).replace("%%", "%")
    return _PipelinedQuery(f"celery_outbox_{kind}_{zlib.crc32(positional.encode()):08x}", positional,
                           tuple(order))


@functools.cache
def _pipeline_supported() -> bool:
    """psycopg's libpq has pipeline mode (libpq 14 and later)."""
    import psycopg

    return psycopg.Pipeline.is_supported()


def _exchange(driver: Any, send: Callable[[Any], None]) -> list[Any]:
    """Queue the queries ``send(pgconn)`` sends on psycopg connection ``driver``'s libpq
    connection in pipeline mode, then one Sync, all in one network write; return each query's
    result (``PIPELINE_ABORTED`` for those after an error). It waits in ``select``, as psycopg
    does, so a signal handler (Celery's soft time limit) can interrupt a claim that waits for a
    concurrent claim of the same key; the queries are then cancelled and their end awaited, so
    that a claim ending in COMMIT does not commit after its caller gave up."""
    pgconn = driver.pgconn
    pgconn.enter_pipeline_mode()
    try:
        send(pgconn)
        pgconn.pipeline_sync()
        while pgconn.flush():
            io_select.select([], [pgconn.socket], [])
        results = _pipeline_results(pgconn)
    except BaseException:
        if pgconn.status == _PSYCOPG_CONNECTION_OK and pgconn.is_busy():
            driver.cancel()
            _pipeline_results(pgconn, timeout=CANCEL_WAIT)
        try:
            pgconn.exit_pipeline_mode()
        except Exception:  # noqa: BLE001 - results left unread: the caller drops the connection
            pass
        raise
    pgconn.exit_pipeline_mode()
    return results


def _exchange_on(conn: Connection, send: Callable[[Any], None]) -> list[Any]:
    """``_exchange`` on ``conn``'s psycopg connection; a connection it was interrupted on (a
    signal such as a soft time limit, or a lost connection) is not reused."""
    try:
        return _exchange(conn.connection.driver_connection, send)
    except BaseException:
        conn.invalidate()
        raise


def _sqlstate(result: Any) -> str:
    """The SQLSTATE of a libpq result ('' when it carries none)."""
    from psycopg import pq

    return (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()


def _prepared_statements(conn: Connection) -> tuple[set[str], dict[str, str] | None]:
    """PostgreSQL: the names of the statements ``_send_one_message`` prepared on ``conn``'s
    session, and the statements to prepare before its next message that opens a transaction;
    that dict is None when psycopg's deallocations cannot be followed. They are followed by
    wrapping the ``clear`` of psycopg's prepared-statement manager on the connection (psycopg
    calls it on every rollback and every DROP, ALTER, DISCARD ALL or DEALLOCATE ALL it runs,
    and only then deallocates every prepared statement): our set empties with psycopg's. A
    statement the set names is then there, unless something else deallocated it (SQL run
    with psycopg holding no prepared statement of its own): inside a transaction that fails
    its message, and the name is dropped."""
    info = conn.connection.info
    prepared = info.get(_PREPARED)
    if prepared is None:
        prepared = info[_PREPARED] = set()
        info[_TO_PREPARE] = {} if _forget_when_psycopg_clears(conn.connection.driver_connection, prepared) else None
    return prepared, info[_TO_PREPARE]


def _forget_when_psycopg_clears(driver: Any, prepared: set[str]) -> bool:
    """Empty ``prepared`` whenever psycopg clears its own prepared statements (False when this
    psycopg has no such hook)."""
    manager = getattr(driver, "_prepared", None)
    clear = getattr(manager, "clear", None)
    if not callable(clear):
        return False

    def clear_and_forget() -> Any:
        deallocating = clear()
        if deallocating is not False:  # True: psycopg sends DEALLOCATE ALL next (anything else: forget too)
            prepared.clear()
        return deallocating

    manager.clear = clear_and_forget
    return True


def _pipeline_results(pgconn: Any, timeout: float | None = None) -> list[Any] | None:
    """Wait for the results of the pipeline in flight on ``pgconn`` up to its Sync; return the
    last result of each query (None when ``timeout`` seconds passed first)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[Any] = []
    last = None
    while True:
        while pgconn.is_busy():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            io_select.select([pgconn.socket], [], [], remaining)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one query's results
            results.append(last)
            last = None
        elif result.status == _PIPELINE_SYNC:
            return results
        else:
            last = result


@functools.lru_cache(maxsize=64)
def _insert_from_json(table: Any, names: tuple[str, ...]) -> Any:
    """PostgreSQL: ``INSERT INTO table (names) SELECT ... FROM jsonb_array_elements(:rows) WITH
    ORDINALITY ORDER BY ordinality RETURNING id``: the rows travel as one JSON text, each row an
    array of its values in the order of ``names`` (bytes in base64, see ``_json_rows``). The ids
    come from the table's sequence in the rows' order, so the ascending ids match the rows in order."""
    def value(position: int, name: str) -> Any:
        field = literal_column("given.doc").op("->>")(literal_column(str(position)))
        kind = table.c[name].type
        if isinstance(kind, LargeBinary):
            return func.decode(field, "base64")
        return field if isinstance(kind, (String, Text)) else cast(field, kind)

    given = func.jsonb_array_elements(cast(bindparam("rows", type_=Text), postgresql.JSONB)).table_valued(
        "doc", with_ordinality="ordinality").render_derived(name="given")
    rows = select(*[value(position, name) for position, name in enumerate(names)]).select_from(given) \
        .order_by(given.c.ordinality)
    return table.insert().from_select(list(names), rows).returning(table.c.id)


def _json_rows(rows: Sequence[dict[str, Any]], names: tuple[str, ...]) -> str:
    """The rows as one JSON array of arrays for ``_insert_from_json``: each row's values in the
    order of ``names``, a column a row lacks as null; bytes in base64, datetimes in ISO 8601 (the
    only values the encoder hands to ``_json_value``)."""
    return json.dumps([[row.get(name) for name in names] for row in rows], default=_json_value,
                      separators=(",", ":"))


def _json_value(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"an outgoing row holds a {type(value).__name__}, which JSON cannot carry: {value!r}")


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
    return getattr(orig, "sqlite_errorcode", None) in (SQLITE_CONSTRAINT_PRIMARYKEY, SQLITE_CONSTRAINT_UNIQUE)


def is_content_error(exc: BaseException) -> bool:
    """True when the database (or its driver) refused a statement for the values it carried: a
    data exception or constraint violation (SQLSTATE classes 22 and 23, the DBAPI's
    ``DataError``/``IntegrityError``), or text the driver cannot encode. Anything else (a lost
    connection, a pool timeout, a missing table) is not the values' fault."""
    if isinstance(exc, (DataError, IntegrityError, UnicodeError)):
        return True
    sqlstate = getattr(getattr(exc, "orig", exc), "sqlstate", None) or ""
    return sqlstate[:2] in ("22", "23")


@dataclass
class MigrationResult:
    created_tables: list[str] = field(default_factory=list)
    version_before: int | None = None
    version_after: int = SCHEMA_VERSION


class Store:
    """The tables of one table prefix on one engine, and every statement run on them."""

    def __init__(self, engine: Engine, table_prefix: str = "celery_outbox_", tables: Tables | None = None):
        self.engine = engine
        self.tables = tables if tables is not None else build_tables(table_prefix)
        self.prefix = table_prefix
        self.dialect = engine.dialect.name
        self.is_postgres = self.dialect == "postgresql"

    # -- connections ---------------------------------------------------------------------------

    def describe(self) -> str:
        return safe_url(self.engine.url)

    def unavailable(self, exc: BaseException) -> StoreUnavailable:
        """A ``StoreUnavailable`` naming the store and the driver's reason, with no password in it."""
        reason = getattr(exc, "orig", None) or exc
        message = " ".join(str(reason).split())
        return StoreUnavailable(
            f"cannot use the message store at {self.describe()}: {redact(message, self.engine.url)}"
        )

    def begin(self, durable: bool = True):
        """A short transaction of its own: ``with store.begin() as conn: ...``.

        ``durable=False`` is for bookkeeping that no irreversible act (an ack, a reply,
        an effect) waits for, and whose loss in a database crash only makes a message
        go out again, for the inbox to discard: on PostgreSQL it commits without
        waiting for the WAL flush (``synchronous_commit = off``). The next durable
        commit of any session makes it durable too: the WAL is flushed in order.
        """
        return _Transaction(self, durable)

    def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the database answers."""
        with self.begin() as conn:
            conn.execute(select(literal_column("1")))

    # -- schema --------------------------------------------------------------------------------

    def _advisory_key(self) -> int:
        return zlib.crc32(f"celery_outbox:{self.prefix}".encode()) - 2**31

    def migrate(self) -> MigrationResult:
        """Create missing tables and indexes and upgrade to ``SCHEMA_VERSION``.

        Idempotent; on PostgreSQL two concurrent runs serialise on an advisory
        transaction lock, on SQLite on the database's write lock. Every process that gets
        ready migrates (each new pool process, say), so a current schema is told from the
        catalog alone, with no DDL: ``CREATE INDEX IF NOT EXISTS`` takes a SHARE lock on its
        table even when the index exists, which waits for the tasks writing to it and
        deadlocks with their transactions.

        A schema recorded with a version newer than ``SCHEMA_VERSION`` (migrated by a newer
        release) raises ``IncompatibleSchema`` before any DDL: the version is never written down.
        """
        with self.begin() as conn:
            if self._schema_is_current(conn):
                return MigrationResult(version_before=SCHEMA_VERSION)
        result = MigrationResult()
        with self.begin() as conn:
            if self.is_postgres:
                conn.execute(select(func.pg_advisory_xact_lock(self._advisory_key())))
            result.created_tables = self._missing_tables(conn)
            if self.tables.schema.name not in result.created_tables:
                result.version_before = self._recorded_version(conn)
                self._refuse_newer_schema(result.version_before)
            for table in self.tables.all():
                conn.execute(CreateTable(table, if_not_exists=True))
                for index in sorted(table.indexes, key=lambda i: i.name or ""):
                    conn.execute(CreateIndex(index, if_not_exists=True))
            schema = self.tables.schema
            if result.version_before is None:
                conn.execute(schema.insert().values(id=1, version=SCHEMA_VERSION, migrated_at=utcnow()))
            elif result.version_before != SCHEMA_VERSION:
                for version in range(result.version_before + 1, SCHEMA_VERSION + 1):
                    _UPGRADES[version](self, conn)
                conn.execute(
                    update(schema).where(schema.c.id == 1).values(version=SCHEMA_VERSION, migrated_at=utcnow())
                )
        return result

    def _schema_is_current(self, conn: Connection) -> bool:
        """Every table and index exists and the recorded version is ``SCHEMA_VERSION`` (read from
        the catalog: no lock on the tables)."""
        if self._missing_tables(conn) or self._recorded_version(conn) != SCHEMA_VERSION:
            return False
        inspector = inspect(conn)
        for table in self.tables.all():
            found = {index["name"] for index in inspector.get_indexes(table.name)}
            if not {index.name for index in table.indexes} <= found:
                return False
        return True

    def schema_version(self) -> int | None:
        """The version ``migrate`` recorded, or None when the tables do not exist."""
        with self.begin() as conn:
            if self.tables.schema.name not in inspect(conn).get_table_names():
                return None
            return self._recorded_version(conn)

    def missing_tables(self) -> list[str]:
        with self.begin() as conn:
            return self._missing_tables(conn)

    def refuse_newer_schema(self) -> None:
        """Raise ``IncompatibleSchema`` when the recorded schema version is newer than this code's."""
        self._refuse_newer_schema(self.schema_version())

    def _refuse_newer_schema(self, recorded: int | None) -> None:
        if recorded is not None and recorded > SCHEMA_VERSION:
            raise IncompatibleSchema(
                f"the message store at {self.describe()} has schema version {recorded}, newer than "
                f"version {SCHEMA_VERSION} of this celery-outbox: a newer release migrated it; upgrade "
                "celery-outbox here (nothing was changed in the store)"
            )

    def _missing_tables(self, conn: Connection) -> list[str]:
        existing = set(inspect(conn).get_table_names())
        return [t.name for t in self.tables.all() if t.name not in existing]

    def _recorded_version(self, conn: Connection) -> int | None:
        """The version in the schema table (which must exist); None before the first migrate."""
        schema = self.tables.schema
        return conn.execute(select(schema.c.version).where(schema.c.id == 1)).scalar()

    # -- outgoing ------------------------------------------------------------------------------

    def insert_outgoing(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> list[int]:
        """Insert fully built messages. Returns their ids in the rows' order. PostgreSQL: one
        INSERT from one JSON array of the rows, whatever their count; SQLite: one multi-row
        INSERT per 1000 rows."""
        if not rows:
            return []
        table = self.tables.outgoing
        columns = {key for row in rows for key in row}
        if self.is_postgres:
            # the rows as one JSON parameter: the same short statement at any row count, so psycopg
            # and PostgreSQL parse and plan it once, and one string to send, not a value per cell
            names = tuple(sorted(columns))
            return sorted(conn.execute(_insert_from_json(table, names), {"rows": _json_rows(rows, names)}).scalars())
        rows = [{key: row.get(key) for key in columns} for row in rows]
        ids: list[int] = []
        for start in range(0, len(rows), INSERT_CHUNK):
            # one explicit multi-row INSERT; SQLite's rowids ascend in VALUES order under the
            # store's exclusive write lock
            statement = table.insert().values(rows[start:start + INSERT_CHUNK]).returning(table.c.id)
            ids.extend(sorted(conn.execute(statement).scalars()))
        return ids

    def _id_predicate(self, column, ids: Sequence[int]):
        if self.is_postgres:
            return column == func.any(bindparam("ids", list(ids), type_=postgresql.ARRAY(BigInteger)))
        return column.in_(list(ids))

    def delete_outgoing(self, conn: Connection, ids: Sequence[int]) -> int:
        """Delete rows in one statement (``= ANY(array)`` on PostgreSQL)."""
        if not ids:
            return 0
        table = self.tables.outgoing
        return conn.execute(delete(table).where(self._id_predicate(table.c.id, ids))).rowcount

    def finish_sent(self, conn: Connection, ids: Sequence[int], now: datetime, redeliver_at: datetime | None,
                    record: bool = False) -> int:
        """After a publish of unsent rows, in one statement: keep the rows as sent until the
        consuming inbox acknowledges them (redelivered at ``redeliver_at`` if it has not), or,
        with delivery tracking off (``redeliver_at`` None), delete them. With ``record`` (an
        archive is configured) each send is also written to the ``sent`` table."""
        if not ids:
            return 0
        table = self.tables.outgoing
        if record:
            self.record_sent(conn, ids, now)
        if redeliver_at is None:
            return self.delete_outgoing(conn, ids)
        return conn.execute(
            update(table).where(self._id_predicate(table.c.id, ids))
            .values(sent_at=func.coalesce(table.c.sent_at, now), redeliver_at=redeliver_at)
        ).rowcount

    def record_sent(self, conn: Connection, ids: Sequence[int], now: datetime) -> None:
        """Write the first send of the given rows, at ``now``, to the ``sent`` table (the audit's)."""
        table, sent = self.tables.outgoing, self.tables.sent
        conn.execute(sent.insert().from_select(
            [*RECORD_COLUMNS, "sent_at"],
            select(*(table.c[name] for name in RECORD_COLUMNS), bindparam("sent_now", now, type_=sent.c.sent_at.type))
            .where(self._id_predicate(table.c.id, ids))))

    def record_sends(self, conn: Connection, rows: Sequence[Row], now: datetime) -> None:
        """Write the sends of rows already taken out of the table (``take_outgoing_to_delete``
        with ``record``), at ``now``, to the ``sent`` table, in one statement."""
        if rows:
            conn.execute(self.tables.sent.insert(),
                         [{**{name: row._mapping[name] for name in RECORD_COLUMNS}, "sent_at": now} for row in rows])

    def take_outgoing(self, conn: Connection, ids: Sequence[int], now: datetime, redeliver_at: datetime) -> list[int]:
        """Before publishing them: lock the given rows that still exist, are unsent and no relay
        holds, and mark them sent (redelivered at ``redeliver_at`` unless acknowledged), in one
        statement; return their ids. The marks commit with the caller's transaction, after the
        publish; ``unmark_sent`` takes them back from rows whose publish failed."""
        if not ids:
            return []
        table = self.tables.outgoing
        return list(conn.execute(
            update(table).where(table.c.id.in_(self._unsent_unlocked(ids)))
            .values(sent_at=now, redeliver_at=redeliver_at).returning(table.c.id)).scalars())

    def take_outgoing_to_delete(self, conn: Connection, ids: Sequence[int], record: bool = False) -> list[Row]:
        """Before publishing them, with delivery tracking off: delete the given rows that still
        exist, are unsent and no relay holds, in one statement; return their ``id`` (and, with
        ``record``, the columns ``record_sends`` writes). The delete commits with the caller's
        transaction, after the publish; a caller whose publish failed rolls it back, and
        finishes the published rows alone (``finish_sent``) in a new one."""
        if not ids:
            return []
        table = self.tables.outgoing
        returned = [table.c.id, *(table.c[name] for name in RECORD_COLUMNS)] if record else [table.c.id]
        return list(conn.execute(delete(table).where(table.c.id.in_(self._unsent_unlocked(ids))).returning(*returned)))

    def postpone_redelivery(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Set the ``redeliver_at`` of sent rows (``id``, ``redeliver_at``), in one statement: a
        scheduled message released before its eta is held by the worker until then, and its
        redelivery counts from its eta."""
        if rows:
            table = self.tables.outgoing
            conn.execute(update(table).where(table.c.id == bindparam("row_id"))
                         .values(redeliver_at=bindparam("postponed_to")),
                         [{"row_id": r["id"], "postponed_to": r["redeliver_at"]} for r in rows])

    def unmark_sent(self, conn: Connection, ids: Sequence[int]) -> None:
        """Rows ``take_outgoing`` marked whose publish failed: unsent again, for the relay."""
        if ids:
            table = self.tables.outgoing
            conn.execute(update(table).where(self._id_predicate(table.c.id, ids))
                         .values(sent_at=None, redeliver_at=None))

    def acknowledge_outgoing(self, conn: Connection, message_id: str, destination: str | None,
                             attempt: tuple[int, int, int], send_id: str = "") -> int:
        """The consuming inbox has attempt ``attempt`` (nesting, replays, retries) of the message
        sent as ``send_id``, or a later one: delete that send's outgoing rows up to that attempt (of
        ``destination`` only, when given). A later attempt (a scheduled retry) stays, and so do the
        rows of another send of the same task id. A row a publisher holds is waited
        for (PostgreSQL row lock, SQLite write lock), so an acknowledgment that overtakes its own
        publisher's commit still deletes the row."""
        table = self.tables.outgoing
        query = delete(table).where(table.c.message_id == message_id, table.c.send_id == send_id).where(
            tuple_(table.c.nesting, table.c.replays, table.c.retries) <= tuple_(*attempt))
        if destination is not None:
            query = query.where(table.c.destination == destination)
        return conn.execute(query).rowcount

    def lock_sent_records(self, conn: Connection, limit: int) -> list[Row]:
        """Lock up to ``limit`` records of sent messages, oldest first (to archive, then delete)."""
        table = self.tables.sent
        query = select(table).order_by(table.c.id).limit(limit)
        if self.is_postgres:
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query))

    def delete_sent_records(self, conn: Connection, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        table = self.tables.sent
        return conn.execute(delete(table).where(self._id_predicate(table.c.id, ids))).rowcount

    def lock_unacknowledged_outgoing(self, conn: Connection, now: datetime, limit: int) -> list[Row]:
        """Lock up to ``limit`` sent rows whose consumer has not acknowledged them by ``redeliver_at``,
        read in the order of the ``redeliver_at`` index (see ``lock_pending_outgoing``)."""
        table = self.tables.outgoing
        query = select(table).where(table.c.redeliver_at <= now).order_by(table.c.redeliver_at).limit(limit)
        if self.is_postgres:
            self._read_in_index_order(conn)
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query))

    def mark_redelivered(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Count a redelivery of each row (``id``, ``redeliver_at``: the next one)."""
        if rows:
            table = self.tables.outgoing
            conn.execute(
                update(table).where(table.c.id == bindparam("row_id"))
                .values(redeliveries=table.c.redeliveries + 1, redeliver_at=bindparam("next_redelivery")),
                [{"row_id": r["id"], "next_redelivery": r["redeliver_at"]} for r in rows],
            )

    def _unsent_unlocked(self, ids: Sequence[int]):
        """SELECT the ids among ``ids`` of rows that exist and are unsent, locking them, skipping
        the ones another transaction holds (SQLite: the store's write lock serialises instead)."""
        table = self.tables.outgoing
        query = select(table.c.id).where(self._id_predicate(table.c.id, ids)).where(table.c.sent_at.is_(None))
        return query.with_for_update(skip_locked=True) if self.is_postgres else query

    def lock_pending_outgoing(self, conn: Connection, limit: int, release_before: datetime,
                              after_id: int = 0) -> list[Row]:
        """Lock up to ``limit`` unsent outgoing rows with ``id > after_id``, oldest first, that are
        released: no ``deliver_at`` (eta), or one before ``release_before``
        (``OutboxSettings.release_before``).

        ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so concurrent relays take disjoint
        rows; on SQLite the ``BEGIN IMMEDIATE`` write lock gives the same guarantee.
        The rows stay locked until the caller deletes them and commits; if the caller
        dies, the database releases them.

        On PostgreSQL the rows are read in the order of the ``(sent_at, id)`` index (see
        ``_read_in_index_order``).
        """
        table = self.tables.outgoing
        query = (
            select(table)
            .where(table.c.sent_at.is_(None))
            .where((table.c.deliver_at.is_(None)) | (table.c.deliver_at <= release_before))
            .where(table.c.id > after_id)
            .order_by(table.c.sent_at, table.c.id)
            .limit(limit)
        )
        if self.is_postgres:
            self._read_in_index_order(conn)
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query))

    @staticmethod
    def _read_in_index_order(conn: Connection) -> None:
        """PostgreSQL: no sorting for the rest of this transaction, so a batch query ordered like
        an index walks that index and stops at its limit. A backlog piles up faster than
        autovacuum analyzes the table, and on such stale statistics the planner otherwise reads
        and sorts every matching row for each batch (70 ms per batch of 500 at 100 k unsent
        rows, instead of 0.5 ms)."""
        conn.exec_driver_sql("SET LOCAL enable_sort = off")

    def limit_lock_holding(self, conn: Connection, seconds: float | None) -> None:
        """PostgreSQL: end this session if it idles in its transaction longer than ``seconds``
        (a publish hung on the broker), so the rows it locked go to another relay."""
        if self.is_postgres and seconds:
            conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {int(seconds * 1000)}")

    def record_outgoing_failure(self, conn: Connection, row_id: int, error: str) -> int:
        """Count a failed publish of one row; returns the row's attempts so far."""
        table = self.tables.outgoing
        return conn.execute(
            update(table)
            .where(table.c.id == row_id)
            .values(attempts=table.c.attempts + 1, last_error=error[:4000])
            .returning(table.c.attempts)
        ).scalar_one()

    def count_outgoing(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.outgoing, conn)

    def _count(self, table, conn: Connection | None) -> int:
        query = select(func.count()).select_from(table)
        if conn is not None:
            return conn.execute(query).scalar_one()
        with self.begin() as own:
            return own.execute(query).scalar_one()

    # -- dead letters --------------------------------------------------------------------------

    def insert_dead_letters(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            columns = {key for row in rows for key in row}
            conn.execute(self.tables.dead_letters.insert(), [{k: row.get(k) for k in columns} for row in rows])

    def count_dead_letters(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.dead_letters, conn)

    def dead_letter_filter(self, *, ids: Sequence[int] | None = None, task: str | None = None,
                           queue: str | None = None, exception: str | None = None, reason: str | None = None,
                           since: datetime | None = None, failed_before: datetime | None = None):
        """SQL: the dead letters matching every given criterion (all of them when none is)."""
        table = self.tables.dead_letters
        clauses = []
        if ids is not None:
            clauses.append(table.c.id.in_(list(ids)))
        if task:
            clauses.append(table.c.task_name == task)
        if queue:
            clauses.append(table.c.queue == queue)
        if exception:
            clauses.append(table.c.exception_type == exception)
        if reason:
            clauses.append(table.c.reason == reason)
        if since is not None:
            clauses.append(table.c.failed_at >= since)
        if failed_before is not None:
            clauses.append(table.c.failed_at < failed_before)
        return and_(true(), *clauses)

    def list_dead_letters(self, where, limit: int | None = None, after_id: int = 0) -> list[Row]:
        """Dead letters matching ``where``, oldest first, without their bodies and tracebacks."""
        table = self.tables.dead_letters
        columns = [c for c in table.c if c.name not in ("body", "traceback", "headers", "properties")]
        query = select(*columns).where(where).where(table.c.id > after_id).order_by(table.c.id)
        if limit is not None:
            query = query.limit(limit)
        with self.begin() as conn:
            return list(conn.execute(query))

    def count_matching_dead_letters(self, where) -> int:
        with self.begin() as conn:
            return conn.execute(select(func.count()).select_from(self.tables.dead_letters).where(where)).scalar_one()

    def get_dead_letter(self, dead_letter_id: int) -> Row | None:
        table = self.tables.dead_letters
        with self.begin() as conn:
            return conn.execute(select(table).where(table.c.id == dead_letter_id)).first()

    def lock_dead_letters(self, conn: Connection, where, limit: int, full: bool = True,
                          after_id: int = 0) -> list[Row]:
        """Lock up to ``limit`` dead letters matching ``where`` with ``id > after_id``, oldest first."""
        table = self.tables.dead_letters
        query = select(*(table.c if full else [table.c.id])).where(where).where(table.c.id > after_id) \
            .order_by(table.c.id).limit(limit)
        if self.is_postgres:
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query))

    def mark_replayed(self, conn: Connection, ids: Sequence[int], now: datetime) -> None:
        """Count one replay of each dead letter."""
        if ids:
            table = self.tables.dead_letters
            conn.execute(update(table).where(self._id_predicate(table.c.id, ids))
                         .values(replay_count=table.c.replay_count + 1, replayed_at=now))

    def delete_dead_letters(self, conn: Connection, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        table = self.tables.dead_letters
        return conn.execute(delete(table).where(self._id_predicate(table.c.id, ids))).rowcount

    # -- incoming ------------------------------------------------------------------------------

    def _upsert(self, table):
        return (postgresql.insert if self.is_postgres else sqlite.insert)(table)

    @functools.cached_property
    def _insert_new_incoming(self):
        """``INSERT ... ON CONFLICT DO NOTHING RETURNING``, built once: the row comes as parameters,
        so SQLAlchemy compiles it once per set of columns (building ``.values(**row)`` for every
        claim cost more than running it)."""
        table = self.tables.incoming
        return (self._upsert(table).on_conflict_do_nothing(index_elements=_INCOMING_KEY)
                .returning(table.c.message_id))

    def insert_incoming(self, conn: Connection, row: dict[str, Any]) -> bool:
        """Insert an inbox row; False (and nothing written) when its key exists.

        ``INSERT ... ON CONFLICT DO NOTHING``; a concurrent insert of the same key
        waits for the first transaction and then conflicts.
        """
        if self.is_postgres and self._can_open_in_one_message(conn):  # its BEGIN goes with it: one round trip
            return self._insert_incoming_in_one_message(conn, row, (b"BEGIN",))
        return conn.execute(self._insert_new_incoming, row).first() is not None

    def _owner_is_dead(self, table, silent_before: datetime | None):
        """SQL: the row's owner node is gone (declared dead or deregistered) or, on PostgreSQL,
        silent (no heartbeat since ``silent_before``) with its advisory liveness lock free: its
        process is gone. A live node whose liveness connection dropped keeps heartbeating while
        it takes its lock again, so it is never taken for dead."""
        nodes = self.tables.nodes
        gone = ~select(nodes.c.id).where(nodes.c.id == table.c.owner, nodes.c.dead_at.is_(None)) \
            .correlate(table).exists()
        if not self.is_postgres or silent_before is None:
            return gone
        silent = select(nodes.c.id).where(nodes.c.id == table.c.owner, nodes.c.heartbeat_at < silent_before) \
            .correlate(table).exists()
        return gone | self._silent_and_unlocked(silent, table.c.owner)

    def _silent_and_unlocked(self, silent, node_id_column):
        """SQL: ``silent`` and the node's liveness lock free, the lock tried only for a silent node
        (trying it takes it for the rest of the transaction)."""
        return case((silent, self._liveness_lock_free(node_id_column)), else_=false())

    def claim_incoming(self, conn: Connection, row: dict[str, Any], stale_before: datetime | None = None,
                       silent_before: datetime | None = None) -> bool:
        """Claim a received message for one attempt; False when it is a duplicate.

        ``row`` carries the key, the attempt (``nesting``, ``retries``), the new
        ``status`` (``handled`` for an optimistic claim inside the body's transaction,
        ``running`` for an eager claim), ``owner`` and ``claimed_at``. An attempt is
        ordered by (``nesting``, ``replays``, ``retries``). One
        ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` statement: an existing row is
        taken over only by

        * a ``replace`` (greater ``nesting``), always;
        * a later attempt of a row that ended in a retry or is still running (a retry,
          or Celery re-sending the task of a lost worker process);
        * a dead-letter replay (greater ``replays``) of a row that ended dead;
        * the same attempt of a running row whose owner is unowned (released), dead (see
          ``_owner_is_dead``: silent since ``silent_before`` and unlocked counts), or claimed
          before ``stale_before``: a recovery, not a duplicate.

        A concurrent claim of the same key waits for the first transaction, then
        re-checks these conditions against the committed row.
        """
        return self.insert_incoming(conn, row) or self._take_over_incoming(conn, row, stale_before, silent_before)

    def _take_over_incoming(self, conn: Connection, row: dict[str, Any], stale_before: datetime | None,
                            silent_before: datetime | None) -> bool:
        """The key exists (or a concurrent claim just committed it): a second statement, with a
        fresh snapshot, decides whether this delivery may take the row over."""
        table = self.tables.incoming
        insert = self._upsert(table).values(**row)
        new = insert.excluded
        same_attempt = (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (
            new.retries == table.c.retries)
        free = (table.c.owner == UNOWNED) | self._owner_is_dead(table, silent_before)
        if stale_before is not None:
            free = free | (table.c.claimed_at < stale_before)
        claimable = (
            (new.nesting > table.c.nesting)
            | (table.c.status.in_(("retried", "running")) & _later_attempt(new, table))
            | ((table.c.status == "dead") & (new.nesting == table.c.nesting) & (new.replays > table.c.replays))
            | ((table.c.status == "running") & same_attempt & free)
        )
        updates = {key: getattr(new, key) for key in row
                   if key not in (*_INCOMING_KEY, "received_at", "recoveries")}
        updates = {k: v for k, v in updates.items() if k not in _ENVELOPE_KEYS or row.get(k) is not None}
        statement = (
            insert.on_conflict_do_update(
                index_elements=_INCOMING_KEY, set_=updates, where=claimable
            ).returning(table.c.message_id)
        )
        return conn.execute(statement).first() is not None

    def claim_incoming_alone(self, row: dict[str, Any], stale_before: datetime | None = None,
                             then_begin: Connection | None = None, silent_before: datetime | None = None) -> bool:
        """``claim_incoming`` in a transaction of its own that commits without waiting for the
        WAL flush (``begin(durable=False)``): the eager claim, made durable by the body's commit.

        On PostgreSQL a new key, the common case, costs one round trip instead of four: BEGIN,
        ``SET LOCAL synchronous_commit TO OFF``, the ``INSERT ... ON CONFLICT DO NOTHING`` and
        COMMIT go in one network write (``_insert_incoming_in_one_message``). Given
        ``then_begin``, a connection between transactions, the claim goes on it and a BEGIN
        follows the COMMIT in the same write: the body's transaction is open when the claim
        returns, and the body's first statement does not wait for a BEGIN of its own. A key
        that exists already takes ``claim_incoming``'s second statement in a transaction of
        its own; the first wrote nothing."""
        inserted = None
        if self.is_postgres:
            try:
                conn = then_begin if then_begin is not None else self.engine.connect()
                try:
                    if self._can_open_in_one_message(conn):
                        inserted = self._insert_incoming_in_one_message(
                            conn, row, (b"BEGIN", b"SET LOCAL synchronous_commit TO OFF"),
                            (b"COMMIT",) if then_begin is None else (b"COMMIT", b"BEGIN"))
                finally:
                    if then_begin is None:
                        conn.close()
            except OperationalError as exc:
                raise self.unavailable(exc) from exc
        if inserted:
            return True
        with self.begin(durable=False) as conn:
            if inserted is None:  # not sent as one message
                return self.claim_incoming(conn, row, stale_before, silent_before)
            return self._take_over_incoming(conn, row, stale_before, silent_before)

    def _can_open_in_one_message(self, conn: Connection) -> bool:
        """PostgreSQL: ``conn`` is between transactions, and a message sent on it may open its own."""
        return self._opening(conn) == (b"BEGIN",)

    def _opening(self, conn: Connection) -> tuple[bytes, ...] | None:
        """PostgreSQL: what statements sent in one message on ``conn`` must start with: ``(b"BEGIN",)``
        when its psycopg connection is between transactions in the default transaction mode (they
        open the transaction themselves, as psycopg would have), ``()`` inside a transaction, and
        None when they cannot go in one message (another driver, a libpq without pipeline mode, a
        transaction in error, or non-default transaction settings)."""
        if conn.dialect.driver != "psycopg" or not _pipeline_supported():
            return None
        driver = conn.connection.driver_connection
        status = driver.pgconn.transaction_status
        if status == _PSYCOPG_INTRANS:
            return ()
        if (status == _PSYCOPG_IDLE and not driver.autocommit and driver.isolation_level is None
                and driver.read_only is None and driver.deferrable is None):
            return (b"BEGIN",)
        return None

    def _insert_incoming_in_one_message(self, conn: Connection, row: dict[str, Any], before: tuple[bytes, ...],
                                        after: tuple[bytes, ...] = ()) -> bool:
        """PostgreSQL: the statements ``before``, the inbox INSERT ... ON CONFLICT DO NOTHING
        RETURNING and the statements ``after`` in one message (``_send_one_message``); True when
        the row went in."""
        claim = _pipelined_query(self._insert_new_incoming, conn.dialect, tuple(row), "claim")
        result, _ = self._send_one_message(conn, claim, row, before, after)
        return result.ntuples > 0

    def _send_one_message(self, conn: Connection, query: _PipelinedQuery, values: dict[str, Any],
                          before: tuple[bytes, ...], after: tuple[bytes, ...],
                          tolerate: tuple[str, ...] = ()) -> tuple[Any, str | None]:
        """PostgreSQL: the statements ``before``, ``query`` with ``values`` and the statements
        ``after``, queued in libpq's pipeline mode and sent with one Sync in one network write.
        Returns (``query``'s result, None), or (None, the SQLSTATE) when a statement failed with
        one of the SQLSTATEs ``tolerate`` names: the transaction is then in error, for the caller
        to roll back. Any other error is raised as psycopg would have (``StoreUnavailable`` when
        the connection is lost).

        The values travel as parameters, in text. A message that opens its transaction
        (``before`` starts with BEGIN) sends ``query`` as a statement prepared once per
        connection (its Parse goes with its first message); when that statement turns out to
        be gone (psycopg deallocates every prepared statement on a rollback once it prepared
        some of its own) or there already, it is put right and the message sent again: nothing
        but the message itself ran in that transaction. A message inside a transaction could
        not be sent again: there ``query`` goes prepared only when it is known to be (the
        connection's set of prepared names follows psycopg's deallocations:
        ``_prepared_statements``); otherwise it goes as an unnamed statement, parsed, and is
        prepared before the connection's next message that opens a transaction, where a
        Parse that fails harms nothing. With psycopg's prepared statements off
        (``prepare_threshold = None``, as behind a transaction-pooling PgBouncer) every
        statement goes unnamed."""
        import psycopg

        driver = conn.connection.driver_connection
        prepared, to_prepare = _prepared_statements(conn)
        in_step = (_PG_NO_SUCH_PREPARED, _PG_PREPARED_EXISTS)
        opens = before[:1] == (b"BEGIN",)
        try:
            if opens and to_prepare:
                self._prepare_ahead(conn, prepared, to_prepare)
            named = opens or (to_prepare is not None and query.name in prepared)
            if not named and to_prepare is not None and driver.prepare_threshold is not None:
                to_prepare[query.name] = query.statement
            result, failed = self._run_one_message(conn, query, prepared, before, after, values, named=named)
            if failed is not None and opens:
                sqlstate = self._error_of(conn, failed, expected=(*in_step, *tolerate))
                if sqlstate in in_step:
                    driver.rollback()
                    (prepared.discard if sqlstate == _PG_NO_SUCH_PREPARED else prepared.add)(query.name)
                    result, failed = self._run_one_message(conn, query, prepared, before, after, values,
                                                           named=True)
            if failed is not None:
                if _sqlstate(failed) == _PG_NO_SUCH_PREPARED:  # gone behind psycopg's back: prepare it anew
                    prepared.discard(query.name)
                return None, self._error_of(conn, failed, expected=tolerate)
        except psycopg.Error as exc:  # from libpq or psycopg's adaptation of the values
            if conn.invalidated or driver.pgconn.status != _PSYCOPG_CONNECTION_OK:
                if not conn.invalidated:
                    conn.invalidate()
                raise self.unavailable(exc) from exc
            raise DBAPIError.instance(query.statement, values, exc, psycopg.Error) from exc
        return result, None

    def _prepare_ahead(self, conn: Connection, prepared: set[str], to_prepare: dict[str, str]) -> None:
        """Between transactions, in one round trip: prepare the statements a message inside a
        transaction sent unnamed (``_send_one_message``). One that exists already counts as
        prepared; one that failed otherwise is left to go unnamed. Nothing runs in a
        transaction, so a failed Parse costs nothing else."""
        driver = conn.connection.driver_connection
        wanted = list(to_prepare.items())
        to_prepare.clear()
        if driver.prepare_threshold is None:
            return
        encoding = driver.info.encoding

        def send(pgconn: Any) -> None:
            for name, statement in wanted:
                pgconn.send_prepare(name.encode(), statement.encode(encoding))

        results = _exchange_on(conn, send)
        for (name, _), result in zip(wanted, results, strict=True):
            if result.status == _COMMAND_OK or _sqlstate(result) == _PG_PREPARED_EXISTS:
                prepared.add(name)

    def _run_one_message(self, conn: Connection, query: _PipelinedQuery, prepared: set[str],
                         before: tuple[bytes, ...], after: tuple[bytes, ...], values: dict[str, Any],
                         named: bool) -> tuple[Any, Any]:
        """Send the pipeline; (``query``'s result, the first result that is an error or None).
        ``query`` goes as a prepared statement when ``named`` and psycopg's prepared statements
        are on; it counts as prepared on the connection once its Parse succeeded, whatever came
        after."""
        from psycopg.adapt import PyFormat, Transformer

        driver = conn.connection.driver_connection
        params = Transformer(driver).dump_sequence([values[key] for key in query.keys],
                                                   [PyFormat.TEXT] * len(query.keys))
        statement, name = query.statement.encode(driver.info.encoding), query.name.encode()
        unnamed = not named or driver.prepare_threshold is None
        prepare = not unnamed and query.name not in prepared

        def send(pgconn: Any) -> None:
            if prepare:
                pgconn.send_prepare(name, statement)
            for each in before:
                pgconn.send_query_params(each, None)
            if unnamed:
                pgconn.send_query_params(statement, params)
            else:
                pgconn.send_query_prepared(name, params)
            for each in after:
                pgconn.send_query_params(each, None)

        results = _exchange_on(conn, send)
        if prepare and results[0].status == _COMMAND_OK:
            prepared.add(query.name)
        failed = next((result for result in results if result.status not in (_COMMAND_OK, _TUPLES_OK)), None)
        return results[len(before) + prepare], failed

    def _error_of(self, conn: Connection, result: Any, expected: tuple[str, ...]) -> str:
        """The SQLSTATE of the error ``result`` carries when it is one of ``expected``; otherwise
        raise it as psycopg would have."""
        import psycopg

        driver = conn.connection.driver_connection
        message = (result.error_message or driver.pgconn.error_message).decode(errors="replace").strip()
        sqlstate = _sqlstate(result)
        if sqlstate in expected and driver.pgconn.status == _PSYCOPG_CONNECTION_OK:
            return sqlstate
        raise (psycopg.errors.lookup(sqlstate) if sqlstate else psycopg.OperationalError)(message)

    @functools.cached_property
    def _finish_incoming(self):
        """The UPDATE that marks an eager claim handled, built once: its values are the named
        parameters, its constants written in the statement."""
        table = self.tables.incoming
        return (
            update(table)
            .where(table.c.message_id == bindparam("key_id"), table.c.destination == bindparam("key_destination"))
            .where(table.c.send_id == bindparam("key_send"))
            .where(table.c.owner == bindparam("claim_owner"), is_running(table))
            .where(table.c.nesting == bindparam("claim_nesting"), table.c.replays == bindparam("claim_replays"))
            .where(table.c.retries == bindparam("claim_retries"))
            .values(status=literal_column("'handled'"), owner=literal_column(str(UNOWNED)),
                    handled_at=bindparam("finished_at"), keep_until=bindparam("finished_keep_until"))
        )

    @functools.cached_property
    def _finish_incoming_or_fail(self):
        """PostgreSQL: ``_finish_incoming`` as a query that fails (division by zero) when it marks
        no row, so that a COMMIT sent right behind it does not commit a claim no longer ours."""
        finished = self._finish_incoming.returning(literal_column("1")).cte("finished")
        return select(literal_column("1") / func.count()).select_from(finished)

    def finish_incoming(self, conn: Connection, message_id: str, destination: str, owner: int,
                        attempt: tuple[int, int, int], now: datetime, keep_until: datetime,
                        commit: bool = False, send_id: str = "") -> bool:
        """Mark an eagerly claimed row handled, inside the body's transaction; False when
        the claim is no longer ours (another node took it over): the caller rolls back.
        ``attempt`` is (nesting, replays, retries).

        With ``commit``, the last statement of the body's transaction, on PostgreSQL the
        transaction's COMMIT goes with it in one round trip (and its BEGIN too when the body
        wrote nothing): the UPDATE is sent as a query that fails when it marks no row, so a claim
        no longer ours aborts the transaction instead of committing it. The caller's own commit
        then finds the transaction ended (psycopg sends nothing); it still ends SQLAlchemy's."""
        nesting, replays, retries = attempt
        values = {
            "key_id": message_id, "key_destination": destination, "key_send": send_id, "claim_owner": owner,
            "claim_nesting": nesting, "claim_replays": replays, "claim_retries": retries,
            "finished_at": now, "finished_keep_until": keep_until,
        }
        opening = self._opening(conn) if commit and self.is_postgres else None
        if opening is not None:
            finish = _pipelined_query(self._finish_incoming_or_fail, conn.dialect, tuple(values), "finish")
            _, failed = self._send_one_message(conn, finish, values, opening, (b"COMMIT",),
                                               tolerate=(_PG_DIVISION_BY_ZERO,))
            return failed is None
        return conn.execute(self._finish_incoming, values).rowcount == 1

    def record_outcome(self, conn: Connection, row: dict[str, Any]) -> None:
        """Record how an attempt ended without committing its effects (``retried`` or
        ``dead``), unless a later attempt or a handled row is already there."""
        table = self.tables.incoming
        insert = self._upsert(table).values(**row)
        new = insert.excluded
        same_attempt = (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (
            new.retries == table.c.retries)
        not_older = _later_attempt(new, table) | same_attempt
        updates = {key: getattr(new, key) for key in row if key not in (*_INCOMING_KEY, "received_at")}
        updates = {k: v for k, v in updates.items() if k not in _ENVELOPE_KEYS or row.get(k) is not None}
        conn.execute(insert.on_conflict_do_update(
            index_elements=_INCOMING_KEY, set_=updates,
            where=not_older & (table.c.status != "handled"),
        ))

    def claim_in_flight(self, conn: Connection, message_id: str, destination: str,
                        attempt: tuple[int, int, int], send_id: str = "") -> bool:
        """Whether the message's row is a running claim of this very attempt (nesting, replays,
        retries): after a claim that failed, its owner is alive and may still finish it, so a
        copy of it is not a duplicate yet."""
        table = self.tables.incoming
        nesting, replays, retries = attempt
        return conn.execute(
            select(table.c.message_id).where(
                table.c.message_id == message_id, table.c.destination == destination,
                table.c.send_id == send_id, is_running(table), table.c.nesting == nesting,
                table.c.replays == replays, table.c.retries == retries)
        ).first() is not None

    def count_duplicate(self, conn: Connection, message_id: str, destination: str, send_id: str = "") -> None:
        table = self.tables.incoming
        conn.execute(
            update(table)
            .where(table.c.message_id == message_id, table.c.destination == destination, table.c.send_id == send_id)
            .values(duplicates=table.c.duplicates + 1)
        )

    def get_incoming(self, message_id: str, destination: str = "", send_id: str | None = None) -> Row | None:
        """The inbox row of a message (of its send ``send_id``; None: its latest send's)."""
        table = self.tables.incoming
        query = select(table).where(table.c.message_id == message_id, table.c.destination == destination)
        if send_id is not None:
            query = query.where(table.c.send_id == send_id)
        with self.begin() as conn:
            return conn.execute(query.order_by(table.c.received_at.desc()).limit(1)).first()

    def count_incoming(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.incoming, conn)

    def release_stale_incoming(self, conn: Connection, claimed_before: datetime, limit: int, now: datetime) -> int:
        """Release up to ``limit`` running rows claimed before ``claimed_before`` (opt-in stale time)."""
        table = self.tables.incoming
        return self._release_incoming(conn, is_running(table) & (table.c.owner != UNOWNED)
                                      & (table.c.claimed_at < claimed_before), limit, now)

    def _release_incoming(self, conn: Connection, where, limit: int, now: datetime) -> int:
        """Release up to ``limit`` claims matching ``where`` (skipping locked rows); due for recovery at once."""
        table = self.tables.incoming
        keys = select(*_incoming_key(table)).where(where).limit(limit)
        if self.is_postgres:
            keys = keys.with_for_update(skip_locked=True)
        return conn.execute(
            update(table).where(tuple_(*_incoming_key(table)).in_(keys))
            .values(owner=UNOWNED, recover_after=now)
        ).rowcount

    def lock_recoverable_incoming(self, conn: Connection, now: datetime, limit: int) -> list[Row]:
        """Lock up to ``limit`` stranded envelopes: running, unowned, due for recovery.

        On PostgreSQL ``SKIP LOCKED`` also skips the row of an optimistic claim still in
        flight (its ``ON CONFLICT DO UPDATE`` holds the row lock) and rows another
        recover run holds; on SQLite a body in flight holds the write lock.
        """
        table = self.tables.incoming
        query = (
            select(table)
            .where(is_running(table), table.c.owner == UNOWNED, table.c.recover_after <= now)
            .order_by(table.c.recover_after)
            .limit(limit)
        )
        if self.is_postgres:
            query = query.with_for_update(skip_locked=True)
        return list(conn.execute(query))

    def mark_recovered(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Count a re-publish of each row (``message_id``, ``destination``, ``send_id``, ``recover_after``)."""
        if not rows:
            return
        table = self.tables.incoming
        conn.execute(
            update(table)
            .where(table.c.message_id == bindparam("key_id"), table.c.destination == bindparam("key_destination"))
            .where(table.c.send_id == bindparam("key_send"))
            .values(recoveries=table.c.recoveries + 1, recover_after=bindparam("next_recovery")),
            [{"key_id": r["message_id"], "key_destination": r["destination"], "key_send": r["send_id"],
              "next_recovery": r["recover_after"]} for r in rows],
        )

    def mark_incoming_dead(self, conn: Connection, keys: Sequence[tuple[str, str, str]], now: datetime,
                           keep_until: datetime) -> None:
        """End running rows of ``keys`` (message id, destination, send id) as ``dead`` (recovery gave
        up on them)."""
        if not keys:
            return
        table = self.tables.incoming
        conn.execute(
            update(table).where(tuple_(*_incoming_key(table)).in_(list(keys)))
            .values(status="dead", owner=UNOWNED, handled_at=now, keep_until=keep_until, recover_after=None)
        )

    def delete_expired_incoming(self, conn: Connection, now: datetime, limit: int,
                                after: datetime | None = None) -> "ExpiredDeleted":
        """Delete up to ``limit`` ended rows whose ``keep_until`` passed (and, with ``after``, is not
        before it), oldest first; one statement. Returns the count, an int whose ``last_keep_until`` is
        the latest ``keep_until`` deleted: the next batch of a run passes it as ``after``.

        On PostgreSQL the rows are locked (``SKIP LOCKED``) and deleted by ``ctid``, with no join back
        through the primary key. ``after`` matters there: deleted rows stay in the ``keep_until`` index
        until vacuum, and while any transaction older than the delete is open (a task body in its unit
        of work) each of them costs the next batch's scan a heap visit; without ``after`` every batch
        of a run would wade through all the rows the run deleted before it.
        """
        table = self.tables.incoming
        if not self.is_postgres:
            return ExpiredDeleted(conn.execute(
                delete(table).where(tuple_(*_incoming_key(table)).in_(
                    self._expired_incoming(now, limit, _incoming_key(table), after)))
            ).rowcount)
        ctid = literal_column("ctid")
        expired = self._expired_incoming(now, limit, (ctid,), after).select_from(table)
        gone = (delete(table).where(ctid == func.any(func.array(expired.scalar_subquery())))
                .returning(table.c.keep_until).cte("gone"))
        count, last = conn.execute(select(func.count(), func.max(gone.c.keep_until))).one()
        return ExpiredDeleted(count, last)

    def lock_expired_incoming(self, conn: Connection, now: datetime, limit: int,
                              after: datetime | None = None) -> list[Row]:
        """Lock up to ``limit`` ended rows whose ``keep_until`` passed (and is not before ``after``),
        oldest first (to archive, then delete)."""
        table = self.tables.incoming
        return list(conn.execute(self._expired_incoming(now, limit, tuple(table.c), after)))

    def _expired_incoming(self, now: datetime, limit: int, columns: tuple, after: datetime | None = None):
        table = self.tables.incoming
        query = select(*columns).where(table.c.keep_until < now)
        if after is not None:
            query = query.where(table.c.keep_until >= after)
        query = query.order_by(table.c.keep_until).limit(limit)
        if self.is_postgres:
            query = query.with_for_update(skip_locked=True)
        return query

    def delete_incoming(self, conn: Connection, keys: Sequence[tuple[str, str, str]]) -> int:
        """Delete the rows of ``keys`` (message id, destination, send id); on PostgreSQL three array
        parameters (``unnest``) instead of three bound parameters a row."""
        if not keys:
            return 0
        table = self.tables.incoming
        key = tuple_(*_incoming_key(table))
        if not self.is_postgres:
            return conn.execute(delete(table).where(key.in_(list(keys)))).rowcount
        strings = postgresql.ARRAY(table.c.message_id.type)
        triples = select(func.unnest(bindparam("key_ids", [k[0] for k in keys], type_=strings)),
                         func.unnest(bindparam("key_destinations", [k[1] for k in keys], type_=strings)),
                         func.unnest(bindparam("key_sends", [k[2] for k in keys], type_=strings)))
        return conn.execute(delete(table).where(key.in_(triples))).rowcount

    # -- nodes ---------------------------------------------------------------------------------

    def register_node(self, name: str, hostname: str, pid: int, now: datetime | None = None,
                      conn: Connection | None = None, lock_key=None) -> int:
        """Insert a node row and return its id.

        With ``conn`` and ``lock_key`` (PostgreSQL), the row is inserted on ``conn``
        and the node's session advisory lock is taken before the commit: no recover
        run can see the node without its liveness lock held.
        """
        now = now or utcnow()
        table = self.tables.nodes
        statement = (
            table.insert().values(name=name, hostname=hostname, pid=pid, started_at=now, heartbeat_at=now)
            .returning(table.c.id)
        )
        if conn is None:
            with self.begin() as own:
                return own.execute(statement).scalar_one()
        with conn.begin():
            node_id = conn.execute(statement).scalar_one()
            conn.execute(select(func.pg_advisory_lock(lock_key(node_id))))
        return node_id

    def heartbeat(self, node_id: int, now: datetime | None = None) -> bool:
        """Record a heartbeat; False when the node is gone or was declared dead."""
        table = self.tables.nodes
        with self.begin() as conn:
            return conn.execute(
                update(table).where(table.c.id == node_id, table.c.dead_at.is_(None))
                .values(heartbeat_at=now or utcnow(), stale_checks=0, checked_at=None)
            ).rowcount == 1

    def hold_liveness_lock(self, conn: Connection, lock_key: int) -> bool:
        """Take the node's session-level liveness lock on ``conn`` (PostgreSQL), outside any
        transaction; False when another session holds it now."""
        with conn.begin():
            return bool(conn.execute(select(func.pg_try_advisory_lock(lock_key))).scalar_one())

    def ping_liveness(self, conn: Connection) -> None:
        """One round trip on the node's liveness connection, outside any transaction: raises
        when the server ended its session (and with it the session's liveness lock)."""
        with conn.begin():
            conn.execute(select(literal_column("1")))

    def deregister_node(self, node_id: int) -> None:
        """Release every inbox claim the node owns and delete it."""
        t = self.tables
        now = utcnow()
        with self.begin() as conn:
            conn.execute(update(t.incoming).where(is_running(t.incoming), t.incoming.c.owner == node_id)
                         .values(owner=UNOWNED, recover_after=now))
            conn.execute(delete(t.nodes).where(t.nodes.c.id == node_id))

    def check_nodes(self, conn: Connection, now: datetime, stale_before: datetime, checks_needed: int,
                    counted_before: datetime, silent_before: datetime | None = None) -> list[int]:
        """One stale check of every live node; returns the ids it declared dead.

        A node whose heartbeat is older than ``stale_before`` gets one more stale check,
        at most one per check period (a check counted before ``counted_before``), so
        two recover runs at once do not count twice. A node is declared dead when it
        reaches ``checks_needed`` consecutive checks or, on PostgreSQL, as soon as it is
        silent (no heartbeat since ``silent_before``) and its process no longer holds its
        liveness lock. A heartbeat resets the count. A node whose liveness connection
        dropped keeps heartbeating and is never declared dead for the lock alone.
        """
        table = self.tables.nodes
        conn.execute(
            update(table)
            .where(table.c.dead_at.is_(None), table.c.heartbeat_at < stale_before)
            .where(table.c.checked_at.is_(None) | (table.c.checked_at < counted_before))
            .values(stale_checks=table.c.stale_checks + 1, checked_at=now)
        )
        dead = table.c.stale_checks >= checks_needed
        if self.is_postgres and silent_before is not None:
            dead = dead | self._silent_and_unlocked(table.c.heartbeat_at < silent_before, table.c.id)
        candidates = select(table.c.id).where(table.c.dead_at.is_(None)).where(dead)
        if self.is_postgres:
            candidates = candidates.with_for_update(skip_locked=True)
        ids = list(conn.execute(candidates).scalars())
        if ids:
            conn.execute(update(table).where(self._id_predicate(table.c.id, ids)).values(dead_at=now))
        return ids

    def _liveness_lock_free(self, node_id_column):
        """SQL (PostgreSQL): the node's process no longer holds its liveness lock. Takes the
        lock for the rest of the transaction when it is free."""
        from ..node import node_lock_namespace

        lock_key = literal_column(str(node_lock_namespace(self.prefix) << 32), BigInteger) + node_id_column
        return func.pg_try_advisory_xact_lock(lock_key)

    def dead_owners(self, conn: Connection) -> list[int]:
        """Owners whose rows must be released: nodes declared dead, and owner ids with no node
        row at all (orphans). Computed first, so the release runs ``WHERE owner IN (...)``."""
        t = self.tables
        declared = set(conn.execute(select(t.nodes.c.id).where(t.nodes.c.dead_at.is_not(None))).scalars())
        incoming = t.incoming
        no_node = ~select(t.nodes.c.id).where(t.nodes.c.id == incoming.c.owner).correlate(incoming).exists()
        declared.update(conn.execute(
            select(incoming.c.owner).where(is_running(incoming), incoming.c.owner != UNOWNED).where(no_node).distinct()
        ).scalars())
        return sorted(declared)

    def release_owned(self, conn: Connection, owners: Sequence[int], limit: int, now: datetime) -> int:
        """Release up to ``limit`` inbox claims owned by ``owners``; returns how many.

        Released rows are due for recovery at once (durable queues re-publish them) and
        a redelivered copy may claim them.
        """
        if not owners:
            return 0
        table = self.tables.incoming
        owned = is_running(table) & self._owner_predicate(table.c.owner, owners)
        return self._release_incoming(conn, owned, limit, now)

    def release_claim(self, conn: Connection, message_id: str, destination: str, owner: int,
                      attempt: tuple[int, int, int], now: datetime, send_id: str = "") -> int:
        """Release ``owner``'s running claim of this attempt (nesting, replays, retries) of the
        message, so that a redelivered copy takes it over; returns how many rows (0: the claim
        was not there, not ours, or already ended). Due for recovery at once, as ``release_owned``."""
        table = self.tables.incoming
        nesting, replays, retries = attempt
        ours = (is_running(table) & (table.c.message_id == message_id) & (table.c.destination == destination)
                & (table.c.send_id == send_id) & (table.c.owner == owner) & (table.c.nesting == nesting)
                & (table.c.replays == replays) & (table.c.retries == retries))
        return self._release_incoming(conn, ours, 1, now)

    def _owner_predicate(self, column, owners: Sequence[int]):
        if self.is_postgres:
            return column == func.any(bindparam("owners", list(owners), type_=postgresql.ARRAY(Integer)))
        return column.in_(list(owners))

    def forget_released_nodes(self, conn: Connection) -> int:
        """Delete dead node rows that own nothing any more."""
        t = self.tables
        owns = (select(t.incoming.c.owner).where(is_running(t.incoming), t.incoming.c.owner == t.nodes.c.id)
                .correlate(t.nodes).exists())
        return conn.execute(delete(t.nodes).where(t.nodes.c.dead_at.is_not(None)).where(~owns)).rowcount

    def live_nodes(self, conn: Connection | None = None) -> list[Row]:
        table = self.tables.nodes
        query = select(table).order_by(table.c.id)
        if conn is not None:
            return list(conn.execute(query))
        with self.begin() as own:
            return list(own.execute(query))

    # -- status --------------------------------------------------------------------------------

    def status(self, now: datetime | None = None) -> dict[str, Any]:
        """Counts per table by status and destination, the oldest pending rows' age, the nodes."""
        now = now or utcnow()
        t = self.tables
        with self.begin() as conn:
            incoming = _grouped_counts(conn, t.incoming.c.status, t.incoming.c.queue, ("status", "queue"))
            outgoing = _grouped_counts(conn, _outgoing_state(t.outgoing, now), t.outgoing.c.destination,
                                       ("status", "destination"))
            dead_letters = _grouped_counts(conn, t.dead_letters.c.reason, t.dead_letters.c.task_name,
                                           ("reason", "task"))
            oldest_outgoing = as_utc(conn.execute(
                select(func.min(t.outgoing.c.created_at)).where(t.outgoing.c.sent_at.is_(None))
                .where((t.outgoing.c.deliver_at.is_(None)) | (t.outgoing.c.deliver_at <= now))
            ).scalar())
            duplicates, recoveries = conn.execute(
                select(func.coalesce(func.sum(t.incoming.c.duplicates), 0),
                       func.coalesce(func.sum(t.incoming.c.recoveries), 0))
            ).one()
            oldest_incoming = as_utc(conn.execute(
                select(func.min(t.incoming.c.received_at)).where(is_running(t.incoming))
            ).scalar())
            nodes = [
                {
                    "id": row.id,
                    "name": row.name,
                    "hostname": row.hostname,
                    "pid": row.pid,
                    "heartbeat_age_seconds": _age(now, as_utc(row.heartbeat_at)),
                    "stale_checks": row.stale_checks,
                }
                for row in conn.execute(select(t.nodes).order_by(t.nodes.c.id))
            ]
        return {
            "store": self.describe(),
            "incoming": incoming,
            "outgoing": outgoing,
            "dead_letters": dead_letters,
            "duplicates_discarded": int(duplicates),
            "messages_recovered": int(recoveries),
            "oldest_pending_outgoing_age_seconds": _age(now, oldest_outgoing),
            "oldest_running_incoming_age_seconds": _age(now, oldest_incoming),
            "nodes": nodes,
        }


def _later_attempt(new, table):
    """SQL: the proposed row is a later attempt than the stored one, by (nesting, replays, retries)."""
    return (new.nesting > table.c.nesting) | (
        (new.nesting == table.c.nesting) & (new.replays > table.c.replays)
    ) | (
        (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (new.retries > table.c.retries)
    )


def _grouped_counts(conn: Connection, first, second, names: tuple[str, str]) -> list[dict[str, Any]]:
    """Row counts grouped by two columns, as dicts keyed by ``names`` and ``count``."""
    rows = conn.execute(select(first, second, func.count()).group_by(first, second).order_by(first, second))
    return [{names[0]: a, names[1]: b, "count": count} for a, b, count in rows]


def _outgoing_state(table, now: datetime):
    from sqlalchemy import case

    return case(
        (table.c.sent_at.is_not(None), "sent"),
        ((table.c.deliver_at.is_not(None)) & (table.c.deliver_at > now), "scheduled"),
        else_="pending",
    ).label("status")


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds(), 3)


class ExpiredDeleted(int):
    """How many expired inbox rows one cleanup batch deleted, and the latest ``keep_until`` among them."""

    last_keep_until: datetime | None

    def __new__(cls, count: int, last_keep_until: datetime | None = None) -> "ExpiredDeleted":
        deleted = super().__new__(cls, count)
        deleted.last_keep_until = last_keep_until
        return deleted


def _upgrade_to_2(store: Store, conn: Connection) -> None:
    """Version 2: the outgoing table's indexes for delivery tracking and scheduling became partial
    (created above under new names); drop the full ones they replace."""
    for old in ("redeliver", "deliver"):
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "ix_{store.prefix}outgoing_{old}"')


def _upgrade_to_3(store: Store, conn: Connection) -> None:
    """Version 3: the inbox's indexes of claims became partial, of running rows only (created above
    under new names); drop the full ones they replace."""
    for old in ("owner_status", "status_claimed", "recover_after"):
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "ix_{store.prefix}incoming_{old}"')


def _upgrade_to_4(store: Store, conn: Connection) -> None:
    """Version 4: the publish identity ``send_id`` on outgoing rows and in the inbox's primary key
    (existing rows get ``''``: keyed by their task id, as before). PostgreSQL changes the primary
    key in place; SQLite, which cannot, copies the inbox into a new table."""
    incoming, outgoing = store.tables.incoming, store.tables.outgoing
    inspector = inspect(conn)
    column = f"send_id VARCHAR({SEND_ID_SIZE}) NOT NULL DEFAULT ''"
    if "send_id" not in {c["name"] for c in inspector.get_columns(outgoing.name)}:
        conn.exec_driver_sql(f'ALTER TABLE "{outgoing.name}" ADD COLUMN {column}')
    primary_key = inspector.get_pk_constraint(incoming.name)
    if "send_id" in primary_key["constrained_columns"]:
        return
    if store.is_postgres:
        conn.exec_driver_sql(f'ALTER TABLE "{incoming.name}" ADD COLUMN {column}, DROP CONSTRAINT '
                             f'"{primary_key["name"]}", ADD PRIMARY KEY (message_id, destination, send_id)')
        return
    old = f"{incoming.name}_v3"
    for index in incoming.indexes:
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "{index.name}"')
    conn.exec_driver_sql(f'ALTER TABLE "{incoming.name}" RENAME TO "{old}"')
    conn.execute(CreateTable(incoming))
    columns = ", ".join(f'"{name}"' for name in (c["name"] for c in inspect(conn).get_columns(old)))
    conn.exec_driver_sql(f'INSERT INTO "{incoming.name}" ({columns}) SELECT {columns} FROM "{old}"')
    conn.exec_driver_sql(f'DROP TABLE "{old}"')
    for index in sorted(incoming.indexes, key=lambda i: i.name or ""):
        conn.execute(CreateIndex(index))


# version -> the step that brings the tables from the version before it to that one
_UPGRADES: dict[int, Callable[[Store, Connection], None]] = {2: _upgrade_to_2, 3: _upgrade_to_3, 4: _upgrade_to_4}


class _Transaction:
    """``with store.begin() as conn``: commit on success, roll back on error, and turn a
    database that cannot be reached into ``StoreUnavailable`` naming the store."""

    def __init__(self, store: Store, durable: bool = True):
        self.store = store
        self.durable = durable
        self._context = None

    def __enter__(self) -> Connection:
        try:
            self._context = self.store.engine.begin()
            conn = self._context.__enter__()
            if not self.durable and self.store.is_postgres:
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            return conn
        except OperationalError as exc:
            raise self.store.unavailable(exc) from exc

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._context.__exit__(exc_type, exc, tb)
        except OperationalError as error:
            if exc is None:
                raise self.store.unavailable(error) from error
            raise
