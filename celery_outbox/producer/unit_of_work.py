"""Units of work: what a transaction sends is stored before its commit and published after it.

Transaction boundary: the caller's. While a unit of work is open (``Outbox.transaction``,
``Outbox.begin``, a task attempt), every publish of the app is captured into it; its durable
messages are inserted with one statement just before the outermost COMMIT, in that transaction,
and everything captured is published in call order once the transaction has ended.
Guarantee: a rollback publishes nothing but a ``retry`` or ``replace`` of the running task (a
rolled-back SAVEPOINT drops only what it captured); a committed durable message whose publish
fails or never happens stays in the outgoing table for the relay or redelivery: delayed, never
lost. The open unit of work lives in a ``ContextVar``: each thread, greenlet or task has its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from sqlalchemy.engine import Connection, Engine, RootTransaction
from sqlalchemy.orm import Session, SessionTransaction

from ..core.crashpoints import crashpoint
from ..core.sessions import LISTENED_KEY, UNIT_OF_WORK_KEY, listen_to_sessions, wait_for_commit
from ..core.tenancy import current_tenant, using_tenant
from ..errors import OutboxError, StoreUnavailable, TransactionAborted
from ..message.envelope import OutgoingMessage
from ..store.outage import raise_as_driver_error
from .publishing import Publisher

__all__ = ["ConnectionUnitOfWork", "UnitOfWork", "begin", "current_connection", "current_session",
           "current_unit_of_work", "outside_unit_of_work", "run_body", "transaction"]

logger = logging.getLogger("celery_outbox.unit_of_work")

_current: ContextVar["UnitOfWork | None"] = ContextVar("celery_outbox_unit_of_work", default=None)


def current_unit_of_work() -> "UnitOfWork | None":
    """The unit of work open in the running context (a thread, greenlet or task), or None."""
    return _current.get()


@contextmanager
def outside_unit_of_work() -> Iterator[None]:
    """Run the block as if no unit of work were open: what it sends is not captured into the open
    one, and a unit of work it opens is a transaction of its own (any tenant's, in its store),
    committed when its block ends, whatever becomes of the open one."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def _for_its_tenant(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a unit of work's method for the unit's tenant (``UnitOfWork.tenant``): its store is the
    one the method's statements go to, wherever and whenever the commit or rollback happens."""

    @functools.wraps(method)
    def run(self: "UnitOfWork", *args: Any, **kwargs: Any) -> Any:
        if self.tenant == current_tenant():
            return method(self, *args, **kwargs)
        with using_tenant(self.tenant):
            return method(self, *args, **kwargs)

    return run


class UnitOfWork:
    """The messages captured while one Session's transaction is open: stored before its outermost
    commit, published after it, dropped on its rollback (all but a ``retry`` or ``replace`` of the
    running task).

    Bound to the Session through its events, so it publishes at that Session's
    outermost commit wherever the commit happens.
    """

    #: whether its publish goes to the publishing threads of async units of work
    is_async = False

    def __init__(self, publisher: "Publisher", session: Session | None):
        self.publisher = publisher
        #: the tenant whose store it stores its messages in and marks them sent in, wherever it commits
        self.tenant = current_tenant()
        self._session = session
        self.pending: list[OutgoingMessage] = []
        self._savepoints: dict[SessionTransaction, int] = {}
        self._committing = False
        self._committed = False  # the outermost commit happened; publish once the Session gave back its connection

    @property
    def session(self) -> Session:
        """The Session whose transaction this unit of work follows."""
        assert self._session is not None
        return self._session

    @property
    def connection(self) -> Connection:
        """The connection of the Session's transaction."""
        return self.session.connection()

    @classmethod
    def of(cls, publisher: "Publisher", session: Session) -> "UnitOfWork":
        """The one unit of work of ``session``, made and bound to its events on first use: every
        block that joins that Session adds to it."""
        uow = session.info.get(UNIT_OF_WORK_KEY)
        if uow is None:
            if not session.info.get(LISTENED_KEY):  # a Session of the caller's own: listen to it
                listen_to_sessions(session)
                session.info[LISTENED_KEY] = True
            uow = session.info[UNIT_OF_WORK_KEY] = cls(publisher, session)
        return uow

    @contextmanager
    def opened(self) -> Iterator["UnitOfWork"]:
        """Make this the current unit of work of the running context until the block ends: every
        publish meanwhile is captured into it."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def add(self, messages: list[OutgoingMessage]) -> None:
        """Capture ``messages``: they are stored and published with this unit's outermost commit, or
        dropped with its rollback (all but a ``retry`` or ``replace`` of the running task)."""
        self.pending.extend(messages)

    # -- session events ------------------------------------------------------------------------

    def _on_transaction_create(self, session: Session, transaction: SessionTransaction) -> None:
        if transaction.nested:
            self._savepoints[transaction] = len(self.pending)

    def _on_transaction_end(self, session: Session, transaction: SessionTransaction) -> None:
        # A savepoint's mark is read by after_soft_rollback, which fires after this event;
        # marks of released savepoints are dropped when the outermost transaction ends.
        if transaction.parent is None:
            self._savepoints.clear()
            if self._committed:  # the Session's connection is back in the pool: publishing takes its own
                self._committed = False
                self._publish_committed()

    def _on_soft_rollback(self, session: Session, previous: SessionTransaction) -> None:
        if previous.nested:
            for message in self.pending:
                message.row_id = None  # rows inserted by a failed commit are gone with it
            start = self._savepoints.pop(previous, None)
            if start is not None:
                self.pending[start:] = [m for m in self.pending[start:] if m.survives_rollback]
            return
        self._rolled_back()

    @_for_its_tenant
    def _before_commit(self, session: Session) -> None:
        if session.in_nested_transaction():
            return
        connection = session.connection()
        self._refuse_if_aborted(connection)
        if self._stores_at_commit(session):
            wait_for_commit(connection, self)  # _at_connection_commit, unless the connection rolls back first
        else:
            self._store_durable(connection)

    def _stores_at_commit(self, session: Session) -> bool:
        """Whether the durable messages go with the COMMIT of the Session's connection, after its
        last flush, instead of before that flush: one round trip fewer on PostgreSQL (the INSERT
        and the COMMIT in one message). Only on a Session of the store's engine that commits its
        own transaction (bound to that engine, not to a connection whose owner commits, and not
        two-phase, whose commit has no ``commit`` event)."""
        store = self.publisher.runtime.store
        return (store.is_postgres and session.bind is store.engine and not session.twophase
                and any(m.durable and m.row_id is None for m in self.pending))

    def _refuse_if_aborted(self, connection: Connection) -> None:
        """Raise ``TransactionAborted`` when the database aborted the transaction on
        ``connection`` (its COMMIT would roll everything back): nothing is committed or published."""
        cause = self.publisher.runtime.store.aborted_by(connection)
        if cause is not None:
            raise TransactionAborted(cause)

    @_for_its_tenant
    def _at_connection_commit(self, connection: Connection) -> None:
        """The Session's connection is about to send its COMMIT, every flush done: the durable
        messages' INSERT goes with it, in its transaction (``_store_durable``)."""
        self._store_durable(connection, commit=True)

    def _after_commit(self, session: Session) -> None:
        # Not published here: the Session still holds its connection until the transaction ends, and
        # publishing takes a second one; units of work committing at once would wait on the pool.
        if not session.in_nested_transaction():
            self._committed = True

    # -- the transaction's ends ----------------------------------------------------------------

    def _store_durable(self, connection: Connection, commit: bool = False) -> None:
        """Just before the outermost commit: insert the durable messages, in its transaction;
        with ``commit``, as its last statement, which the COMMIT may go with. A connection lost
        under them is raised as ``engine.begin()`` raises a lost COMMIT (SQLAlchemy's
        ``OperationalError``, ``connection_invalidated`` set), so the caller's retry of its
        database work catches it, and an attempt sees its connection lost."""
        crashpoint("before_commit")
        durable = [m for m in self.pending if m.durable and m.row_id is None]
        if durable:
            try:
                self.publisher.store_durable(connection, durable, commit)
            except StoreUnavailable as exc:
                raise_as_driver_error(exc)
        self._committing = True

    @_for_its_tenant
    def _publish_committed(self) -> None:
        """Just after the outermost commit: publish what was captured, in call order."""
        if not self._committing:
            return
        self._committing = False
        messages, self.pending = self.pending, []
        crashpoint("after_commit")
        if messages:
            self.publisher.publish_committed(messages)

    @_for_its_tenant
    def _rolled_back(self) -> None:
        """After the outermost rollback: drop what was captured, except a retry or replace of the
        running task, which Celery decided on: it still goes out (``store_and_forward``)."""
        survivors = self._drop_captured()
        if survivors:
            self.publisher.store_and_forward(survivors)

    def _drop_captured(self) -> list[OutgoingMessage]:
        """Drop what was captured; returns the retries and replaces of the running task."""
        for message in self.pending:
            message.row_id = None  # rows inserted by a failed commit are gone with it
        self._committing = False
        self._savepoints.clear()
        survivors = [m for m in self.pending if m.survives_rollback]
        self.pending.clear()
        return survivors


class ConnectionUnitOfWork(UnitOfWork):
    """A task attempt's unit of work: one transaction on one pooled Core connection that its owner
    (the inbox) ends; what it captured is published only after ``commit`` (after ``rollback``, only
    a ``retry`` or ``replace`` of the running task).

    A Session is made on that connection, inside the same transaction, only when the body
    asks for ``session``: an attempt that never touches it pays for no ORM. That Session's
    own ``commit()`` only flushes (it cannot end the owner's transaction), its
    ``rollback()`` rolls the whole transaction back, and its savepoints work as in any
    unit of work. Guarantee: as for ``UnitOfWork``; durable messages are inserted just
    before ``commit`` commits. What a commit left to publish, or the retry that survives a
    rollback, goes out in ``close``, once the connection is back in the pool: a unit holds one
    pooled connection at a time, so units ending at once never wait on the pool for each other
    (and a pool of one hands its connection to the next statement).
    """

    #: whether ``last`` may send the COMMIT with it (the transaction is this unit's own to commit)
    commits_with_last = True
    #: whether, with no ``last``, the COMMIT may go with the durable messages' INSERT
    commits_with_insert = False
    #: the error when the transaction was ended before ``commit``: by whom, and what to do instead
    ended_inside = ("the task's transaction was rolled back inside its body (self.session.rollback()), "
                    "its inbox claim with it: raise an exception to fail the task instead")

    def __init__(self, publisher: "Publisher", engine: Engine | None = None):
        super().__init__(publisher, None)
        # like every entry point: the store answers, tables exist
        runtime = publisher.runtime.ready()
        self._connection = (engine or runtime.engine).connect()
        self._transaction: RootTransaction | None = None
        self._survivors: list[OutgoingMessage] = []

    @property
    def connection(self) -> Connection:
        """The connection, its transaction begun (on first use: on SQLite, BEGIN takes the write lock)."""
        if self._transaction is None:
            self._transaction = self._begin()
        return self._connection

    @property
    def connection_before_begin(self) -> Connection | None:
        """The connection, while SQLAlchemy has begun no transaction on it (None after): for a
        statement that opens the database transaction itself (the eager claim)."""
        return self._connection if self._transaction is None else None

    @property
    @_for_its_tenant
    def session(self) -> Session:
        """The Session of the attempt's transaction, made on first use: its ``commit()`` only
        flushes, its ``rollback()`` rolls the whole attempt back."""
        if self._session is None:
            session = self._session = self.publisher.runtime.new_session(bind=self.connection)
            session.info[UNIT_OF_WORK_KEY] = self
        return self._session

    @_for_its_tenant
    def commit(self, last: Callable[[Connection, bool], bool] | None = None) -> bool:
        """Commit the attempt's transaction with its durable messages inserted in it, leaving what
        it captured for ``close`` to publish; False, with nothing committed, when ``last`` returns
        False (the caller rolls back).

        Flushes the Session, inserts the durable messages, runs ``last`` (the transaction's last
        statement, which may send the COMMIT with it) and commits."""
        if self._transaction is not None and not self._transaction.is_active:
            raise OutboxError(self.ended_inside)
        if self._transaction is not None:
            self._refuse_if_aborted(self._connection)
        if self._session is not None:
            self._session.flush()
        connection = self.connection
        self._store_durable(connection, commit=last is None and self.commits_with_insert)
        if last is not None and not last(connection, self.commits_with_last):
            return False
        self._commit()
        self._publish_committed()
        return True

    def connection_lost(self) -> bool:
        """Whether the attempt's connection was invalidated or closed under it (the server ended
        its session): its transaction cannot commit, whatever the body made of the error."""
        return self._connection.invalidated or self._connection.closed

    @_for_its_tenant
    def rollback(self) -> None:
        """Roll the transaction back (unless the body's ``session.rollback()`` did) and drop what
        was captured: ``close`` then sends nothing but a ``retry`` or ``replace`` of the running task."""
        try:
            if self._transaction is not None and self._transaction.is_active:
                self._rollback()
        except Exception as exc:  # noqa: BLE001 - the error that led here is the one to raise; closing ends it
            logger.warning("celery-outbox: could not roll back a task's transaction (closing its connection): %s",
                           exc)
        finally:
            self._rolled_back()

    @_for_its_tenant
    def close(self) -> None:
        """Give the connection back to the pool before anything is published, then publish what a
        commit left to publish, or store and send what survived a rollback (which raises as
        ``store_and_forward`` does: the retry was not stored). Closes the Session, if one was made."""
        try:
            if self._session is not None:
                self._session.close()
        finally:
            self._connection.close()
            survivors, self._survivors = self._survivors, []
            if self._committed:
                self._committed = False
                UnitOfWork._publish_committed(self)
            elif survivors:
                self.publisher.store_and_forward(survivors)

    def _publish_committed(self) -> None:
        self._committed = True

    def _rolled_back(self) -> None:
        self._survivors = self._drop_captured()

    def _begin(self) -> RootTransaction:
        """Begin the attempt's transaction."""
        return self._connection.begin()

    def _commit(self) -> None:
        """Commit the attempt's transaction."""
        self._connection.commit()

    def _rollback(self) -> None:
        """Roll the attempt's transaction back."""
        assert self._transaction is not None
        self._transaction.rollback()

    # The Session joined the owner's transaction: its commit only flushes; the owner commits.
    def _before_commit(self, session: Session) -> None:
        return None

    def _after_commit(self, session: Session) -> None:
        return None


class _BlockUnitOfWork(ConnectionUnitOfWork):
    """The unit of work of a ``begin()`` block: its COMMIT goes with the durable messages' INSERT."""

    commits_with_insert = True
    ended_inside = ("the unit of work's transaction was ended inside its block (commit() or rollback() on its "
                    "connection or Session): let the block end it, committing, or raise an exception to roll it "
                    "back; its messages are dropped")


def for_tenant(tenant: str | None) -> Any:
    """The context a unit of work for ``tenant`` opens in: that tenant's (``using_tenant``), or,
    with None, the running one (a block inside a tenant's task body or unit of work is that
    tenant's)."""
    return contextlib.nullcontext() if tenant is None else using_tenant(tenant)


def joinable(outer: UnitOfWork | None, tenant: str | None) -> UnitOfWork | None:
    """``outer``, the open unit of work a block joins, unless the block names another tenant:
    one transaction is in one tenant's database, so that is an error."""
    if outer is not None and tenant is not None and outer.tenant != tenant:
        raise OutboxError(f"a unit of work for tenant {tenant!r} inside one for "
                          f"{'the default store' if outer.tenant is None else repr(outer.tenant)}: one transaction "
                          "is in one database; open it outside the other")
    return outer


@contextmanager
def begin(publisher: Publisher, tenant: str | None = None) -> Iterator[Connection]:
    """Publishes every message the block sends only after the block commits; a rollback publishes
    nothing but a ``retry`` or ``replace`` of the running task.

    A unit of work on a Core connection (``Outbox.begin``), as ``engine.begin()`` gives one:
    its transaction begun, committed when the block ends (durable messages inserted just
    before the COMMIT, everything captured published just after) and rolled back on an
    exception; a block inside an open unit of work joins it (its connection). No ORM Session
    is made unless the block asks the unit of work for one. With ``tenant``, the transaction is
    in that tenant's store's database (docs/tenancy.md)."""
    outer = joinable(_sync_outer(), tenant)
    if outer is not None:
        yield outer.connection
        return
    with for_tenant(tenant):
        publisher.prepare_sender()
        uow = _BlockUnitOfWork(publisher)
        try:
            token = _current.set(uow)  # as uow.opened(), without a context manager of its own
            try:
                yield uow.connection
                uow.commit()
            except BaseException:
                uow.rollback()
                raise
            finally:
                _current.reset(token)
        finally:
            uow.close()


@contextmanager
def transaction(publisher: Publisher, session: Session | None = None, tenant: str | None = None) -> Iterator[Session]:
    """Publishes every message the block sends only after the Session's outermost commit; a
    rollback publishes nothing but a ``retry`` or ``replace`` of the running task.

    A unit of work whose messages ``publisher`` publishes (``Outbox.transaction``): on a Session
    of its own, committed when the block ends and rolled back on an exception; or joining
    ``session``, published after that Session's commit; a block inside an open one joins it.
    With ``tenant``, the Session is on that tenant's store's engine (a joined ``session`` must
    be on that tenant's database: its messages are stored in its transaction)."""
    outer = joinable(_sync_outer(), tenant)
    if session is None and outer is not None:
        yield outer.session
        return
    with for_tenant(tenant):
        publisher.runtime.ready()
        if session is not None:  # its transaction may be open already: no registering beside it
            with UnitOfWork.of(publisher, session).opened():
                yield session
            return
        publisher.prepare_sender()
        with publisher.runtime.new_session() as own:
            with UnitOfWork.of(publisher, own).opened(), own.begin():
                yield own


def _sync_outer() -> UnitOfWork | None:
    """The unit of work a sync block joins: the one open in the running context, or None. An async
    one cannot be joined (its connection is only reached by awaiting): that is an error."""
    outer = current_unit_of_work()
    if outer is not None and outer.is_async:
        raise OutboxError("outbox.transaction() or outbox.begin() inside an async unit of work: "
                          "use 'async with outbox.atransaction()' or 'outbox.abegin()' there")
    return outer


# -- the running task body's unit of work (``IdempotentTask.session`` and ``.connection``) -----

_task_unit_of_work: ContextVar["UnitOfWork | None"] = ContextVar("celery_outbox_task_unit_of_work", default=None)


def current_session() -> Session | None:
    """The Session of the running task body's unit of work, in the attempt's transaction (made on
    first use), or None outside a task body."""
    uow = _task_unit_of_work.get()
    return None if uow is None else uow.session


def current_connection() -> Connection | None:
    """The Connection of the running task body's unit of work, its transaction (the attempt's)
    begun, or None outside a task body."""
    uow = _task_unit_of_work.get()
    return None if uow is None else uow.connection


def run_body(body: Callable[[], Any], uow: UnitOfWork) -> Any:
    """Run the body with ``uow`` as the task's unit of work, so that ``self.session`` and
    ``self.connection`` write in the attempt's transaction, for as long as the body runs."""
    token = _task_unit_of_work.set(uow)
    try:
        return body()
    finally:
        _task_unit_of_work.reset(token)
