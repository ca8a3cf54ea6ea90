"""The runtime of one app: its settings, store, sessions and archiver, what every part uses.

``Outbox(app)`` builds one ``Runtime`` and hands it to the parts it composes; the consumer guard,
which Celery builds, finds it on the app (``runtime_of``); none of them reaches back to ``Outbox``.
Transaction boundary: none but ``ready()``'s, which checks that the store answers and its tables
exist (creating them when ``outbox_auto_create_schema`` is on) and which every entry point calls
first. The settings are read when the app is configured, never at import time, and no connection
is made before ``ready()``, where a database that cannot be reached is one clear error.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol, Sequence

from celery import Celery
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from ..errors import ConfigurationError, UnknownTenant
from ..store import Store, build_engine
from ..vocabulary import ArchiveKind
from .config import OutboxSettings, read_settings
from .integration import Integration
from .sessions import listen_to_sessions, session_info
from .tenancy import TenantPlace, current_tenant, read_tenants, tenant_folder

__all__ = ["Archiver", "Runtime", "installed_runtimes", "runtime_of"]

logger = logging.getLogger("celery_outbox")

_APP_ATTRIBUTE = "_celery_outbox_runtime"


class Archiver(Protocol):
    """Receives rows cleanup is about to delete, inside the deleting transaction.

    ``kind`` is an ``ArchiveKind``, a ``str`` (``"incoming"``, ``"dead_letters"`` or ``"sent"``).
    If it raises, the batch is not deleted and the next cleanup tries again: archiving is at least
    once.
    """

    def archive(self, kind: ArchiveKind, rows: Sequence[Any]) -> None: ...


@dataclass
class StoreSlot:
    """One store (the default, or a tenant's), the sessions on its engine, and whether ``ready()``
    has passed for it."""

    store: Store
    sessions: sessionmaker
    ready: bool = False


class Runtime:
    """The app, its settings, the stores, the sessions and the archiver of one installed outbox.

    ``store``, ``engine``, ``ready()`` and ``new_session()`` are the current tenant's
    (``tenancy.using_tenant``): the default store outside any tenant, a tenant's own store (built
    on first use from ``outbox_tenants``) inside one.

    ``integrations`` are the frameworks the outbox may join (``Integration``): the first active
    one gives the store its database, unless ``outbox_database_url`` or an engine is given, and
    its transactions and attempts when the store is its database. ``archiver_for`` builds the
    archiver of a folder: ``outbox_archive_path``'s for the default store, and its tenant's folder
    for each tenant (``archiver``). ``owner`` is the object the library's signals name as
    their sender (the ``Outbox``).
    """

    def __init__(self, app: Celery, owner: Any, engine: Engine | None = None,
                 overrides: dict[str, Any] | None = None, integrations: Sequence[Integration] = (),
                 archiver_for: Callable[[str], Archiver] | None = None, async_engine: Any = None):
        self.app = app
        self.owner = owner
        self.given_engine = engine
        self.given_async_engine = async_engine
        self._async_engine: Any = async_engine
        self._async_engines: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # loop -> LoopEngine
        self._tenant_async_engines: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._primary_fresh = True  # no loop has used async_engine yet
        self._primary_disposed = threading.Event()  # the loop that used it last shut down, closing its connections
        self.overrides = dict(overrides or {})
        self.integrations = tuple(integrations)
        self.archiver_for = archiver_for
        self._archiver: Archiver | None = None  # the default store's (``archiver``)
        self._archive_root: str | None = None  # the outbox_archive_path it writes; None: an archiver given
        self._tenant_archivers: dict[str, Archiver] = {}
        self.integration: Integration | None = None  # the framework whose transactions the outbox joins
        self._lock = threading.RLock()
        self._settings: OutboxSettings | None = None
        self._default: StoreSlot | None = None
        self._tenant_slots: dict[str, StoreSlot] = {}
        self._known_tenants: dict[str, TenantPlace] = {}
        self._engine_extra: dict[str, Any] = {}  # options a worker added to size its pools
        self._when_loaded: list[Callable[[], None]] = []
        setattr(app, _APP_ATTRIBUTE, self)
        _runtimes[next(_installed)] = self

    def __repr__(self) -> str:
        return f"<Runtime app={self.app.main!r}>"

    def when_loaded(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the settings are read (now, if they are)."""
        if self._settings is not None:
            callback()
        else:
            self._when_loaded.append(callback)

    def load(self) -> None:
        """Read and validate the settings, build the engine, the store and the sessions (once)."""
        with self._lock:
            if self._settings is not None:
                return
            conf = self.app.conf  # may configure the app, which re-enters load via on_after_configure
            if self._settings is not None:
                return
            settings = read_settings(conf, namespace=self.app.namespace, environ=os.environ, **self.overrides)
            active = next((each for each in self.integrations if each.active()), None)
            if active is not None and self.given_engine is None:
                settings, joins = active.store_settings(settings)
                self.integration = active if joins else None
            engine = self.given_engine or build_engine(settings.database_url, settings.engine_options)
            self._default = _slot(Store(engine, settings.table_prefix))
            if settings.archive_path and self._archiver is None:
                if self.archiver_for is None:
                    raise ConfigurationError("outbox_archive_path is set, and this outbox has no archiver to write "
                                             "it with")
                self._archiver = self.archiver_for(settings.archive_path)
                self._archive_root = settings.archive_path
            self._settings = settings
            callbacks, self._when_loaded = self._when_loaded, []
        for callback in callbacks:
            callback()

    @property
    def archiver(self) -> Archiver | None:
        """The current tenant's archiver (None: nothing is archived). Built from
        ``outbox_archive_path``, a tenant's writes the tenant's folder of it (``tenant_folder``:
        ``<path>/tenants/<name>``), built on the tenant's first use; an archiver given (assigned
        here) receives every store's rows, ``current_tenant()`` naming whose."""
        if self._settings is None:
            self.load()
        tenant, default = current_tenant(), self._archiver
        if tenant is None or default is None or self._archive_root is None:
            return default
        held = self._tenant_archivers.get(tenant)
        if held is None:
            assert self.archiver_for is not None
            with self._lock:
                held = self._tenant_archivers.get(tenant)
                if held is None:
                    held = self._tenant_archivers[tenant] = self.archiver_for(
                        tenant_folder(self._archive_root, tenant))
        return held

    @archiver.setter
    def archiver(self, archiver: Archiver | None) -> None:
        with self._lock:
            self._archiver, self._archive_root = archiver, None
            self._tenant_archivers = {}

    def use_database_url(self, url: str) -> None:
        """Make ``url`` the store's URL, over ``app.conf`` and the environment (the CLI's
        ``--database-url``); before the settings are read, or when they already name it."""
        with self._lock:
            if self._settings is not None and self._settings.database_url != url:
                raise ConfigurationError(
                    f"the outbox of app {self.app.main!r} already uses the store at {self.default_store.describe()}; "
                    "a database URL must be given before the app's outbox is first used")
            self.overrides["database_url"] = url

    @property
    def settings(self) -> OutboxSettings:
        """The validated, frozen settings (read from ``app.conf`` on first need)."""
        if self._settings is None:
            self.load()
        assert self._settings is not None
        return self._settings

    @property
    def store(self) -> Store:
        """The current tenant's message store (the default one outside any tenant); ``ready()``
        first makes sure its tables exist. Raises ``UnknownTenant`` for a tenant
        ``outbox_tenants`` does not name."""
        return self._slot().store

    @property
    def default_store(self) -> Store:
        """The store of code that works for no tenant: nodes' registry, dead letters of unknown tenants."""
        return self._default_slot().store

    def _default_slot(self) -> StoreSlot:
        if self._default is None:
            self.load()
        assert self._default is not None
        return self._default

    def _slot(self) -> StoreSlot:
        tenant = current_tenant()
        if tenant is None:
            return self._default_slot()
        held = self._tenant_slots.get(tenant)
        return held if held is not None else self._tenant_slot(tenant)

    def _tenant_slot(self, tenant: str) -> StoreSlot:
        """Build the store of ``tenant`` (once), from where ``outbox_tenants`` places it."""
        place = self.tenant_places(refresh_for=tenant).get(tenant)
        if place is None:
            raise UnknownTenant(tenant)
        with self._lock:
            held = self._tenant_slots.get(tenant)
            if held is None:
                settings = self.settings
                options = {**settings.engine_options, **self._engine_extra}
                if place.schema is not None:
                    options = _with_search_path(options, place.schema)
                engine = build_engine(self._url_of(place), options)
                held = self._tenant_slots[tenant] = _slot(Store(engine, settings.table_prefix, schema=place.schema))
        return held

    def _url_of(self, place: TenantPlace) -> str:
        """The database URL of a tenant's store: its own, or its Django database's."""
        if place.django is None:
            return place.url
        if self._settings is not None and self.integration is None:
            raise ConfigurationError(f"a tenant is placed in Django's database {place.django!r}, and the outbox "
                                     "does not join Django's transactions: add celery_outbox.django to "
                                     "INSTALLED_APPS and keep the default store in Django's database")
        assert self.integration is not None
        return self.integration.tenant_database_url(place.django)

    def tenant_places(self, refresh_for: str | None = None) -> Mapping[str, TenantPlace]:
        """Where each tenant's store is (``outbox_tenants``), read-only: a callable source is asked
        the first time, and again for a name it has not returned (``refresh_for``), so tenants added
        while the process runs are found; a tenant once known stays where it was. No copy is made:
        each send in a Django atomic block asks."""
        source = self.settings.tenants
        if not callable(source):
            return MappingProxyType(source)
        known = self._known_tenants
        if not known or (refresh_for is not None and refresh_for not in known):
            fresh = read_tenants("outbox_tenants (as the callable returned them)", source())
            with self._lock:
                self._known_tenants = known = {**fresh, **self._known_tenants}
        return MappingProxyType(known)

    def tenants(self) -> list[str]:
        """Every tenant's name, sorted (asking a callable ``outbox_tenants`` again)."""
        if callable(self.settings.tenants):
            with self._lock:
                self._known_tenants = {}
        return sorted(self.tenant_places())

    def tenant_stores(self) -> list[Store]:
        """Every tenant store built in this process so far (not the default one)."""
        return [slot.store for slot in list(self._tenant_slots.values())]

    @property
    def joined(self) -> Integration | None:
        """The framework whose transactions the outbox joins (its store is the framework's
        database: Django's ``outbox_django_database``), or None."""
        if self._settings is None:
            self.load()
        return self.integration

    @property
    def engine(self) -> Engine:
        return self.store.engine

    @property
    def async_engine(self) -> Any:
        """The ``AsyncEngine`` of async units of work, on the store's database: the one given to
        ``Outbox``, or one built on first use from ``outbox_async_database_url`` or the store's URL
        (``build_async_engine``, which names the extra when asyncio support is missing)."""
        if self._async_engine is None:
            with self._lock:
                if self._async_engine is None:
                    self._async_engine = self._build_async_engine()
        return self._async_engine

    def async_engine_of_running_loop(self) -> Any:
        """The async engine for the running event loop. A driver's connections belong to the loop
        that made them: each loop gets an engine no other live loop uses (``async_engine`` when it
        is free), whose connections are closed when the loop shuts down (``LoopEngine``); the
        engines of loops closed without that are let go. An engine given to ``Outbox`` serves
        every loop: sharing it between loops is its owner's care."""
        import asyncio

        tenant = current_tenant()
        if tenant is not None:
            return self._tenant_async_engine(asyncio.get_running_loop(), tenant)
        if self.given_async_engine is not None:
            return self.given_async_engine
        loop = asyncio.get_running_loop()
        held = self._async_engines.get(loop)
        if held is not None:
            return held.engine
        from ..store.async_engine import LoopEngine

        with self._lock:
            for closed in [each for each in self._async_engines if each.is_closed()]:
                del self._async_engines[closed]
            live = [held.engine for held in self._async_engines.values()]
            primary = self.async_engine
            free = primary not in live and (self._primary_fresh or self._primary_disposed.is_set())
            engine = primary if free else self._build_async_engine()
            if engine is primary:
                self._primary_fresh = False
                self._primary_disposed.clear()
            held = self._async_engines[loop] = LoopEngine(
                engine, self._primary_disposed if engine is primary else None)
        return held.engine

    def _tenant_async_engine(self, loop: Any, tenant: str) -> Any:
        """The async engine of ``tenant``'s store for ``loop``: built from the store's URL with
        its async driver on first use, its connections closed when the loop shuts down."""
        from ..store.async_engine import LoopEngine, build_async_engine

        engines = self._tenant_async_engines.get(loop)
        held = None if engines is None else engines.get(tenant)
        if held is None:
            store = self.store
            engine = build_async_engine(store.engine.url, None, {**self.settings.engine_options, **(
                {} if store.schema is None else _with_search_path({}, store.schema))})
            with self._lock:
                held = self._tenant_async_engines.setdefault(loop, {}).setdefault(tenant, LoopEngine(engine, None))
        return held.engine

    def _build_async_engine(self) -> Any:
        from ..store.async_engine import build_async_engine

        settings = self.settings
        return build_async_engine(self.store.engine.url, settings.async_database_url, settings.engine_options)

    @property
    def is_ready(self) -> bool:
        """Whether ``ready()`` has passed for the current tenant's store: it would return at once."""
        return self._slot().ready

    def ready(self) -> "Runtime":
        """Check the database answers and its tables exist (creating them when
        ``outbox_auto_create_schema`` is on). Raises ``StoreUnavailable`` (the database cannot be
        reached), ``ConfigurationError`` or ``IncompatibleSchema`` (tables of a newer release) with
        one clear message; a connection lost under one of its statements raises SQLAlchemy's
        ``OperationalError``, as any statement does. Cheap once it has passed."""
        slot = self._slot()
        if slot.ready:
            return self
        with self._lock:
            if slot.ready:
                return self
            store = slot.store
            if self.settings.auto_create_schema:
                store.migrate()
            else:
                missing = store.missing_tables()
                if missing:
                    raise ConfigurationError(
                        f"the message store at {store.describe()} has no tables {', '.join(missing)} and "
                        "outbox_auto_create_schema is off: run 'celery -A <your app> outbox migrate'"
                    )
                store.refuse_newer_schema()
            slot.ready = True
        return self

    def status(self, **options: Any) -> dict[str, Any]:
        """The store's status report (``Store.status``), the dead letters of task names this app
        does not register counted as one group."""
        return self.ready().store.status(known_tasks=tuple(self.app.tasks.keys()), **options)

    def migrate(self) -> Any:
        """Create or upgrade the tables; the store is ready after it."""
        slot = self._slot()
        result = slot.store.migrate()
        slot.ready = True
        return result

    def new_session(self, bind: Connection | None = None) -> Session:
        """A new Session on the engine (the caller closes it). With ``bind``, a Session that joins
        that connection's open transaction: its ``commit()`` only flushes, the connection's owner
        commits; its ``rollback()`` rolls the transaction back."""
        sessions = self.ready()._slot().sessions
        if bind is None:
            return sessions()
        return sessions(bind=bind, join_transaction_mode="rollback_only")

    def after_fork_in_child(self) -> None:
        """A forked child (a prefork pool process) must not reuse its parent's database connections."""
        for slot in [self._default, *list(self._tenant_slots.values())]:
            if slot is not None:
                slot.store.engine.dispose(close=False)
        for engine in {self._async_engine, *(held.engine for held in self._async_engines.values())} - {None}:
            engine.sync_engine.dispose(close=False)

    def rebuild_engine(self, engine_options: dict[str, Any]) -> None:
        """Replace the engine by one built with ``engine_options`` added to the settings' (a worker
        sizing its pool); the old one's connections are closed, the store checks again on ``ready()``."""
        settings = self.settings
        with self._lock:
            default = self._default_slot()
            old = [default.store.engine, *(slot.store.engine for slot in self._tenant_slots.values())]
            self._engine_extra = dict(engine_options)
            engine = build_engine(settings.database_url, {**settings.engine_options, **engine_options})
            self._default = _slot(Store(engine, settings.table_prefix))
            self._tenant_slots = {}  # built again, sized alike, on first use
        for each in old:
            each.dispose()


def _slot(store: Store) -> StoreSlot:
    sessions = sessionmaker(store.engine, expire_on_commit=False, info=session_info())
    listen_to_sessions(sessions)
    return StoreSlot(store, sessions)


def _with_search_path(options: dict[str, Any], schema: str) -> dict[str, Any]:
    """Engine options whose PostgreSQL connections search ``schema`` first (a tenant's schema)."""
    connect_args = dict(options.get("connect_args") or {})
    connect_args["options"] = f"{connect_args.get('options', '')} -c search_path={schema}".strip()
    return {**options, "connect_args": connect_args}


_runtimes: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()
_installed = itertools.count()


def installed_runtimes() -> list[Runtime]:
    """The runtime of every outbox installed in this process (and still alive), oldest first."""
    return [runtime for _, runtime in sorted(_runtimes.items())]


def runtime_of(app: Any) -> Runtime | None:
    """The runtime of the outbox installed on ``app``, or None."""
    return getattr(app, _APP_ATTRIBUTE, None)
