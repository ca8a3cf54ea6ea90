"""Reads only the command line and the tests use: counts, one row, dead-letter and node listings.

Transaction boundary: each read runs in a short transaction of its own (a count given a ``conn``,
inside the caller's), and none writes. No other path of the library calls them.
"""

from __future__ import annotations

from sqlalchemy import Connection, Row, func, select

from .base import StoreBase

__all__ = ["Inspection"]


class Inspection(StoreBase):
    """Counts and listings for operators and tests."""

    def count_outgoing(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.outgoing, conn)

    def count_incoming(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.incoming, conn)

    def count_dead_letters(self, conn: Connection | None = None) -> int:
        return self._count(self.tables.dead_letters, conn)

    def _count(self, table, conn: Connection | None) -> int:
        query = select(func.count()).select_from(table)
        if conn is not None:
            return conn.execute(query).scalar_one()
        with self.begin() as own:
            return own.execute(query).scalar_one()

    def get_incoming(self, message_id: str, destination: str = "", send_id: str | None = None) -> Row | None:
        """The inbox row of a message (of its send ``send_id``; None: its latest send's)."""
        table = self.tables.incoming
        query = select(table).where(table.c.message_id == message_id, table.c.destination == destination)
        if send_id is not None:
            query = query.where(table.c.send_id == send_id)
        with self.begin() as conn:
            return conn.execute(query.order_by(table.c.received_at.desc()).limit(1)).first()

    def live_nodes(self, conn: Connection | None = None) -> list[Row]:
        table = self.tables.nodes
        query = select(table).order_by(table.c.id)
        if conn is not None:
            return list(conn.execute(query))
        with self.begin() as own:
            return list(own.execute(query))

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
