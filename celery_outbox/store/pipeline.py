"""PostgreSQL with psycopg: statements sent in one network message, through libpq's pipeline mode.

With ``one_message``, the only code of celery-outbox that touches psycopg and libpq directly. A
message queues a statement and those around it (a BEGIN, ``SET LOCAL``, a COMMIT) and sends them
with one Sync in one write (``one_message.OneMessage._send_one_message``), prepared once per
connection where that is safe. Transaction boundary: the caller's; the message opens, continues or
ends its transaction with the statements the caller puts around it, and statements are prepared
only between transactions (``_prepare_ahead``, ``prepare_on_checkout``). SQLite, and PostgreSQL
through another driver or a libpq without pipeline mode, never get here (``OneMessage._opening``).
"""

from __future__ import annotations

import functools
import re
import select as io_select
import time
import weakref
import zlib
from contextlib import suppress
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, TypeVar

from sqlalchemy import Connection, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError

# what one_message.OneMessage and remember_failed_statement's callers use; pipeline_exchange,
# pipelined_query and prepared_statements are also named for the benchmarks' hand-written floors
# (benchmarks/producer_row.py), which send the store's statements as it does
__all__ = ["ABORTED_BY", "COMMAND_OK", "FAILED_STATEMENT", "OPEN_NOT_WAITING_FOR_FLUSH", "PG_NO_SUCH_PREPARED",
           "PG_PREPARED_EXISTS", "PSYCOPG_CONNECTION_OK", "PSYCOPG_IDLE", "PSYCOPG_INERROR", "PSYCOPG_INTRANS",
           "TUPLES_OK", "PipelinedQuery", "adaptation", "exchange_on", "pipeline_exchange", "pipeline_supported",
           "pipelined_query", "prepare", "prepare_on_checkout", "prepared_statements", "remember_failed_statement",
           "remember_failed_statements", "sqlstate_of"]

_T = TypeVar("_T")

# psycopg.pq values, without importing psycopg for SQLite
PSYCOPG_IDLE = 0  # TransactionStatus.IDLE
COMMAND_OK = 1  # ExecStatus.COMMAND_OK
TUPLES_OK = 2  # ExecStatus.TUPLES_OK
_FATAL_ERROR = 7  # ExecStatus.FATAL_ERROR (an ERROR's result as well as a FATAL's)
_PIPELINE_SYNC = 10  # ExecStatus.PIPELINE_SYNC
PSYCOPG_CONNECTION_OK = 0  # ConnStatus.OK
PSYCOPG_INTRANS = 2  # TransactionStatus.INTRANS
PSYCOPG_INERROR = 3  # TransactionStatus.INERROR: a statement failed, the transaction can only roll back
PG_NO_SUCH_PREPARED = "26000"
PG_PREPARED_EXISTS = "42P05"
# Seconds a claim interrupted by a signal waits for its cancelled query to end
CANCEL_WAIT = 5.0
# Per psycopg connection: the names of the statements prepared on it by ``_send_one_message``, and
# the statements to prepare between its transactions (None: not followed). Kept with the psycopg
# connection, not the pool's record of it: an engine over a connection it does not own (Django's)
# makes a new record each time it hands that connection out.
_PREPARED_ON: weakref.WeakKeyDictionary[Any, tuple[set[str], dict[str, str] | None]] = weakref.WeakKeyDictionary()
# The error of the last statement that failed on a connection, in its ``info`` (SQLAlchemy's
# ``handle_error`` on the store's engine, and Django's execute wrapper, put it there)
FAILED_STATEMENT = "celery_outbox.failed_statement"
ABORTED_BY = "celery_outbox.aborted_by"  # asyncpg: the error that aborted the open transaction
# The start of a message that opens a transaction committing without waiting for the WAL flush,
# as ``StoreBase.begin(durable=False)`` opens one
OPEN_NOT_WAITING_FOR_FLUSH = (b"BEGIN", b"SET LOCAL synchronous_commit TO OFF")


@dataclass(frozen=True)
class PipelinedQuery:
    """A statement with positional parameters (``$1``, ...) for libpq's pipeline mode:
    ``statement`` takes the values of ``keys`` in that order; ``name`` is the name it is
    prepared under on a connection. The bytes libpq takes are made once: the name, and the
    statement when it is ASCII (the same bytes in every client encoding PostgreSQL has)."""

    name: str
    statement: str
    keys: tuple[str, ...]
    encoded_name: bytes = field(init=False, repr=False, compare=False)
    ascii_statement: bytes | None = field(init=False, repr=False, compare=False)
    _values: Callable[[dict[str, Any]], tuple[Any, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoded_name", self.name.encode())
        object.__setattr__(self, "ascii_statement", self.statement.encode() if self.statement.isascii() else None)
        object.__setattr__(self, "_values", _taking(self.keys))

    def values(self, given: dict[str, Any]) -> tuple[Any, ...]:
        """The values of ``keys`` in ``given``, in the statement's order."""
        return self._values(given)

    def encoded(self, driver: Any) -> bytes:
        """The statement in the client encoding of psycopg connection ``driver``."""
        if self.ascii_statement is not None:
            return self.ascii_statement
        return self.statement.encode(driver.info.encoding)


def _taking(keys: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A function of a dict that returns the values of ``keys`` as a tuple, in that order."""
    if len(keys) > 1:
        return itemgetter(*keys)  # type: ignore[return-value]
    if keys:
        one = itemgetter(keys[0])
        return lambda given: (one(given),)
    return lambda given: ()


@functools.lru_cache(maxsize=16)
def pipelined_query(statement: Any, dialect: Any, names: tuple[str, ...], kind: str) -> PipelinedQuery:
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
    return PipelinedQuery(f"celery_outbox_{kind}_{zlib.crc32(positional.encode()):08x}", positional,
                           tuple(order))


@functools.cache
def adaptation() -> tuple[Any, Any]:
    """psycopg's ``Transformer`` and its text format, imported on first use (never for SQLite)."""
    from psycopg.adapt import PyFormat, Transformer

    return Transformer, PyFormat.TEXT


@functools.cache
def pipeline_supported() -> bool:
    """psycopg's libpq has pipeline mode (libpq 14 and later)."""
    import psycopg

    return psycopg.Pipeline.is_supported()


def pipeline_exchange(driver: Any, send: Callable[[Any], None]) -> list[Any]:
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
        if pgconn.status == PSYCOPG_CONNECTION_OK and pgconn.is_busy():
            driver.cancel()
            with suppress(Exception):  # a pipeline that cannot end: the caller drops the connection
                _pipeline_results(pgconn, timeout=CANCEL_WAIT)
        try:
            pgconn.exit_pipeline_mode()
        except Exception:  # noqa: BLE001 - results left unread: the caller drops the connection
            pass
        raise
    pgconn.exit_pipeline_mode()
    return results


def exchange_on(conn: Connection, send: Callable[[Any], None], driver: Any = None) -> list[Any]:
    """``pipeline_exchange`` on ``conn``'s psycopg connection (``driver``, when the caller has it); a
    connection it was interrupted on (a signal such as a soft time limit, or a lost connection)
    is not reused."""
    try:
        return pipeline_exchange(driver if driver is not None else conn.connection.driver_connection, send)
    except BaseException:
        conn.invalidate()
        raise


def sqlstate_of(result: Any) -> str:
    """The SQLSTATE of a libpq result ('' when it carries none)."""
    from psycopg import pq

    return (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()


def prepared_statements(conn: Connection) -> tuple[set[str], dict[str, str] | None]:
    """PostgreSQL: the names of the statements ``_send_one_message`` prepared on ``conn``'s
    session, and the statements to prepare before its next message that opens a transaction;
    that dict is None when psycopg's deallocations cannot be followed. They are followed by
    wrapping the ``clear`` of psycopg's prepared-statement manager on the connection (psycopg
    calls it on every rollback and every DROP, ALTER, DISCARD ALL or DEALLOCATE ALL it runs,
    and only then deallocates every prepared statement): our set empties with psycopg's. A
    statement the set names is then there, unless something else deallocated it (SQL run
    with psycopg holding no prepared statement of its own): inside a transaction that fails
    its message, and the name is dropped."""
    driver = conn.connection.driver_connection
    known = _PREPARED_ON.get(driver)
    if known is None:
        prepared: set[str] = set()
        known = _PREPARED_ON[driver] = (prepared, {} if _forget_when_psycopg_clears(driver, prepared) else None)
    return known


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
    last result of each query (None when ``timeout`` seconds passed first).

    A server that ends the session mid-pipeline (a restart, ``pg_terminate_backend``) sends a
    FATAL error and sends no Sync: that closes the connection and raises
    ``psycopg.OperationalError`` with its message, as a connection lost does, rather than
    waiting for a Sync. libpq 16 may not see the connection end: it then gives empty results
    without end, the connection still marked good. Every query's results end with one empty
    result and the Sync's comes after the last, so two empty results in a row raise the same."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[Any] = []
    last = None
    ended = False  # the previous result ended a query's results
    while True:
        while pgconn.is_busy():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            io_select.select([pgconn.socket], [], [], remaining)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one query's results
            if ended:
                raise _pipeline_stalled(pgconn, results)
            results.append(last)
            last = None
            ended = True
            continue
        ended = False
        if result.status == _PIPELINE_SYNC:
            return results
        if _ends_the_session(result):
            raise _pipeline_stalled(pgconn, [*results, result])
        last = result


def _ends_the_session(result: Any) -> bool:
    """A FATAL (or PANIC) error: the server ends the session after it."""
    if result.status != _FATAL_ERROR:
        return False
    from psycopg import pq

    return result.error_field(pq.DiagnosticField.SEVERITY_NONLOCALIZED) in (b"FATAL", b"PANIC")


def _pipeline_stalled(pgconn: Any, results: list[Any]) -> Exception:
    """The error for a pipeline that ends before its Sync (the server's last error message, else
    the connection's), once the libpq connection is closed: its session is over, and every caller
    then sees the connection lost (its status is no longer good)."""
    import psycopg

    messages = [result.error_message for result in results if result is not None and result.error_message]
    message = (messages[-1] if messages else pgconn.error_message or b"").decode(errors="replace").strip()
    pgconn.finish()
    return psycopg.OperationalError(f"the connection ended before the pipeline's end: {message or 'no error given'}")


def prepare(driver: Any, prepared: set[str], to_prepare: dict[str, str],
             exchange: Callable[[Callable[[Any], None]], list[Any]]) -> None:
    """In one round trip (``exchange``) on psycopg connection ``driver``, between transactions:
    prepare the statements ``to_prepare`` names (those a message inside a transaction sent
    unnamed) and add those prepared to ``prepared``. One that exists already counts as
    prepared; one that failed otherwise is left to go unnamed. Nothing runs in a transaction,
    so a failed Parse costs nothing else."""
    wanted = list(to_prepare.items())
    to_prepare.clear()
    if driver.prepare_threshold is None:
        return
    encoding = driver.info.encoding

    def send(pgconn: Any) -> None:
        for name, statement in wanted:
            pgconn.send_prepare(name.encode(), statement.encode(encoding))

    results = exchange(send)
    for (name, _), result in zip(wanted, results, strict=True):
        if result.status == COMMAND_OK or sqlstate_of(result) == PG_PREPARED_EXISTS:
            prepared.add(name)


def prepare_on_checkout(engine: Engine) -> None:
    """PostgreSQL with psycopg: when the pool of ``engine`` hands out a connection between
    transactions, prepare the statements a message inside a transaction sent unnamed on it (see
    ``_send_one_message``), in one round trip, once per connection and statement. A unit of work
    whose own statements open the transaction never sends a message that opens one, the other
    moment a statement is prepared; so its messages go prepared from its connection's second
    unit of work on, with no round trip of their own. A connection found lost on the way is
    replaced by the pool (``DisconnectionError``); any other failure ends the checkout and the
    pool drops the connection."""
    if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg" \
            and not event.contains(engine, "checkout", _prepare_pending):
        event.listen(engine, "checkout", _prepare_pending, insert=True)  # its round trip is a ping too


def _prepare_pending(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    prepared, to_prepare = _PREPARED_ON.get(driver, (set(), None))
    if not to_prepare:
        return
    import psycopg

    if driver.pgconn.transaction_status != PSYCOPG_IDLE:  # a connection handed over mid-transaction
        return
    try:
        prepare(driver, prepared, to_prepare, functools.partial(pipeline_exchange, driver))
    except psycopg.Error as exc:
        if driver.pgconn.status != PSYCOPG_CONNECTION_OK:
            raise DisconnectionError(str(exc)) from exc  # the pool connects afresh
        raise


def remember_failed_statement(conn: Connection, error: BaseException) -> None:
    """Keep ``error``, which a statement on ``conn`` raised, for ``aborted_by`` to name: in one line,
    its type and the first line of its message (not the error itself, whose traceback would keep
    its frames alive for as long as the pooled connection lives)."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    with suppress(Exception):  # a connection already closed or invalidated keeps nothing
        conn.info[FAILED_STATEMENT] = line


def remember_failed_statements(engine: Engine) -> None:
    """PostgreSQL with psycopg: the error of each statement that fails on ``engine`` is kept with
    its connection (``remember_failed_statement``). With asyncpg, whose connection does not say
    whether its transaction is aborted, the error is also kept as the one that aborted it
    (``ABORTED_BY``) until a savepoint's rollback, or the transaction's end, forgets it."""
    if engine.dialect.name != "postgresql" or event.contains(engine, "handle_error", _on_statement_error):
        return
    if engine.dialect.driver in ("psycopg", "asyncpg"):  # psycopg: its sync and its async mode
        event.listen(engine, "handle_error", _on_statement_error)
    if engine.dialect.driver == "asyncpg":
        for name in ("begin", "commit", "rollback", "rollback_savepoint"):
            event.listen(engine, name, _forget_aborting_error)


def _forget_aborting_error(conn: Connection, *_: Any) -> None:
    with suppress(Exception):
        conn.info.pop(ABORTED_BY, None)


def _on_statement_error(context: Any) -> None:
    if context.connection is not None and not context.is_disconnect:
        remember_failed_statement(context.connection, context.sqlalchemy_exception or context.original_exception)
        if context.dialect.driver == "asyncpg":
            with suppress(Exception):
                context.connection.info[ABORTED_BY] = context.connection.info[FAILED_STATEMENT]
