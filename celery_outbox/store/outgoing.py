"""The outbox's statements: the ``outgoing`` table, and the ``sent`` records of first publishes.

``outgoing`` holds messages waiting to be published and sent ones waiting for their
acknowledgment; ``sent`` feeds the delivery audit. Transaction boundary: every method runs inside
the caller's transaction (the unit of work that writes messages, a relay's batch, a cleanup batch)
and never commits. Guarantee: a relay's rows stay locked until that transaction ends (``FOR UPDATE
SKIP LOCKED`` on PostgreSQL, the ``BEGIN IMMEDIATE`` write lock on SQLite); if the relay dies, the
database releases them.
"""

from __future__ import annotations

import base64
import functools
import json
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator, Sequence

from sqlalchemy import (
    BigInteger,
    Connection,
    LargeBinary,
    Row,
    String,
    Text,
    bindparam,
    cast,
    delete,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError

from ..vocabulary import Attempt
from .one_message import OneMessage
from .pipeline import OPEN_NOT_WAITING_FOR_FLUSH, pipelined_query
from .schema import acknowledged_sends

# postgres_insert is named for the benchmarks' hand-written floor, which sends the store's own INSERT
__all__ = ["INSERT_CHUNK", "RECORD_COLUMNS", "OutgoingStatements", "postgres_insert"]

# Rows per INSERT statement: keeps every statement under both databases' parameter limits.
INSERT_CHUNK = 1000
# The columns of an outgoing row a record of its send (the ``sent`` table) keeps.
RECORD_COLUMNS = ("message_id", "destination", "task_name", "created_at", "deliver_at")


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
            return func.decode(field, literal_column("'base64'"))
        return field if isinstance(kind, (String, Text)) else cast(field, kind)

    given = func.jsonb_array_elements(cast(bindparam("rows", type_=Text), postgresql.JSONB)).table_valued(
        "doc", with_ordinality="ordinality").render_derived(name="given")
    rows = select(*[value(position, name) for position, name in enumerate(names)]).select_from(given) \
        .order_by(given.c.ordinality)
    return table.insert().from_select(list(names), rows).returning(table.c.id)


@functools.lru_cache(maxsize=64)
def _insert_one(table: Any, names: tuple[str, ...]) -> Any:
    """``INSERT INTO table (names) VALUES (:name, ...) RETURNING id``: one row, each value a
    parameter of its own. For a single row PostgreSQL takes it for less than the JSON text of
    ``_insert_from_json`` (nothing to encode, parse, decode or cast), and so does the client."""
    return table.insert().values({name: bindparam(name, type_=table.c[name].type) for name in names}) \
        .returning(table.c.id)


def postgres_insert(table: Any, rows: Sequence[dict[str, Any]],
                     ) -> tuple[Any, dict[str, Any], tuple[str, ...], str]:
    """PostgreSQL: the INSERT of ``rows`` into ``table``, its parameters, their names, and the kind
    of statement it is prepared as. A single row (the most common unit of work's) goes as its own
    values (``_insert_one``: no JSON to build or parse); more go as one JSON parameter
    (``_insert_from_json``: the same short statement at any row count, so psycopg and PostgreSQL
    parse and plan it once, and one string to send, not a value per cell). A single row's
    columns keep its order (the publisher builds every row alike); the JSON's are sorted."""
    if len(rows) == 1:
        names = tuple(rows[0])
        return _insert_one(table, names), rows[0], names, "insert_outgoing_row"
    names = tuple(sorted({key for row in rows for key in row}))
    return _insert_from_json(table, names), {"rows": _json_rows(rows, names)}, ("rows",), "insert_outgoing"


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


class OutgoingStatements(OneMessage):
    """The statements of the ``outgoing`` and ``sent`` tables."""

    def insert_outgoing(self, conn: Connection, rows: Sequence[dict[str, Any]], commit: bool = False) -> list[int]:
        """Insert fully built messages. Returns their ids in the rows' order. PostgreSQL: one
        INSERT, of one row's values or of one JSON array of the rows, whatever their count;
        SQLite: one multi-row INSERT per 1000 rows.

        On PostgreSQL with psycopg the INSERT goes through libpq as one message
        (``_send_one_message``: its parameters bound by the server, whatever cursors the
        connection makes, such as Django's, which bind them on the client). With ``commit``,
        the last statement of the caller's transaction, the transaction's COMMIT goes with it
        in that message (and its BEGIN too when nothing ran before it). An INSERT that fails is
        raised and its transaction is left for the caller to roll back; the caller's own commit
        then finds the transaction ended (psycopg sends nothing); it still ends SQLAlchemy's.
        A lost connection is ``StoreUnavailable``, whatever path the INSERT took; the owner of
        the transaction raises it as its caller expects (``raise_as_driver_error``)."""
        if not rows:
            return []
        table = self.tables.outgoing
        if self.is_postgres:
            statement, values, keys, kind = postgres_insert(table, rows)
            opening = self._opening(conn)
            if opening is None:
                try:
                    return sorted(conn.execute(statement, values).scalars())
                except DBAPIError as exc:
                    if exc.connection_invalidated:
                        raise self.unavailable(exc) from exc
                    raise
            query = pipelined_query(statement, conn.dialect, keys, kind)
            result, _ = self._send_one_message(conn, query, values, opening, (b"COMMIT",) if commit else ())
            return sorted(int(result.get_value(row, 0)) for row in range(result.ntuples))
        columns = {key for row in rows for key in row}
        rows = [{key: row.get(key) for key in columns} for row in rows]
        ids: list[int] = []
        for start in range(0, len(rows), INSERT_CHUNK):
            # one explicit multi-row INSERT; SQLite's rowids ascend in VALUES order under the
            # store's exclusive write lock
            statement = table.insert().values(rows[start:start + INSERT_CHUNK]).returning(table.c.id)
            ids.extend(sorted(conn.execute(statement).scalars()))
        return ids

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
        return list(conn.execute(self._take_outgoing_statement, self._taking(ids, now, redeliver_at)).scalars())

    @contextmanager
    def taking_outgoing(self, ids: Sequence[int], now: datetime, redeliver_at: datetime,
                        ) -> Iterator[tuple[Connection, list[int]]]:
        """A transaction of its own, as ``begin(durable=False)`` opens (it commits without waiting
        for the WAL flush: lost in a crash, the rows are only sent again), that starts by taking
        the given rows as ``take_outgoing`` does: ``with store.taking_outgoing(...) as (conn,
        taken):``, the ids taken; it commits when the block ends and rolls back on an error. On
        PostgreSQL with psycopg, BEGIN, ``SET LOCAL synchronous_commit TO OFF`` and the UPDATE
        (prepared once per connection) go in one network write: the publisher's only round trips
        after its unit of work are this one and the COMMIT."""
        with self.begin() as conn:
            values = self._taking(ids, now, redeliver_at)
            if self.is_postgres and self._can_open_in_one_message(conn):
                query = pipelined_query(self._take_outgoing_statement, conn.dialect, tuple(values), "take_outgoing")
                result, _ = self._send_one_message(conn, query, values, OPEN_NOT_WAITING_FOR_FLUSH, ())
                taken = [int(result.get_value(row, 0)) for row in range(result.ntuples)]
            else:
                if self.is_postgres:
                    conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
                taken = self.take_outgoing(conn, ids, now, redeliver_at)
            yield conn, taken

    @staticmethod
    def _taking(ids: Sequence[int], now: datetime, redeliver_at: datetime) -> dict[str, Any]:
        return {"ids": list(ids), "taken_at": now, "redeliver_to": redeliver_at}

    @functools.cached_property
    def _take_outgoing_statement(self):
        """``take_outgoing``'s UPDATE, built once: the ids (``ids``), the instant (``taken_at``) and
        the redelivery (``redeliver_to``) are its parameters."""
        table = self.tables.outgoing
        if self.is_postgres:
            chosen = table.c.id == func.any(bindparam("ids", type_=postgresql.ARRAY(BigInteger)))
        else:
            chosen = table.c.id.in_(bindparam("ids", expanding=True))
        unsent = select(table.c.id).where(chosen, table.c.sent_at.is_(None))
        if self.is_postgres:
            unsent = unsent.with_for_update(skip_locked=True)
        return (update(table).where(table.c.id.in_(unsent))
                .values(sent_at=bindparam("taken_at", type_=table.c.sent_at.type),
                        redeliver_at=bindparam("redeliver_to", type_=table.c.redeliver_at.type), sender=null())
                .returning(table.c.id))

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
                         .values(sent_at=None, redeliver_at=None, sender=null()))

    def acknowledge_outgoing(self, conn: Connection, message_id: str, destination: str | None,
                             attempt: Attempt, send_id: str = "") -> int:
        """The consuming inbox has attempt ``attempt`` (nesting, replays, retries) of the message
        sent as ``send_id``, or a later one: delete that send's outgoing rows up to that attempt (of
        ``destination`` only, when given). A later attempt (a scheduled retry) stays, and so do the
        rows of another send of the same task id. A row a publisher holds is waited
        for (PostgreSQL row lock, SQLite write lock), so an acknowledgment that overtakes its own
        publisher's commit still deletes the row."""
        table = self.tables.outgoing
        return conn.execute(delete(table).where(*acknowledged_sends(table, message_id, send_id, attempt,
                                                                    destination))).rowcount

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
                .values(redeliveries=table.c.redeliveries + 1, redeliver_at=bindparam("next_redelivery"),
                        sender=null()),
                [{"row_id": r["id"], "next_redelivery": r["redeliver_at"]} for r in rows],
            )

    def redeliver_rows_of_senders(self, conn: Connection, senders: Sequence[int], now: datetime, limit: int) -> int:
        """Make up to ``limit`` sent rows stored by the nodes ``senders`` (declared dead) due for
        redelivery at ``now``, no longer naming a sender: their publish after the commit may
        never have happened. Returns how many. Rows a transaction holds (an acknowledging
        consumer's, a redelivery's) are skipped, for the next batch. A row its sender did publish
        is published again: the consuming inbox discards the copy."""
        if not senders:
            return 0
        table = self.tables.outgoing
        theirs = select(table.c.id).where(self._id_predicate(table.c.sender, senders),
                                          table.c.sent_at.is_not(None)).limit(limit)
        if self.is_postgres:
            theirs = theirs.with_for_update(skip_locked=True)
        return conn.execute(update(table).where(table.c.id.in_(theirs))
                            .values(redeliver_at=now, sender=null())).rowcount

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
        an index walks that index and stops at its limit. A backlog grows faster than autovacuum
        analyzes the table, and on statistics that lag behind it the planner may otherwise read
        and sort every matching row for each batch: a batch would cost more the longer the
        backlog, just when the relay must catch up."""
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
