"""The schema's statements: creating the tables and indexes, and bringing them to ``SCHEMA_VERSION``.

Transaction boundary: ``migrate`` reads the catalog in one transaction and, when anything is
missing or older, runs all of its DDL, the upgrade steps (``_UPGRADES``) and the version's row in a
second one (on PostgreSQL under an advisory transaction lock, so concurrent runs serialise);
``schema_version``, ``missing_tables`` and ``refuse_newer_schema`` read in one short transaction
each. The tables themselves are defined in ``schema``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy import Connection, func, inspect, select, text, update
from sqlalchemy.schema import CreateIndex, CreateTable

from ..errors import IncompatibleSchema
from .base import StoreBase, utcnow
from .schema import SCHEMA_VERSION, SEND_ID_SIZE

__all__ = ["MigrationResult", "SchemaStatements"]


@dataclass
class MigrationResult:
    created_tables: list[str] = field(default_factory=list)
    version_before: int | None = None
    version_after: int = SCHEMA_VERSION


class SchemaStatements(StoreBase):
    """Creating and upgrading the tables of the store."""

    def _advisory_key(self) -> int:
        return zlib.crc32(f"celery_outbox:{self.lock_scope}".encode()) - 2**31

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
                if self.schema is not None:
                    conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
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
        for table in self.tables.all():
            if not {index.name for index in table.indexes} <= self._index_names(conn, table.name):
                return False
        return True

    def _index_names(self, conn: Connection, table: str) -> set[str]:
        """The names of ``table``'s indexes. On PostgreSQL from ``pg_index`` and ``pg_class`` alone:
        SQLAlchemy's reflection calls ``pg_get_indexdef``, which waits for a lock on the table, so a
        process getting ready would hang while a ``VACUUM FULL`` or a migration holds it."""
        if not self.is_postgres:
            return {index["name"] for index in inspect(conn).get_indexes(table)}
        return set(conn.execute(text(
            "SELECT i.relname FROM pg_catalog.pg_index x"
            " JOIN pg_catalog.pg_class t ON t.oid = x.indrelid"
            " JOIN pg_catalog.pg_class i ON i.oid = x.indexrelid"
            " WHERE t.relname = :table AND t.relnamespace = to_regnamespace(current_schema())"
        ), {"table": table}).scalars())

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


def _upgrade_to_2(store: StoreBase, conn: Connection) -> None:
    """Version 2: the outgoing table's indexes for delivery tracking and scheduling became partial
    (created above under new names); drop the full ones they replace."""
    for old in ("redeliver", "deliver"):
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "ix_{store.prefix}outgoing_{old}"')


def _upgrade_to_3(store: StoreBase, conn: Connection) -> None:
    """Version 3: the inbox's indexes of claims became partial, of running rows only (created above
    under new names); drop the full ones they replace."""
    for old in ("owner_status", "status_claimed", "recover_after"):
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "ix_{store.prefix}incoming_{old}"')


def _upgrade_to_4(store: StoreBase, conn: Connection) -> None:
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


def _upgrade_to_5(store: StoreBase, conn: Connection) -> None:
    """Version 5: the sender node on outgoing rows (``sender``; existing rows get NULL: delivery
    tracking alone redelivers them, as before). A nullable column without a default: PostgreSQL
    adds it without rewriting the table."""
    outgoing = store.tables.outgoing
    if "sender" not in {c["name"] for c in inspect(conn).get_columns(outgoing.name)}:
        conn.exec_driver_sql(f'ALTER TABLE "{outgoing.name}" ADD COLUMN sender INTEGER')


def _upgrade_to_6(store: StoreBase, conn: Connection) -> None:
    """Version 6: the eta of a scheduled message on its record of sends (``deliver_at``; existing
    records get NULL: counted as sent at once). A nullable column without a default."""
    sent = store.tables.sent
    if "deliver_at" not in {c["name"] for c in inspect(conn).get_columns(sent.name)}:
        kind = sent.c.deliver_at.type.compile(dialect=conn.dialect)
        conn.exec_driver_sql(f'ALTER TABLE "{sent.name}" ADD COLUMN deliver_at {kind}')


# version -> the step that brings the tables from the version before it to that one
_UPGRADES: dict[int, Callable[[StoreBase, Connection], None]] = {2: _upgrade_to_2, 3: _upgrade_to_3, 4: _upgrade_to_4,
                                                                 5: _upgrade_to_5, 6: _upgrade_to_6}
