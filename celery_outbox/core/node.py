"""This process's node: its identity in the store, its heartbeat thread and its liveness lock.

Transaction boundary: registering, each heartbeat, each deferred claim release (``release_later``)
and deregistering are short transactions of their own, outside any unit of work; on PostgreSQL the
liveness lock is a session-level advisory lock held on a connection of its own, outside the pool,
for the process's life. Guarantee: a process that dies loses its lock with its session, so
recovery declares it dead at its first pass after its heartbeat falls silent (on SQLite, after the
stale checks), releases its claims and redelivers at once the unacknowledged rows naming it
their sender; a paused process keeps its lock and is never declared dead. The rules and timings
are in docs/inbox.md (Worker nodes) and docs/publishing.md (Durable queues).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..store import Store, node_lock_key, utcnow
from ..vocabulary import Attempt
from . import log_fields
from .runtime import Runtime
from .tenancy import current_tenant, using_tenant

__all__ = ["Node", "Nodes", "release_inherited_socket", "node_lock_key", "this_host"]

logger = logging.getLogger("celery_outbox.node")


def this_host() -> str:
    """The host name a node of this machine is registered under (with its process id)."""
    return socket.gethostname()


_INHERITED: list[Any] = []  # a parent's connections, held for this process's life: never finalized here


def release_inherited_socket(connection: Any) -> None:
    """Let go of this process's copy of the socket of ``connection`` (a SQLAlchemy connection made
    by the parent of this forked process) and leave the parent's session alone: the descriptor
    is replaced by ``/dev/null`` (its number stays taken, so nothing the driver might still do
    with it reaches another file or socket), and the connection object is held, never used and
    never finalized here (a finalizer would roll back or end the parent's session)."""
    _INHERITED.append(connection)
    try:
        fd = connection.connection.dbapi_connection.pgconn.socket
    except Exception as exc:  # noqa: BLE001 - not psycopg, or the session is gone already: nothing to release
        logger.debug("celery-outbox: no inherited liveness socket to release: %s", exc)
        return
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    except OSError as exc:
        logger.debug("celery-outbox: releasing the inherited liveness socket: %s", exc)


@dataclass(frozen=True)
class PendingRelease:
    """A claim of this node that its attempt could not release: the key and the attempt."""

    message_id: str
    destination: str
    attempt: Attempt
    send_id: str = ""
    handed_back: bool = True  # the broker holds a copy of the message: recovery waits (Inbox._release_claim)

    def log_fields(self) -> dict[str, Any]:
        """The log fields of the claim's message (its task is not known here)."""
        return log_fields.fields(self.message_id, None, self.destination, self.attempt)


class Node:
    """This process's node in one store (the default one, or ``tenant``'s); ``Node.id`` registers
    it on first use."""

    def __init__(self, runtime: Runtime, tenant: str | None = None):
        self.runtime = runtime
        self.tenant = tenant
        self._lock = threading.Lock()
        self._id: int | None = None
        self._pid: int | None = None
        self._name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._liveness_connection: Any = None
        self._lock_key: int | None = None
        self._pending_releases: dict[PendingRelease, int] = {}  # the claim -> the node id that owns it
        self._prepare_again_at = 0.0  # monotonic: after a registration failed, when ``prepare`` tries again
        self._registering: tuple[int, threading.Thread] | None = None  # (pid, thread) of a background one
        self._registering_lock = threading.Lock()
        self._exit_hook = False
        self._serving = False  # a worker's node: kept registered (``serve_as_worker``)

    @property
    def id(self) -> int:
        """The node id of this process, registering the node (and its heartbeat) if needed."""
        if self._id is not None and self._pid == os.getpid():
            return self._id
        with self._lock:
            if self._id is None or self._pid != os.getpid():
                self._register()
            assert self._id is not None
            return self._id

    @property
    def name(self) -> str | None:
        return self._name if self._pid == os.getpid() else None

    def registered(self) -> bool:
        return self._id is not None and self._pid == os.getpid()

    def prepare(self) -> None:
        """Register this node now unless it is, outside any transaction (a unit of work about to
        begin, that may store messages marked sent). Never raises: a failure is logged and tried
        again no sooner than a heartbeat interval later; meanwhile rows name no sender."""
        if self.registered() or time.monotonic() < self._prepare_again_at:
            return
        try:
            _ = self.id
        except Exception as exc:  # noqa: BLE001 - the unit of work meets the database's error itself
            self._prepare_again_at = time.monotonic() + self.runtime.settings.node_heartbeat_interval
            logger.warning("celery-outbox: cannot register this process's node yet (its sends stored marked sent "
                           "are left to delivery tracking): %s", exc)

    def serve_as_worker(self) -> None:
        """A worker is ready: register its node now and keep it registered while the process runs
        (a node recovery declared dead, after the database was out of reach for long, registers
        again at its next heartbeat). Never raises: a failure is logged, and a thread of its own
        tries again every heartbeat interval (``_register_until_done``)."""
        self._serving = True
        self._register_until_done()

    def _register_until_done(self) -> None:
        """Register a serving node now, or, when the database does not answer, in a thread of its
        own that tries again every heartbeat interval until it is."""
        self.prepare()
        if self.registered() or not self._serving:
            return
        pid, interval = os.getpid(), self.runtime.settings.node_heartbeat_interval

        def keep_trying() -> None:
            while self._serving and os.getpid() == pid and not self.registered():
                time.sleep(interval)
                self._prepare_again_at = 0.0
                self.prepare()

        threading.Thread(target=keep_trying, name="celery-outbox-register", daemon=True).start()

    def stop_serving(self) -> None:
        """The worker shuts down: deregister its node (its pool has drained) and register no more."""
        self._serving = False
        self.deregister()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's node, its heartbeat thread and its locks are not this
        process's. The child lets go of its copy of the liveness connection's socket
        (``release_inherited_socket``), so that the parent's liveness session (and its lock) ends
        when the parent dies, not when its last child does."""
        self._lock = threading.Lock()
        self._registering_lock = threading.Lock()
        self._registering = None
        self._thread = None
        self._serving = False
        self._pending_releases = {}
        connection, self._liveness_connection = self._liveness_connection, None
        if connection is not None:
            release_inherited_socket(connection)

    def sender_id(self) -> int | None:
        """The id a row stored marked sent names as its sender: this node's, or None while it is
        not registered. On PostgreSQL ``prepare`` then runs in a thread of its own (the caller's
        transaction is open, and registering beside it in this thread could wait for that
        transaction's own locks); on SQLite a node registers only for eager claims
        (``Publisher.prepare_sender`` says why)."""
        if self.registered():
            return self._id
        if not self._store().is_postgres:
            return None
        with self._registering_lock:  # not ``_lock``: a registration holds it while it waits for the database
            registering = self._registering
            if registering is None or registering[0] != os.getpid() or not registering[1].is_alive():
                thread = threading.Thread(target=self.prepare, name="celery-outbox-register", daemon=True)
                self._registering = (os.getpid(), thread)
                thread.start()
        return None

    def _register(self) -> None:
        if self._pid == os.getpid():
            self._drop_liveness()  # this process's node was declared dead: its lock goes too
        # After a fork the parent's thread and connection are not ours: start afresh.
        self._stop = threading.Event()
        self._liveness_connection = None
        store = self._store(ready=True)
        hostname = this_host()
        pid = os.getpid()
        name = f"{hostname}:{pid}:{uuid.uuid4().hex[:12]}"
        self._pending_releases = {}
        if store.is_postgres:
            self._liveness_connection = store.connect_outside_pool()
            node_id = store.register_node(name, hostname, pid, conn=self._liveness_connection,
                                          lock_key=lambda new_id: node_lock_key(new_id, store.lock_scope))
            self._lock_key = node_lock_key(node_id, store.lock_scope)
        else:
            node_id = store.register_node(name, hostname, pid)
            self._lock_key = None
        self._id, self._pid, self._name = node_id, pid, name
        interval = self.runtime.settings.node_heartbeat_interval
        self._thread = threading.Thread(target=self._beat, args=(node_id, interval, self._stop),
                                        name="celery-outbox-heartbeat", daemon=True)
        self._thread.start()
        if not self._exit_hook:
            atexit.register(self._deregister_at_exit)
            self._exit_hook = True
        logger.info("celery-outbox: node %s registered as %d%s", name, node_id,
                    f" in the store of tenant {self.tenant}" if self.tenant is not None else "")

    def _deregister_at_exit(self) -> None:
        """A normal exit: every send this process committed was published, or given back."""
        try:
            self.deregister()
        except Exception as exc:  # noqa: BLE001 - recovery declares the node dead instead
            logger.warning("celery-outbox: could not deregister node at exit: %s", exc)

    def _beat(self, node_id: int, interval: float, stop: threading.Event) -> None:
        store = self._store()
        while not stop.wait(interval):
            try:
                if not store.heartbeat(node_id):
                    logger.error("celery-outbox: node %d was declared dead by recovery (no heartbeat for "
                                 "too long); %s", node_id,
                                 "it registers again" if self._serving else "the next claim registers a new node")
                    with self._lock:
                        if self._id == node_id:
                            self._id = None
                    if self._serving:
                        self._register_until_done()
                    return
            except Exception as exc:  # noqa: BLE001 - the heartbeat thread must outlive a database blip
                logger.warning("celery-outbox: heartbeat of node %d failed: %s", node_id, exc)
                continue
            self._keep_liveness(node_id, stop)
            self._release_pending(node_id)

    def _keep_liveness(self, node_id: int, stop: threading.Event) -> None:
        """Check the liveness connection with one round trip; when the server ended its session,
        connect again and take the liveness lock again (later beats try again while it fails).
        Only this thread uses the connection once the node is registered."""
        if self._lock_key is None:
            return
        store = self._store()
        connection = self._liveness_connection
        try:
            if connection is None:
                raise ConnectionError("no liveness connection")
            store.ping_liveness(connection)
            return
        except Exception as exc:  # noqa: BLE001 - any failure means the session and its lock are gone
            logger.warning("celery-outbox: the liveness connection of node %d was lost (%s); connecting again",
                           node_id, exc)
        with self._lock:
            if self._id == node_id:
                self._drop_liveness()
        try:
            connection = store.connect_outside_pool()
        except Exception as exc:  # noqa: BLE001 - the database is away: the next beat tries again
            logger.warning("celery-outbox: node %d cannot reconnect its liveness connection: %s", node_id, exc)
            return
        try:
            held = store.hold_liveness_lock(connection, self._lock_key)
        except Exception as exc:  # noqa: BLE001 - as above
            logger.warning("celery-outbox: node %d cannot take its liveness lock again: %s", node_id, exc)
            held = False
        with self._lock:
            if held and self._id == node_id and not stop.is_set():
                self._liveness_connection = connection
                logger.info("celery-outbox: node %d holds its liveness lock again", node_id)
                return
        connection.invalidate()  # not back to the pool: it may hold the lock
        connection.close()

    def release_later(self, message_id: str, destination: str, attempt: Attempt, send_id: str,
                      handed_back: bool) -> None:
        """Remember a claim of this node that its attempt could not release (the database was
        unreachable): the heartbeat thread releases it as soon as the database answers, due for
        recovery as ``Inbox._release_claim`` says (``handed_back``: the broker holds a copy)."""
        with self._lock:
            if self.registered():
                assert self._id is not None
                self._pending_releases[PendingRelease(message_id, destination, attempt, send_id,
                                                      handed_back)] = self._id

    def _release_pending(self, node_id: int) -> None:
        with self._lock:
            pending = [claim for claim, owner in self._pending_releases.items() if owner == node_id]
        store, settings = self._store(), self.runtime.settings
        for claim in pending:
            try:
                with store.begin() as conn:
                    store.release_claim(conn, claim.message_id, claim.destination, node_id, claim.attempt,
                                        settings.released_claim_recovery(utcnow(), claim.handed_back), claim.send_id)
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                logger.warning("celery-outbox: node %d could not release the claim of %s yet: %s", node_id,
                               claim.message_id, exc, **claim.log_fields())
                return
            with self._lock:
                self._pending_releases.pop(claim, None)
            logger.info("celery-outbox: node %d released the claim of %s", node_id, claim.message_id,
                        **claim.log_fields())

    def deregister(self) -> None:
        """Stop the heartbeat, release everything this node owns and delete its row."""
        with self._lock:
            if not self.registered():
                return
            node_id = self._id
            self._stop.set()
            self._id = None
            try:
                self._store().deregister_node(node_id)
            finally:
                self._drop_liveness()
        logger.info("celery-outbox: node %d deregistered", node_id)

    def _store(self, ready: bool = False) -> Store:
        """The store this node is registered in (``ready``: its tables checked first)."""
        with using_tenant(self.tenant):
            return self.runtime.ready().store if ready else self.runtime.store

    def _drop_liveness(self) -> None:
        if self._liveness_connection is not None:
            # invalidate, not close: a pooled connection would keep the session lock
            try:
                self._liveness_connection.invalidate()
                self._liveness_connection.close()
            except Exception as exc:  # noqa: BLE001 - the connection is being thrown away anyway
                logger.debug("celery-outbox: dropping the liveness connection: %s", exc)
            self._liveness_connection = None


class Nodes:
    """This process's nodes: one in the default store, and one in each tenant store the process
    claims or sends in, each registered there on first use with its own heartbeat and, on
    PostgreSQL, its own liveness lock (a tenant's recovery decides a node's death in the tenant's
    own database). ``id``, ``prepare``, ``sender_id``, ``registered`` and ``release_later`` are
    the current tenant's node's; serving, forking and deregistering are every node's. No
    transaction of its own: each node's are as ``Node`` says."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.default = Node(runtime)
        self._tenants: dict[str, Node] = {}
        self._lock = threading.Lock()
        self._serving = False

    def here(self) -> Node:
        """The node of the current tenant's store."""
        tenant = current_tenant()
        if tenant is None:
            return self.default
        node = self._tenants.get(tenant)
        if node is None:
            with self._lock:
                node = self._tenants.get(tenant)
                if node is None:
                    node = self._tenants[tenant] = Node(self.runtime, tenant)
                    node._serving = self._serving  # a worker's: kept registered once it is
        return node

    def every(self) -> list[Node]:
        return [self.default, *list(self._tenants.values())]

    @property
    def id(self) -> int:
        return self.here().id

    @property
    def name(self) -> str | None:
        return self.here().name

    def registered(self) -> bool:
        return self.here().registered()

    def prepare(self) -> None:
        self.here().prepare()

    def sender_id(self) -> int | None:
        return self.here().sender_id()

    def release_later(self, message_id: str, destination: str, attempt: Attempt, send_id: str,
                      handed_back: bool) -> None:
        self.here().release_later(message_id, destination, attempt, send_id, handed_back)

    def serve_as_worker(self) -> None:
        """A worker is ready: its default node registers now; its tenant nodes register at their
        first claim, and every one is kept registered while the worker runs."""
        self._serving = True
        for node in self.every():
            node._serving = True
        self.default.serve_as_worker()

    def stop_serving(self) -> None:
        self._serving = False
        for node in self.every():
            node.stop_serving()

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._serving = False
        for node in self.every():
            node.forget_after_fork()

    def deregister(self) -> None:
        """Deregister every node of this process, each in its own store; one store's failure does
        not keep the others' nodes registered (recovery declares that one dead)."""
        failures = []
        for node in self.every():
            try:
                node.deregister()
            except Exception as exc:  # noqa: BLE001 - the others still deregister
                failures.append(exc)
        if failures:
            raise failures[0]
