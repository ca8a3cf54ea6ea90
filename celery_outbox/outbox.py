"""``Outbox(app)``: the composition root that installs celery-outbox on a Celery app.

It builds one ``Runtime`` and the parts that use it (the publisher, the node, the inbox), and
installs the publish hook, the app's task base, the consumer guard, the beat tasks and the worker
signals; each part is handed what it uses and none reaches back here. Transaction boundary: none
of its own; its methods open units of work (``transaction``, ``begin``) or run the maintenance
functions in their short transactions. No connection is made until ``ready()``, which workers and
beat call at start-up: a database that cannot be reached stops them with one clear error.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, AsyncContextManager, ContextManager

from celery import Celery, signals
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .consumer.celery_internals import app_task_base_used, pool_module, set_app_task_base, worker_concurrency
from .consumer.claims import InboxRows
from .consumer.guard import MessageGuard
from .consumer.inbox import Inbox
from .consumer.main_process import MainProcessOutcomes
from .consumer.outages import TenantOutages
from .consumer.records import AttemptRecords
from .consumer.tasks import InboxTask, give_inbox_to_every_task
from .consumer.window import check_dedupe_window, check_release_ahead
from .core.config import OutboxSettings
from .core.node import Nodes
from .core.runtime import Archiver, Runtime, runtime_of
from .django.integration import DjangoIntegration
from .errors import ConfigurationError, OutboxError
from .maintenance.beat import register_beat_tasks, schedule_beat_tasks
from .maintenance.cleanup import CleanupResult, cleanup
from .maintenance.recover import RecoverResult, recover
from .maintenance.relay import RelayResult, relay
from .producer.publish_hook import defer_while_sending, install_publish_hook
from .producer.publishing import Publisher
from .producer.unit_of_work import begin, transaction
from .store import Store
from .store.status import DEFAULT_RECENT, DEFAULT_STUCK_AFTER

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from .producer.async_unit_of_work import AsyncUnitsOfWork

__all__ = ["Outbox"]

logger = logging.getLogger("celery_outbox")

# Pools whose tasks share one process, and so one engine
THREADED_POOL_MODULES = ("celery.concurrency.thread", "celery.concurrency.gevent", "celery.concurrency.eventlet")
# Connections of the pool a node takes beside its tasks': the heartbeat's (the liveness lock's
# connection, on PostgreSQL, is outside the pool)
NODE_CONNECTIONS = 1


class Outbox:
    """The outbox and inbox of one Celery app.

    ``Outbox(app)`` takes its settings from ``app.conf`` (``outbox_*``,
    ``CELERY_OUTBOX_*`` or a Django namespace); keyword arguments override them
    (``Outbox(app, database_url=...)``). ``Outbox(app, engine=engine)`` uses an
    existing SQLAlchemy engine instead of ``outbox_database_url``.
    """

    app: Celery

    def __new__(cls, app: Celery, engine: Engine | None = None, async_engine: "AsyncEngine | None" = None,
                **overrides: Any) -> "Outbox":
        runtime = runtime_of(app)
        if runtime is not None:
            if (engine is not None and engine is not runtime.given_engine) or (
                async_engine is not None and async_engine is not runtime.given_async_engine) or (
                overrides and overrides != runtime.overrides
            ):
                raise ConfigurationError(
                    f"Outbox(app) was already called on app {app.main!r} with other arguments; "
                    "call it once and share the object"
                )
            return runtime.owner
        return super().__new__(cls)

    def __init__(self, app: Celery, engine: Engine | None = None, async_engine: "AsyncEngine | None" = None,
                 **overrides: Any) -> None:
        runtime = runtime_of(app)
        if runtime is not None and runtime.owner is self:
            return
        self.app = app
        self.runtime = Runtime(app, self, engine, overrides, integrations=(DjangoIntegration(),),
                               archiver_for=_parquet_archiver, async_engine=async_engine)
        self._async_units: "AsyncUnitsOfWork | None" = None
        self.nodes = Nodes(self.runtime)
        self.node = self.nodes.default  # this process's node in the default store
        self.publisher = Publisher(self.runtime, self.nodes)
        rows = InboxRows(self.runtime)
        records = AttemptRecords(self.runtime, rows, self.nodes)
        self.inbox = Inbox(self.runtime, self.publisher, self.nodes, rows, records)
        self.inbox.install()
        MainProcessOutcomes(self.runtime, rows, TenantOutages()).install()
        install_publish_hook(self.publisher)
        _install_task_base(app)
        if MessageGuard not in app.steps["consumer"]:
            app.steps["consumer"].add(MessageGuard)
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        signals.worker_init.connect(self._on_worker_init, weak=False)
        signals.beat_init.connect(self._on_beat_init, weak=False)
        # warm shutdown: the pool has drained; release what this process's node owns
        signals.worker_process_shutdown.connect(self._on_process_shutdown, weak=False)
        signals.worker_shutdown.connect(self._on_worker_shutdown, weak=False)
        signals.worker_ready.connect(self._on_worker_ready, weak=False)
        register_beat_tasks(self.runtime)
        self.runtime.when_loaded(lambda: schedule_beat_tasks(self.runtime))
        if app.configured:
            self.runtime.load()
        else:
            app.on_after_configure.connect(self._on_after_configure, weak=False)

    def __repr__(self) -> str:
        return f"<Outbox app={self.app.main!r}>"

    # -- worker and beat start-up and shutdown -----------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """A forked child (a prefork pool process) has its own connections and its own node."""
        self.runtime.after_fork_in_child()
        self.nodes.forget_after_fork()

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        """The worker consumes: its main process is a node while it runs (``Node.serve_as_worker``)."""
        if getattr(sender, "app", None) is self.app:
            self.nodes.serve_as_worker()

    def _on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", self.app) is not self.app:
            return
        try:
            self.nodes.stop_serving()
        except Exception as exc:  # noqa: BLE001 - recovery releases the rows of a node that did not
            logger.warning("celery-outbox: could not deregister node at shutdown: %s", exc)

    def _on_process_shutdown(self, sender: Any = None, **_: Any) -> None:
        try:
            self.nodes.deregister()
        except Exception as exc:  # noqa: BLE001 - recovery releases the rows of a node that did not
            logger.warning("celery-outbox: could not deregister node at shutdown: %s", exc)

    def _on_beat_init(self, sender: Any = None, **_: Any) -> None:
        """Beat starts: as a worker's start-up, and its shutdown signals (SIGTERM, SIGINT) wait
        for a publish under way to end (``defer_while_sending``)."""
        self._on_worker_init(sender)
        if getattr(sender, "app", self.app) is self.app and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                handler = signal.getsignal(signum)
                if callable(handler) and not getattr(handler, "defers_while_sending", False):
                    signal.signal(signum, defer_while_sending(handler))

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        """Worker and beat start-up: the store must answer, or the process stops with one clear line."""
        app = getattr(sender, "app", None)
        if app is not None and app is not self.app:
            return
        worker = sender is not None and hasattr(sender, "pool_cls")
        if worker:
            self._size_engine_for(sender)
            self._give_inbox_to_every_task()
        try:
            self.ready()
            if worker and self.settings.metrics_port is not None:
                from .monitoring.metrics import serve_from_worker  # before the pool forks: its processes count too

                serve_from_worker(self, self.settings.metrics_port, self.settings.metrics_address)
        except OutboxError as exc:
            logger.critical("celery-outbox: %s", exc)
            raise SystemExit(f"celery-outbox cannot start: {exc}") from None
        check_dedupe_window(self.app, self.settings.keep_after_handling)
        check_release_ahead(self.app, self.settings.release_ahead_seconds)

    def _give_inbox_to_every_task(self) -> None:
        """A worker: tasks whose class bypasses the app's task base go through the inbox too
        (``tasks.give_inbox_to_every_task``), in this process and in the pool's, forked after it."""
        changed = give_inbox_to_every_task(self.app)
        if changed:
            logger.info("celery-outbox: tasks whose class does not derive from the app's task base go through the "
                        "inbox on durable queues: %s", ", ".join(sorted(changed)))

    def _size_engine_for(self, worker: Any) -> None:
        """A worker whose pool runs its tasks in threads or greenlets of one process (threads,
        gevent, eventlet) shares one engine among them: size its pool from the concurrency, so
        that every task can hold its attempt's connection (one at a time) beside the node's
        heartbeat's (its liveness connection is outside the pool), with as many again in overflow
        for whatever else in the process uses the engine at the same moment. An engine given to
        ``Outbox(app, engine=...)`` or a ``pool_size`` in ``outbox_engine_options`` is the user's:
        a warning says when it is smaller."""
        concurrency = threaded_concurrency(worker)
        if concurrency is None:
            return
        runtime = self.runtime
        wanted = {"pool_size": concurrency + NODE_CONNECTIONS, "max_overflow": concurrency}
        pool_size = getattr(runtime.store.engine.pool, "size", lambda: None)()
        if runtime.given_engine is not None or "pool_size" in runtime.settings.engine_options:
            if pool_size is not None and pool_size < wanted["pool_size"]:
                logger.warning("celery-outbox: the engine's pool holds %d connections and the worker runs %d tasks "
                               "at once: give it pool_size=%d or more", pool_size, concurrency, wanted["pool_size"])
            return
        if pool_size is None or pool_size >= wanted["pool_size"]:
            return
        runtime.rebuild_engine(wanted)
        logger.info("celery-outbox: engine pool sized for %d concurrent tasks (pool_size %d, max_overflow %d)",
                    concurrency, wanted["pool_size"], wanted["max_overflow"])

    def _on_after_configure(self, sender: Celery | None = None, **_: Any) -> None:
        if sender is self.app:
            self.runtime.load()

    # -- settings and store ---------------------------------------------------------------------

    @property
    def settings(self) -> OutboxSettings:
        """The validated, frozen settings, read from ``app.conf`` once; reading them makes no connection."""
        return self.runtime.settings

    @property
    def store(self) -> Store:
        """The message store; its tables are sure to exist only once ``ready()`` has passed."""
        return self.runtime.store

    @property
    def engine(self) -> Engine:
        """The store's SQLAlchemy engine: the one given to ``Outbox(app, engine=...)``, or the one built
        from the settings (``outbox_database_url``, or Django's database)."""
        return self.runtime.engine

    @property
    def archiver(self) -> Archiver | None:
        """Receives each batch cleanup deletes before its deleting transaction commits, and stops the
        delete when it raises: the delivery audit's archive (``outbox_archive_path``; inside
        ``using_tenant(name)``, that tenant's folder of it, ``tenants/<name>``). One assigned here
        receives every store's batches."""
        return self.runtime.archiver

    @archiver.setter
    def archiver(self, archiver: Archiver | None) -> None:
        self.runtime.archiver = archiver

    def ready(self) -> "Outbox":
        """Makes sure the database answers and the tables exist (creating them when
        ``outbox_auto_create_schema`` is on), or raises one clear error; once it has passed it does
        nothing.

        Raises ``StoreUnavailable`` (the database cannot be reached), ``ConfigurationError`` or
        ``IncompatibleSchema`` (tables of a newer release); a connection lost under one of its
        statements raises SQLAlchemy's ``OperationalError``, as any statement does, for a caller's
        retry to catch."""
        self.runtime.ready()
        return self

    # -- units of work ---------------------------------------------------------------------------

    def transaction(self, session: Session | None = None, tenant: str | None = None) -> ContextManager[Session]:
        """Publishes every message the block sends only after its Session commits; a rollback
        publishes nothing but a ``retry`` or ``replace`` of the running task, which Celery decided on.

        ``with outbox.transaction() as session:`` opens a Session on the outbox's
        engine, commits when the block ends and rolls back on an exception.
        ``with outbox.transaction(session):`` joins a Session you own: its messages
        are published after that Session's commit, whenever you make it. A block
        inside an open one joins it. Messages for durable queues are stored in the
        outgoing table inside the same database transaction: once it commits, a broker
        outage or a crash delays them, never loses them.

        ``tenant`` (a name of ``outbox_tenants``) opens the Session on that tenant's database,
        stores the messages there and stamps them with the tenant, whose store the consuming
        inbox claims them in; ``UnknownTenant`` when it is not known (docs/tenancy.md).
        """
        return transaction(self.publisher, session, tenant)

    def begin(self, tenant: str | None = None) -> ContextManager[Connection]:
        """Publishes every message the block sends only after its transaction commits; a rollback
        publishes nothing but a ``retry`` or ``replace`` of the running task, which Celery decided on.

        ``with outbox.begin() as conn:`` begins a transaction on a connection of the outbox's
        engine, as ``engine.begin()`` does, commits when the block ends and rolls back on an
        exception; messages for durable queues are stored in the outgoing table inside the same
        transaction (on PostgreSQL their INSERT goes with the COMMIT), as with ``transaction()``.
        It makes no ORM Session: for code that writes with Core statements it costs less. A
        block inside an open unit of work joins it. Do not commit or roll back ``conn``
        yourself: the block ends the transaction (doing so raises ``OutboxError`` and drops the
        block's messages). ``tenant``: as ``transaction()``'s.
        """
        return begin(self.publisher, tenant)

    def atransaction(self, session: "AsyncSession | None" = None,
                     tenant: str | None = None) -> AsyncContextManager["AsyncSession"]:
        """Publishes every message the block sends only after its AsyncSession commits; a rollback
        publishes nothing. ``transaction()`` for asyncio code.

        ``async with outbox.atransaction() as session:`` opens an ``AsyncSession`` on the
        outbox's async engine (``async_engine``), commits when the block ends and rolls back on
        an exception; ``async with outbox.atransaction(session):`` joins an ``AsyncSession``
        you own, published after its commit. Durable messages are stored in the same
        transaction; what it committed is published by a pool of threads
        (``outbox_async_publish_threads``), never on the event loop, and the block ends once it
        is published. A cancellation after the commit does not stop the publish (docs/asyncio.md).
        ``tenant``: as ``transaction()``'s.
        """
        return self._async().transaction(session, tenant)

    def abegin(self, tenant: str | None = None) -> AsyncContextManager["AsyncConnection"]:
        """Publishes every message the block sends only after its transaction commits; a rollback
        publishes nothing. ``begin()`` for asyncio code: an ``AsyncConnection`` of the async
        engine, its transaction begun, committed when the block ends (durable messages inserted
        just before the COMMIT) and rolled back on an exception; published as ``atransaction()``
        publishes. ``tenant``: as ``transaction()``'s."""
        return self._async().begin(tenant)

    @property
    def async_engine(self) -> "AsyncEngine":
        """The ``AsyncEngine`` of async units of work: the one given to ``Outbox``, or one built
        from ``outbox_async_database_url``, by default the store's URL with its async driver."""
        return self.runtime.async_engine

    def _async(self) -> "AsyncUnitsOfWork":
        if self._async_units is None:
            from .producer.async_publishing import AsyncPublishing
            from .producer.async_unit_of_work import AsyncUnitsOfWork

            self._async_units = AsyncUnitsOfWork(AsyncPublishing(self.publisher))
        return self._async_units

    def new_session(self, bind: Connection | None = None) -> Session:
        """A new Session on the outbox's engine that holds no message back by itself: what is sent
        while it is open is captured only inside a unit of work (``transaction(session)``).

        The caller closes it. With ``bind``, a Session that joins that connection's open
        transaction: its ``commit()`` only flushes, the connection's owner commits; its
        ``rollback()`` rolls the transaction back."""
        return self.runtime.new_session(bind)

    # -- maintenance ---------------------------------------------------------------------------

    def relay(self, max_batches: int | None = None) -> RelayResult:
        """Publishes the outgoing rows committed and not published, at least once and never by two
        relays at once, one short transaction per batch (what each recover pass and ``outbox relay``
        run)."""
        return relay(self.runtime, max_batches)

    def recover(self, max_batches: int | None = None) -> RecoverResult:
        """Leaves no row stranded: one recover pass releases the claims of dead nodes (and stale ones,
        with ``outbox_inbox_stale_time``), relays, redelivers and re-publishes what was left, in
        short batches (what beat's ``celery_outbox.recover`` and ``outbox recover`` run)."""
        return recover(self.runtime, max_batches)

    def cleanup(self, max_batches: int | None = None) -> CleanupResult:
        """Deletes ended inbox rows only past their dedupe window and dead letters only past their
        retention, each batch archived before it is deleted when an archive is set (one pass, what
        beat's ``celery_outbox.cleanup`` and ``outbox cleanup`` run)."""
        return cleanup(self.runtime, max_batches)

    def migrate(self):
        """Creates or upgrades the tables, all the DDL in one transaction; idempotent, and two runs at
        once serialise (what ``celery -A proj outbox migrate`` runs)."""
        return self.runtime.migrate()

    def status(self, stuck_after: float = DEFAULT_STUCK_AFTER, recent: float = DEFAULT_RECENT,
               timeout: float | None = None) -> dict[str, Any]:
        """Reads the store's status in one transaction and writes nothing: counts, ages, rows waiting
        longer than ``stuck_after`` seconds, dead letters of the last ``recent`` seconds, and nodes.

        What ``celery -A proj outbox status`` prints, and what ``check`` and the metrics' gauges
        read. With ``timeout`` (seconds), it raises rather than wait longer on PostgreSQL for a
        locked table."""
        return self.runtime.status(stuck_after=stuck_after, recent=recent, timeout=timeout)


def threaded_concurrency(worker: Any) -> int | None:
    """The number of tasks a worker runs at once in one process (threads, gevent, eventlet
    pools); None for a pool of processes (prefork: each has its own engine) or solo."""
    if pool_module(worker) not in THREADED_POOL_MODULES:
        return None
    return worker_concurrency(worker)


def _parquet_archiver(path: str) -> Archiver:
    """The delivery audit's archive at ``path`` (``outbox_archive_path``): Parquet files, written
    with pyarrow (the ``spark`` extra), imported only when an archive is set."""
    from .audit.archive import ParquetArchiver

    return ParquetArchiver(path)


def _install_task_base(app: Celery) -> None:
    """Make the app's task base an ``InboxTask``: deliveries from durable queues go through the inbox."""
    from celery.utils.imports import symbol_by_name

    base = symbol_by_name(app.task_cls) if isinstance(app.task_cls, str) else app.task_cls
    if issubclass(base, InboxTask):
        return
    if app_task_base_used(app):
        logger.warning("celery-outbox: Outbox(app) was called after app.Task was used; tasks defined before it "
                       "do not store envelopes for durable queues. Call Outbox(app) before defining tasks.")
    set_app_task_base(app, type("InboxTask", (InboxTask, base), {"abstract": True, "__module__": InboxTask.__module__}))


def outbox_of(app: Celery) -> Outbox:
    """The ``Outbox`` installed on ``app``; a clear error when there is none."""
    runtime = runtime_of(app)
    if runtime is None:
        raise OutboxError(f"no Outbox is installed on app {app.main!r}: call Outbox(app) in your Celery module")
    return runtime.owner
