"""The inbox's claim statements: where a delivery claims one attempt and a duplicate is told apart.

Transaction boundary: a method given a ``conn`` runs in the caller's transaction (the body's unit
of work) and never commits, but for three that end a transaction themselves on PostgreSQL:
``claim_incoming_alone`` (its own transaction, committed without waiting for the WAL flush, the
body's opened behind it), ``store_envelope_alone`` (the envelope and the acknowledgment of the
sender's rows in one such transaction) and ``finish_incoming`` with ``commit`` (the body's COMMIT
in the same message). Guarantee: one claim per attempt; a copy is told apart by the claim rule.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, exists, func, literal_column, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from ..vocabulary import Attempt, IncomingStatus
from .one_message import OneMessage
from .pipeline import OPEN_NOT_WAITING_FOR_FLUSH, pipelined_query
from .schema import _INCOMING_KEY, UNOWNED, acknowledged_sends, is_running

__all__ = ["IncomingStatements"]

# envelope columns are only overwritten by a claim that carries them
_ENVELOPE_KEYS = frozenset({"exchange", "routing_key", "body", "content_type", "content_encoding", "headers",
                            "properties"})
_PG_DIVISION_BY_ZERO = "22012"


class IncomingStatements(OneMessage):
    """The statements of the ``incoming`` table."""

    def _upsert(self, table):
        return (postgresql.insert if self.is_postgres else sqlite.insert)(table)

    @functools.cached_property
    def _insert_new_incoming(self):
        """``INSERT ... ON CONFLICT DO NOTHING RETURNING``, built once: the row comes as parameters,
        so SQLAlchemy compiles it once per set of columns (building ``.values(**row)`` for every
        claim would cost more than running it)."""
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

    def _owner_is_dead(self, table, silent_before: Any):
        """SQL: the row's owner node is gone (declared dead or deregistered) or, on PostgreSQL,
        silent (no heartbeat since ``silent_before``) with its advisory liveness lock free: its
        process is gone. A live node whose liveness connection dropped keeps heartbeating while
        it takes its lock again, so it is never taken for dead."""
        nodes = self.tables.nodes
        # the row's own owner, named by the table's name: in an INSERT's ON CONFLICT ... WHERE the
        # compiler would not correlate ``table.c.owner`` and would join the whole table instead
        owner = literal_column(f"{self.engine.dialect.identifier_preparer.quote(table.name)}.owner")
        gone = ~select(nodes.c.id).where(nodes.c.id == owner, nodes.c.dead_at.is_(None)).exists()
        if not self.is_postgres or silent_before is None:
            return gone
        silent = select(nodes.c.id).where(nodes.c.id == owner, nodes.c.heartbeat_at < silent_before).exists()
        return gone | self._silent_and_unlocked(silent, table.c.owner)

    def claim_incoming(self, conn: Connection, row: dict[str, Any], stale_before: datetime | None = None,
                       silent_before: datetime | None = None, stored: bool = False) -> bool:
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
        re-checks these conditions against the committed row. With ``stored`` (the caller
        committed the key's row itself, a durable queue's envelope) the INSERT that would
        conflict is not sent.
        """
        return (not stored and self.insert_incoming(conn, row)) or self._take_over_incoming(
            conn, row, stale_before, silent_before)

    def _take_over_incoming(self, conn: Connection, row: dict[str, Any], stale_before: datetime | None,
                            silent_before: datetime | None) -> bool:
        """The key exists (or a concurrent claim just committed it): a second statement, with a
        fresh snapshot, decides whether this delivery may take the row over."""
        kept = frozenset(key for key in _ENVELOPE_KEYS if key in row and row[key] is None)
        statement = self._take_over_statement(tuple(row), kept, stale_before is not None, silent_before is not None)
        values = {f"row_{key}": value for key, value in row.items()}
        if stale_before is not None:
            values["stale_before"] = stale_before
        if silent_before is not None and self.is_postgres:
            values["silent_before"] = silent_before
        if self.is_postgres and self._can_open_in_one_message(conn):  # its BEGIN goes with it: one round trip
            query = pipelined_query(statement, conn.dialect, tuple(values), "take_over")
            result, _ = self._send_one_message(conn, query, values, (b"BEGIN",), ())
            return result.ntuples > 0
        return conn.execute(statement, values).first() is not None

    @functools.lru_cache(maxsize=16)  # noqa: B019 - one store per table prefix: a handful of column sets
    def _take_over_statement(self, columns: tuple[str, ...], kept: frozenset[str], stale: bool, silent: bool):
        """``_take_over_incoming``'s ``INSERT ... ON CONFLICT DO UPDATE ... WHERE``, built once per
        set of ``columns`` (envelope columns in ``kept`` are left as the row has them) and of the
        instants given: the row's values are the parameters ``row_<column>``, the instants
        ``stale_before`` and ``silent_before`` (building the statement for every claim would cost
        more than running it)."""
        table = self.tables.incoming
        insert = self._upsert(table).values({column: bindparam(f"row_{column}") for column in columns})
        new = insert.excluded
        same_attempt = (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (
            new.retries == table.c.retries)
        free = (table.c.owner == literal_column(str(UNOWNED))) | self._owner_is_dead(
            table, bindparam("silent_before") if silent else None)
        if stale:
            free = free | (table.c.claimed_at < bindparam("stale_before"))
        # constants written in the statement: its only parameters are the row's values and the instants
        retried, dead = (literal_column(f"'{status.value}'") for status in (IncomingStatus.RETRIED,
                                                                             IncomingStatus.DEAD))
        claimable = (
            (new.nesting > table.c.nesting)
            | (((table.c.status == retried) | is_running(table)) & _later_attempt(new, table))
            | ((table.c.status == dead) & (new.nesting == table.c.nesting) & (new.replays > table.c.replays))
            | (is_running(table) & same_attempt & free)
        )
        updates = {column: getattr(new, column) for column in columns
                   if column not in (*_INCOMING_KEY, "received_at", "recoveries") and column not in kept}
        return insert.on_conflict_do_update(index_elements=_INCOMING_KEY, set_=updates, where=claimable) \
            .returning(table.c.message_id)

    def claim_incoming_alone(self, row: dict[str, Any], stale_before: datetime | None = None,
                             then_begin: Connection | None = None, silent_before: datetime | None = None) -> bool:
        """``claim_incoming`` in a transaction of its own that commits without waiting for the
        WAL flush (``begin(durable=False)``): the eager claim, made durable by the body's commit.
        Given ``then_begin``, a connection between transactions, the claim goes on it whichever
        way it is made: the caller takes no second connection from the pool.

        On PostgreSQL a new key, the common case, costs one round trip instead of four: BEGIN,
        ``SET LOCAL synchronous_commit TO OFF``, the ``INSERT ... ON CONFLICT DO NOTHING`` and
        COMMIT go in one network write (``_insert_incoming_in_one_message``). Given
        ``then_begin``, a connection between transactions, the claim goes on it and a BEGIN
        follows the COMMIT in the same write: the body's transaction is open when the claim
        returns, and the body's first statement does not wait for a BEGIN of its own. A key
        that exists already takes ``claim_incoming``'s second statement in a transaction of
        its own; the first wrote nothing."""
        inserted = self._in_one_message_alone(
            lambda conn: self._insert_incoming_in_one_message(
                conn, row, OPEN_NOT_WAITING_FOR_FLUSH, (b"COMMIT",) if then_begin is None else (b"COMMIT", b"BEGIN")),
            then_begin) if self.is_postgres else None
        if inserted:
            return True
        with self.begin(durable=False, on=then_begin) as conn:
            if inserted is None:  # not sent as one message
                return self.claim_incoming(conn, row, stale_before, silent_before)
            return self._take_over_incoming(conn, row, stale_before, silent_before)

    def store_envelope_alone(self, row: dict[str, Any], message_id: str, destination: str | None,
                             attempt: Attempt, send_id: str) -> bool:
        """PostgreSQL: insert the inbox row ``row`` of a new key (a durable queue's envelope) and,
        only if it went in, acknowledge the sender's outgoing rows as ``acknowledge_outgoing``
        does, in a transaction of its own that commits without waiting for the WAL flush: BEGIN,
        ``SET LOCAL synchronous_commit TO OFF``, one statement (the INSERT ... ON CONFLICT DO
        NOTHING and the DELETE as two data-modifying parts of one query) and COMMIT in one network
        write. True when the row went in (and the acknowledgement with it); False when its key
        exists, or on SQLite, another driver or a libpq without pipeline mode: nothing was
        written, and the caller claims with ``claim_incoming`` and acknowledges in its own
        transaction."""
        if not self.is_postgres:
            return False
        values = self._claim_and_acknowledge_values(row, message_id, destination, attempt, send_id)
        statement = self._claim_and_acknowledge(tuple(row), destination is not None)

        def send(conn: Connection) -> bool:
            query = pipelined_query(statement, conn.dialect, tuple(values), "envelope")
            result, _ = self._send_one_message(conn, query, values, OPEN_NOT_WAITING_FOR_FLUSH, (b"COMMIT",))
            return result.ntuples > 0

        return bool(self._in_one_message_alone(send))

    def claim_held_envelope(self, conn: Connection, row: dict[str, Any], message_id: str, destination: str | None,
                            attempt: Attempt, send_id: str) -> int | None:
        """PostgreSQL, inside the caller's transaction (an optimistic attempt's, as its first
        statement): insert the inbox row ``row`` of a new key, with its envelope, and, only if it
        went in, acknowledge the sender's outgoing rows as ``acknowledge_outgoing`` does, in one
        statement (its BEGIN in the same message when ``conn`` is between transactions). Returns
        None when the key exists (nothing written); else how many of the rows it deleted are this
        very attempt's and tracked (``redeliver_at`` set). Such a row holds the message until the
        caller's transaction ends: a rollback (the process dying with it) puts the row back, and
        delivery tracking publishes it again once due."""
        values = self._claim_and_acknowledge_values(row, message_id, destination, attempt, send_id)
        statement = self._claim_and_acknowledge(tuple(row), destination is not None)
        opening = self._opening(conn)
        if opening is not None:
            query = pipelined_query(statement, conn.dialect, tuple(values), "held_envelope")
            result, _ = self._send_one_message(conn, query, values, opening, ())
            return int(result.get_value(0, 1)) if result.ntuples else None
        claimed = conn.execute(statement, values).first()
        return None if claimed is None else int(claimed[1])

    @staticmethod
    def _claim_and_acknowledge_values(row: dict[str, Any], message_id: str, destination: str | None,
                                      attempt: Attempt, send_id: str) -> dict[str, Any]:
        """The parameters of ``_claim_and_acknowledge``."""
        nesting, replays, retries = attempt
        values = {**{f"row_{key}": value for key, value in row.items()}, "ack_id": message_id, "ack_send": send_id,
                  "ack_nesting": nesting, "ack_replays": replays, "ack_retries": retries}
        if destination is not None:
            values["ack_destination"] = destination
        return values

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one store per table prefix: a handful of column sets
    def _claim_and_acknowledge(self, columns: tuple[str, ...], by_destination: bool):
        """PostgreSQL: ``WITH claimed AS (INSERT ... ON CONFLICT DO NOTHING RETURNING), acked AS
        (DELETE FROM outgoing ... WHERE EXISTS (SELECT FROM claimed) RETURNING) SELECT FROM
        claimed``: the claimed key's message id and how many deleted rows are this attempt's and
        tracked (see ``claim_held_envelope``). The inbox row's values are ``row_<column>``
        parameters; built once per set of columns."""
        table, outgoing = self.tables.incoming, self.tables.outgoing
        claimed = (self._upsert(table).values({column: bindparam(f"row_{column}") for column in columns})
                   .on_conflict_do_nothing(index_elements=_INCOMING_KEY).returning(table.c.message_id)
                   .cte("claimed"))
        attempt = (bindparam("ack_nesting"), bindparam("ack_replays"), bindparam("ack_retries"))
        acknowledged = acknowledged_sends(outgoing, bindparam("ack_id"), bindparam("ack_send"), attempt,
                                          bindparam("ack_destination") if by_destination else None)
        acked = (delete(outgoing).where(*acknowledged, exists(select(claimed.c.message_id)))
                 .returning(outgoing.c.nesting, outgoing.c.replays, outgoing.c.retries, outgoing.c.redeliver_at)
                 .cte("acked"))
        held = (select(func.count()).select_from(acked)
                .where(acked.c.redeliver_at.is_not(None),
                       tuple_(acked.c.nesting, acked.c.replays, acked.c.retries) == tuple_(*attempt))
                .scalar_subquery())
        return select(claimed.c.message_id, held).add_cte(acked)

    def _insert_incoming_in_one_message(self, conn: Connection, row: dict[str, Any], before: tuple[bytes, ...],
                                        after: tuple[bytes, ...] = ()) -> bool:
        """PostgreSQL: the statements ``before``, the inbox INSERT ... ON CONFLICT DO NOTHING
        RETURNING and the statements ``after`` in one message (``_send_one_message``); True when
        the row went in."""
        claim = pipelined_query(self._insert_new_incoming, conn.dialect, tuple(row), "claim")
        result, _ = self._send_one_message(conn, claim, row, before, after)
        return result.ntuples > 0

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
            .values(status=literal_column(f"'{IncomingStatus.HANDLED.value}'"), owner=literal_column(str(UNOWNED)),
                    handled_at=bindparam("finished_at"), keep_until=bindparam("finished_keep_until"))
        )

    @functools.cached_property
    def _finish_incoming_or_fail(self):
        """PostgreSQL: ``_finish_incoming`` as a query that fails (division by zero) when it marks
        no row, so that a COMMIT sent right behind it does not commit a claim no longer ours."""
        finished = self._finish_incoming.returning(literal_column("1")).cte("finished")
        return select(literal_column("1") / func.count()).select_from(finished)

    def finish_incoming(self, conn: Connection, message_id: str, destination: str, owner: int,
                        attempt: Attempt, now: datetime, keep_until: datetime,
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
            finish = pipelined_query(self._finish_incoming_or_fail, conn.dialect, tuple(values), "finish")
            _, failed = self._send_one_message(conn, finish, values, opening, (b"COMMIT",),
                                               tolerate=(_PG_DIVISION_BY_ZERO,))
            return failed is None
        return conn.execute(self._finish_incoming, values).rowcount == 1

    def record_outcome(self, conn: Connection, row: dict[str, Any]) -> bool:
        """Record how an attempt ended without committing its effects (``retried`` or
        ``dead``), unless a later attempt or a handled row is already there; False when one is
        (the message's outcome is that row's)."""
        table = self.tables.incoming
        insert = self._upsert(table).values(**row)
        new = insert.excluded
        same_attempt = (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (
            new.retries == table.c.retries)
        not_older = _later_attempt(new, table) | same_attempt
        updates = {key: getattr(new, key) for key in row if key not in (*_INCOMING_KEY, "received_at")}
        updates = {k: v for k, v in updates.items() if k not in _ENVELOPE_KEYS or row.get(k) is not None}
        return conn.execute(insert.on_conflict_do_update(
            index_elements=_INCOMING_KEY, set_=updates,
            where=not_older & (table.c.status != IncomingStatus.HANDLED.value),
        ).returning(table.c.message_id)).first() is not None

    def claim_in_flight(self, conn: Connection, message_id: str, destination: str,
                        attempt: Attempt, send_id: str = "") -> bool:
        """Whether the message's row is a running claim of this very attempt (nesting, replays,
        retries): after a claim that failed, its owner is alive and may still finish it, so a
        copy of it is not a duplicate yet."""
        table = self.tables.incoming
        return conn.execute(select(table.c.message_id).where(
            self._running_claim(message_id, destination, attempt, send_id))).first() is not None

    def count_duplicate(self, conn: Connection, message_id: str, destination: str, send_id: str = "") -> None:
        table = self.tables.incoming
        conn.execute(
            update(table)
            .where(table.c.message_id == message_id, table.c.destination == destination, table.c.send_id == send_id)
            .values(duplicates=table.c.duplicates + 1)
        )


def _later_attempt(new, table):
    """SQL: the proposed row is a later attempt than the stored one, by (nesting, replays, retries)."""
    return (new.nesting > table.c.nesting) | (
        (new.nesting == table.c.nesting) & (new.replays > table.c.replays)
    ) | (
        (new.nesting == table.c.nesting) & (new.replays == table.c.replays) & (new.retries > table.c.retries)
    )
