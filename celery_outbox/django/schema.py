"""The outbox's tables in a Django database: what its migration runs.

``manage.py migrate`` runs the store's own ``migrate`` (the statements of ``celery outbox
migrate``) through Django's connection to the database being migrated, so both create the same
tables and indexes, and upgrade them the same way. Transaction boundary: Django's autocommit; each
statement commits on its own (the migration is not atomic). Guarantee: ``migrate`` is safe to run
again after an interruption.
"""

from __future__ import annotations

from sqlalchemy import inspect

from ..store import Store
from .engine import django_engine
from .settings import outbox_settings

__all__ = ["create_tables", "drop_tables"]


def _store(using: str) -> Store:
    return Store(django_engine(using), outbox_settings().table_prefix)


def create_tables(using: str) -> None:
    """Create or upgrade the outbox's tables in Django's database ``using``."""
    _store(using).migrate()


def drop_tables(using: str) -> None:
    """Drop the outbox's tables from Django's database ``using`` (the migration reversed)."""
    store = _store(using)
    with store.engine.connect() as conn:
        existing = set(inspect(conn).get_table_names())
        for table in reversed(store.tables.all()):
            if table.name in existing:
                table.drop(conn)
