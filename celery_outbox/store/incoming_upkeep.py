"""The inbox's upkeep statements: what recovery and cleanup run on the ``incoming`` table.

Recovery releases stale claims, re-publishes stranded envelopes or gives them up; cleanup deletes
rows past their dedupe window. Transaction boundary: each method runs in the caller's transaction
(a recover or cleanup batch) and never commits; rows are taken with ``FOR UPDATE SKIP LOCKED`` on
PostgreSQL, so two passes at once never take the same row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

from sqlalchemy import Connection, Row, bindparam, delete, func, literal_column, select, tuple_, update
from sqlalchemy.dialects import postgresql

from ..vocabulary import IncomingStatus
from .base import StoreBase
from .schema import UNOWNED, _incoming_key, is_running

__all__ = ["ExpiredDeleted", "IncomingUpkeepStatements"]


class IncomingUpkeepStatements(StoreBase):
    """The statements recovery and cleanup run on the ``incoming`` table."""

    def release_stale_incoming(self, conn: Connection, claimed_before: datetime, limit: int, now: datetime) -> int:
        """Release up to ``limit`` running rows claimed before ``claimed_before`` (opt-in stale time)."""
        table = self.tables.incoming
        return self._release_incoming(conn, is_running(table) & (table.c.owner != UNOWNED)
                                      & (table.c.claimed_at < claimed_before), limit, now)

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
            .values(status=IncomingStatus.DEAD.value, owner=UNOWNED, handled_at=now, keep_until=keep_until,
                    recover_after=None)
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


class ExpiredDeleted(int):
    """How many expired inbox rows one cleanup batch deleted, and the latest ``keep_until`` among them."""

    last_keep_until: datetime | None

    def __new__(cls, count: int, last_keep_until: datetime | None = None) -> "ExpiredDeleted":
        deleted = super().__new__(cls, count)
        deleted.last_keep_until = last_keep_until
        return deleted
