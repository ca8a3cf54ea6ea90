"""What the outbox reads of Django's settings: whether the app is installed, and database URLs.

No transaction. The URL of a Django database serves the outbox's own engine (the relay,
maintenance, the inbox's claims).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ..errors import ConfigurationError

__all__ = ["APP", "database_url", "installed", "libpq_options", "outbox_settings", "same_database"]

APP = "celery_outbox.django"
_DRIVERS = {"django.db.backends.postgresql": "postgresql+psycopg", "django.db.backends.sqlite3": "sqlite"}


def installed() -> bool:
    """Whether Django's settings are configured and list this app in ``INSTALLED_APPS``. A process
    that never imported Django has no Django settings: False, without importing it."""
    if "django" not in sys.modules:
        return False
    from django.conf import settings

    if not (settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE")):
        return False
    return APP in settings.INSTALLED_APPS


def database_url(using: str) -> str:
    """The SQLAlchemy URL of Django's database ``using`` (the test database's, under Django's test
    runner): PostgreSQL through psycopg 3, or SQLite. A PostgreSQL URL carries the ``OPTIONS``
    that are libpq connection parameters (``libpq_options``), so the outbox's engine connects as
    Django's connections do."""
    from django.db import connections

    try:
        settings_dict: dict[str, Any] = connections[using].settings_dict
    except Exception as exc:  # django's ConnectionDoesNotExist
        raise ConfigurationError(f"outbox_django_database = {using!r} is not a database in Django's DATABASES") \
            from exc
    engine = settings_dict.get("ENGINE")
    driver = _DRIVERS.get(engine)
    if driver is None:
        raise ConfigurationError(f"Django database {using!r} uses {engine}: celery-outbox stores messages in "
                                 "PostgreSQL or SQLite")
    if driver == "sqlite":
        return URL.create("sqlite", database=str(settings_dict["NAME"])).render_as_string(hide_password=False)
    query = libpq_options(settings_dict.get("OPTIONS") or {})
    return URL.create(
        driver, username=settings_dict.get("USER") or None, password=settings_dict.get("PASSWORD") or None,
        host=settings_dict.get("HOST") or None, port=int(settings_dict["PORT"]) if settings_dict.get("PORT") else None,
        database=settings_dict.get("NAME") or None, query=query,
    ).render_as_string(hide_password=False)


def libpq_options(options: dict[str, Any]) -> dict[str, str]:
    """The entries of a Django PostgreSQL database's ``OPTIONS`` that are libpq connection
    parameters, as text: TLS (``sslmode``, ``sslrootcert``...), keepalives and
    ``tcp_user_timeout`` (they override the library's, ``POSTGRES_CONNECT_ARGS``), ``options``
    (a ``search_path``: the schema where ``manage.py migrate`` made the tables),
    ``target_session_attrs``... Django's own entries (``isolation_level``, ``pool``,
    ``server_side_binding``, ``assume_role``) and psycopg's keyword arguments are not libpq's
    and stay Django's."""
    from psycopg import pq

    keywords = {option.keyword.decode() for option in pq.Conninfo.get_defaults()}
    return {key: str(value) for key, value in options.items() if key in keywords and value is not None}


def outbox_settings() -> Any:
    """The outbox's settings as Django's settings give them (``CELERY_OUTBOX_*``), for what runs
    without a Celery app (``manage.py migrate``)."""
    from django.conf import settings

    from ..core.config import read_settings

    return read_settings({key: getattr(settings, key) for key in dir(settings) if key.startswith("CELERY_OUTBOX_")},
                         namespace="CELERY")


def same_database(first: str, second: str) -> bool:
    """Whether two SQLAlchemy URLs name the same database (driver and password aside); False when
    either is not a URL (building the engine says what is wrong with it)."""
    try:
        a, b = make_url(first), make_url(second)
    except ArgumentError:
        return False
    return (a.get_backend_name(), a.host or "", a.port, a.database or "", a.username or "") == (
        b.get_backend_name(), b.host or "", b.port, b.database or "", b.username or "")
