"""The statements of the ``dead_letters`` table: envelopes that failed for good, kept for replay.

Transaction boundary: every method runs inside the caller's transaction (the one that gives a
message up, a replay, a purge) and never commits. ``dead_letter_filter`` builds a predicate only;
it runs in the statement that takes it. Listings for operators are in ``inspection``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

from sqlalchemy import Connection, Row, and_, delete, select, true, update

from .base import StoreBase

__all__ = ["DeadLetterStatements"]


class DeadLetterStatements(StoreBase):
    """The statements of the ``dead_letters`` table."""

    def insert_dead_letters(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            columns = {key for row in rows for key in row}
            conn.execute(self.tables.dead_letters.insert(), [{k: row.get(k) for k in columns} for row in rows])

    def dead_letter_filter(self, *, ids: Sequence[int] | None = None, task: str | None = None,
                           queue: str | None = None, exception: str | None = None, reason: str | None = None,
                           since: datetime | None = None, failed_before: datetime | None = None,
                           headers_containing: str | None = None):
        """SQL: the dead letters matching every given criterion (all of them when none is);
        ``headers_containing``: stored headers holding that text, as it is (no wildcards)."""
        table = self.tables.dead_letters
        clauses = []
        if headers_containing:
            clauses.append(table.c.headers.contains(headers_containing, autoescape=True))
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
