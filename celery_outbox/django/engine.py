"""A SQLAlchemy engine over Django's own database connection.

Transaction boundary: Django's. The store's statements run on the connection Django's ORM uses,
inside whatever transaction Django has open on it (``transaction.atomic()``, savepoints,
``ATOMIC_REQUESTS``); the engine's dialect never begins, commits, rolls back or closes that
connection, and its pool hands out the calling thread's current Django connection for alias
``using`` (connecting it if it is not yet). Guarantee: a durable message's row commits or rolls
back with the user's own writes.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from ..errors import ConfigurationError

__all__ = ["django_engine", "vendor_of"]

_DRIVER = "celery_outbox_django"
_VENDORS = {"postgresql": "postgresql", "sqlite": "sqlite"}
_engines: dict[str, Engine] = {}
_lock = threading.Lock()


class _DjangosConnection:
    """Dialect methods that would end or change a connection Django owns: none of them acts."""

    def do_begin(self, dbapi_connection: Any) -> None:
        return None

    def do_commit(self, dbapi_connection: Any) -> None:
        return None

    def do_rollback(self, dbapi_connection: Any) -> None:
        return None

    def do_close(self, dbapi_connection: Any) -> None:
        return None

    def on_connect(self) -> None:
        return None


class DjangoPsycopgDialect(_DjangosConnection, PGDialect_psycopg):
    """psycopg 3 on Django's PostgreSQL connection."""

    supports_statement_cache = True

    def __init__(self, **kwargs: Any):
        super().__init__(use_native_hstore=False, **kwargs)


class DjangoSQLiteDialect(_DjangosConnection, SQLiteDialect_pysqlite):
    """sqlite3 on Django's SQLite connection."""

    supports_statement_cache = True


registry.register(f"postgresql.{_DRIVER}", __name__, "DjangoPsycopgDialect")
registry.register(f"sqlite.{_DRIVER}", __name__, "DjangoSQLiteDialect")


def vendor_of(using: str) -> str:
    """The database vendor of Django's connection ``using``, when celery-outbox supports it."""
    from django.db import connections

    vendor = connections[using].vendor
    if vendor not in _VENDORS:
        raise ConfigurationError(f"Django database {using!r} is {vendor}: celery-outbox stores messages in "
                                 "PostgreSQL or SQLite")
    return vendor


def django_engine(using: str) -> Engine:
    """The engine whose connections are Django's connection ``using`` (one engine per alias)."""
    engine = _engines.get(using)
    if engine is None:
        with _lock:
            engine = _engines.get(using)
            if engine is None:
                engine = _engines[using] = create_engine(
                    f"{_VENDORS[vendor_of(using)]}+{_DRIVER}://", poolclass=NullPool,
                    creator=lambda: _raw_connection(using))
    return engine


def _raw_connection(using: str) -> Any:
    from django.db import connections

    connection = connections[using]
    connection.ensure_connection()
    return connection.connection
