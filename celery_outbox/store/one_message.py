"""``OneMessage``: the base of the statement families whose PostgreSQL fast paths send one message.

They send a transaction's statements and its COMMIT (or its BEGIN and the first statement)
together, through the psycopg pipeline of ``pipeline``. Transaction boundary: the caller's, or one
the fast path opens and commits itself in the same message; a statement that fails there leaves
the transaction aborted, and ``aborted_by`` says so.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext, suppress
from typing import Any, Callable, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from .base import StoreBase
from .pipeline import (
    ABORTED_BY,
    COMMAND_OK,
    FAILED_STATEMENT,
    PG_NO_SUCH_PREPARED,
    PG_PREPARED_EXISTS,
    PSYCOPG_CONNECTION_OK,
    PSYCOPG_IDLE,
    PSYCOPG_INERROR,
    PSYCOPG_INTRANS,
    TUPLES_OK,
    PipelinedQuery,
    adaptation,
    exchange_on,
    pipeline_supported,
    prepare,
    prepare_on_checkout,
    prepared_statements,
    remember_failed_statements,
    sqlstate_of,
)

__all__ = ["OneMessage"]

_T = TypeVar("_T")


class OneMessage(StoreBase):
    """Statements sent in one network message on PostgreSQL with psycopg."""

    def __init__(self, engine: Engine, *args: Any, **kwargs: Any):
        super().__init__(engine, *args, **kwargs)
        prepare_on_checkout(engine)
        remember_failed_statements(engine)

    def aborted_by(self, conn: Connection) -> str | None:
        """None while ``conn``'s transaction can commit. When PostgreSQL has aborted it (a
        statement in it failed, and the caller caught the error without a savepoint: its COMMIT
        would end as a ROLLBACK, psycopg raising nothing), the error of the statement that last
        failed on ``conn`` (the one that aborted it, unless the caller ran it through the driver
        itself), as its caller saw it. libpq knows the transaction's state: no round trip. Other
        databases never abort a transaction this way."""
        if conn.closed or conn.invalidated or conn.dialect.name != "postgresql":
            return None
        if conn.dialect.driver != "psycopg":  # asyncpg: the driver does not say
            return conn.info.get(ABORTED_BY)
        driver = conn.connection.driver_connection
        if driver.pgconn.transaction_status != PSYCOPG_INERROR:
            return None
        return self.failed_statement(conn) or "its error was not seen"

    def failed_statement(self, conn: Connection) -> str | None:
        """The error of the statement that last failed on ``conn`` (``remember_failed_statement``),
        in one line: its type and the first line of its message; None if none failed."""
        with suppress(Exception):
            return conn.info.get(FAILED_STATEMENT)
        return None

    def _in_one_message_alone(self, send: Callable[[Connection], _T], conn: Connection | None = None) -> _T | None:
        """PostgreSQL: ``send(conn)``, statements sent in one message that open their own
        transaction, on ``conn`` (a connection between transactions) or on a connection of its
        own; None, and nothing sent, when they cannot go in one message there (see
        ``_opening``). A lost connection is ``StoreUnavailable``."""
        try:
            with nullcontext(conn) if conn is not None else self.engine.connect() as connection:
                return send(connection) if self._can_open_in_one_message(connection) else None
        except OperationalError as exc:
            raise self.unavailable(exc) from exc

    def _can_open_in_one_message(self, conn: Connection) -> bool:
        """PostgreSQL: ``conn`` is between transactions, and a message sent on it may open its own."""
        return self._opening(conn) == (b"BEGIN",)

    def _opening(self, conn: Connection) -> tuple[bytes, ...] | None:
        """PostgreSQL: what statements sent in one message on ``conn`` must start with: ``(b"BEGIN",)``
        when its psycopg connection is between transactions in the default transaction mode (they
        open the transaction themselves, as psycopg would have), ``()`` inside a transaction, and
        None when they cannot go in one message (another driver, psycopg's async mode, whose
        connection's socket an event loop waits on, a libpq without pipeline mode, a transaction
        in error, or non-default transaction settings)."""
        if conn.dialect.driver != "psycopg" or conn.dialect.is_async or not pipeline_supported():
            return None
        driver = conn.connection.driver_connection
        status = driver.pgconn.transaction_status
        if status == PSYCOPG_INTRANS:
            return ()
        if (status == PSYCOPG_IDLE and not driver.autocommit and driver.isolation_level is None
                and driver.read_only is None and driver.deferrable is None):
            return (b"BEGIN",)
        return None

    def _send_one_message(self, conn: Connection, query: PipelinedQuery, values: dict[str, Any],
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
        ``prepared_statements``); otherwise it goes as an unnamed statement, parsed, and is
        prepared between the connection's transactions (when the pool next hands it out, or
        before its next message that opens a transaction), where a Parse that fails harms
        nothing. With psycopg's prepared statements off
        (``prepare_threshold = None``, as behind a transaction-pooling PgBouncer) every
        statement goes unnamed."""
        driver = conn.connection.driver_connection
        prepared, to_prepare = prepared_statements(conn)
        in_step = (PG_NO_SUCH_PREPARED, PG_PREPARED_EXISTS)
        opens = before[:1] == (b"BEGIN",)
        try:
            if opens and to_prepare:
                self._prepare_ahead(conn, prepared, to_prepare)
            named = opens or (to_prepare is not None and query.name in prepared)
            if not named and to_prepare is not None and driver.prepare_threshold is not None:
                to_prepare[query.name] = query.statement
            result, failed = self._run_one_message(conn, driver, query, prepared, before, after, values, named=named)
            if failed is not None and opens:
                state = self._error_of(conn, failed, expected=(*in_step, *tolerate))
                if state in in_step:
                    driver.rollback()
                    (prepared.discard if state == PG_NO_SUCH_PREPARED else prepared.add)(query.name)
                    result, failed = self._run_one_message(conn, driver, query, prepared, before, after, values,
                                                           named=True)
            if failed is not None:
                if sqlstate_of(failed) == PG_NO_SUCH_PREPARED:  # gone behind psycopg's back: prepare it anew
                    prepared.discard(query.name)
                return None, self._error_of(conn, failed, expected=tolerate)
        except Exception as exc:
            import psycopg

            if not isinstance(exc, psycopg.Error):  # psycopg's come from libpq or the adaptation of the values
                raise
            if conn.invalidated or driver.pgconn.status != PSYCOPG_CONNECTION_OK:
                if not conn.invalidated:
                    conn.invalidate()
                raise self.unavailable(exc) from exc
            raise DBAPIError.instance(query.statement, values, exc, psycopg.Error) from exc
        return result, None

    def _prepare_ahead(self, conn: Connection, prepared: set[str], to_prepare: dict[str, str]) -> None:
        """Before a message that opens a transaction on ``conn``, in one round trip: prepare the
        statements a message inside a transaction sent unnamed (``prepare``)."""
        prepare(conn.connection.driver_connection, prepared, to_prepare, functools.partial(exchange_on, conn))

    def _run_one_message(self, conn: Connection, driver: Any, query: PipelinedQuery, prepared: set[str],
                         before: tuple[bytes, ...], after: tuple[bytes, ...], values: dict[str, Any],
                         named: bool) -> tuple[Any, Any]:
        """Send the pipeline on ``conn`` (its psycopg connection ``driver``); (``query``'s result,
        the first result that is an error or None). ``query`` goes as a prepared statement when
        ``named`` and psycopg's prepared statements are on; it counts as prepared on the
        connection once its Parse succeeded, whatever came after."""
        transformer, text = adaptation()
        params = transformer(driver).dump_sequence(query.values(values), [text] * len(query.keys))
        statement, name = query.encoded(driver), query.encoded_name
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

        results = exchange_on(conn, send, driver)
        if prepare and results[0].status == COMMAND_OK:
            prepared.add(query.name)
        failed = None
        for result in results:
            if result.status != COMMAND_OK and result.status != TUPLES_OK:
                failed = result
                break
        return results[len(before) + prepare], failed

    def _error_of(self, conn: Connection, result: Any, expected: tuple[str, ...]) -> str:
        """The SQLSTATE of the error ``result`` carries when it is one of ``expected``; otherwise
        raise it as psycopg would have."""
        import psycopg

        driver = conn.connection.driver_connection
        message = (result.error_message or driver.pgconn.error_message).decode(errors="replace").strip()
        state = sqlstate_of(result)
        if state in expected and driver.pgconn.status == PSYCOPG_CONNECTION_OK:
            return state
        raise (psycopg.errors.lookup(state) if state else psycopg.OperationalError)(message)
