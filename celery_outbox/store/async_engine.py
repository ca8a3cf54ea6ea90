"""Building the async engine of the message store, for async units of work (``Outbox.atransaction``).

Transaction boundary: as ``engine``'s: SQLite transactions are ``BEGIN IMMEDIATE`` in WAL mode with
a busy timeout (aiosqlite), PostgreSQL connections get the library's connect options (psycopg's async
mode) or a connect timeout (asyncpg). Guarantee: the async engine reaches the store's database; by
default it is derived from the store's URL, so both engines name the same database. SQLAlchemy's
asyncio support (greenlet) and the async driver come with ``celery-outbox[asyncio]``; a missing one
is a ``ConfigurationError`` that names the extra. Nothing here is imported until an async unit of
work is first opened.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ..errors import ConfigurationError
from .engine import POSTGRES_CONNECT_ARGS, ping_when_idle, redact, safe_url, tune_sqlite
from .pipeline import remember_failed_statements

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["ASYNC_EXTRA", "LoopEngine", "async_url", "build_async_engine"]

ASYNC_EXTRA = "pip install 'celery-outbox[asyncio]'"
#: the async driver of each sync driver the store runs on; the module each one needs
_ASYNC_DRIVERS = {"sqlite": ("sqlite+aiosqlite", "aiosqlite"), "postgresql": ("postgresql+psycopg", "psycopg")}
_DRIVER_MODULES = {"aiosqlite": "aiosqlite", "psycopg": "psycopg", "psycopg_async": "psycopg",
                   "asyncpg": "asyncpg"}
ASYNCPG_CONNECT_ARGS: Mapping[str, int] = {"timeout": 5}


def async_url(store_url: str | URL, given: str | None = None) -> URL:
    """The URL of the async engine: ``given`` (``outbox_async_database_url``), or the store's URL
    with its async driver (aiosqlite for SQLite, psycopg's async mode for PostgreSQL)."""
    setting = "outbox_async_database_url" if given else "outbox_database_url"
    try:
        url = make_url(given or store_url)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(f"setting {setting} = {safe_url(given or store_url)!r} is not a database URL: "
                                 f"{exc}") from None
    backend = url.get_backend_name()
    if backend not in _ASYNC_DRIVERS:
        raise ConfigurationError(f"setting {setting} = {safe_url(url)!r} names the database {backend!r}: "
                                 "async units of work support postgresql and sqlite")
    driver = url.get_driver_name()
    if given is None or "+" not in url.drivername:
        return url.set(drivername=_ASYNC_DRIVERS[backend][0])
    if driver not in _DRIVER_MODULES:
        raise ConfigurationError(
            f"setting {setting} = {safe_url(url)!r} names the driver {driver!r}, which is not an async one: "
            "write postgresql+asyncpg://, postgresql+psycopg:// or sqlite+aiosqlite://")
    return url


def build_async_engine(store_url: str | URL, given: str | None = None,
                       options: Mapping[str, Any] | None = None) -> "AsyncEngine":
    """Create the async engine (``async_url``) with ``options`` (``outbox_engine_options``); raise
    ``ConfigurationError`` naming the extra when SQLAlchemy's asyncio support or the driver is
    missing, or what else is wrong."""
    url = async_url(store_url, given)
    missing = [module for module in ("greenlet", _DRIVER_MODULES[url.get_driver_name()])
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigurationError(f"async units of work on {safe_url(url)!r} need {' and '.join(missing)}, "
                                 f"which {'is' if len(missing) == 1 else 'are'} not installed: {ASYNC_EXTRA}")
    from sqlalchemy.ext.asyncio import create_async_engine

    kwargs: dict[str, Any] = dict(options or {})
    if url.get_backend_name() == "postgresql":  # the URL's query and a given connect_args win
        library = ASYNCPG_CONNECT_ARGS if url.get_driver_name() == "asyncpg" else POSTGRES_CONNECT_ARGS
        library = {name: value for name, value in library.items() if name not in url.query}
        kwargs["connect_args"] = {**library, **kwargs.get("connect_args", {})}
    try:
        engine = create_async_engine(url, **kwargs)
    except (ArgumentError, NoSuchModuleError, TypeError) as exc:
        raise ConfigurationError(f"cannot build an async engine for {safe_url(url)!r}: {redact(str(exc), url)}"
                                 ) from None
    if url.get_backend_name() == "sqlite":
        tune_sqlite(engine.sync_engine)
    remember_failed_statements(engine.sync_engine)  # what refuses to commit an aborted transaction names
    if not kwargs.get("pool_pre_ping"):
        ping_when_idle(engine.sync_engine)
    return engine


class LoopEngine:
    """An async engine held for the running event loop, its connections closed when that loop shuts
    down: an async generator the loop finalises in ``shutdown_asyncgens`` (``asyncio.run`` and
    servers such as uvicorn call it before closing the loop) disposes of the engine's pool while
    the loop still runs, then sets ``disposed``. A loop closed without it leaves connections its
    engine must not hand to another loop."""

    def __init__(self, engine: "AsyncEngine", disposed: threading.Event | None = None):
        self.engine = engine
        self.disposed = disposed or threading.Event()
        self._keeper = _dispose_at_shutdown(engine, self.disposed)
        asyncio.ensure_future(self._keeper.__anext__())  # runs to its yield at the loop's next turn


async def _dispose_at_shutdown(engine: "AsyncEngine", disposed: threading.Event) -> AsyncIterator[None]:
    try:
        yield
    finally:
        try:
            await engine.dispose()
        finally:
            disposed.set()
