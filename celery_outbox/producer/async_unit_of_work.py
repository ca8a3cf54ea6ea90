"""Async units of work: an ``AsyncSession`` or ``AsyncConnection`` stores what it sends before its commit.

Transaction boundary: the async transaction's. While an async unit of work is open
(``Outbox.atransaction``, ``Outbox.abegin``), every publish of the app in the running asyncio task
(and the tasks it starts meanwhile) is captured into it; its durable messages are inserted with one
statement just before the outermost COMMIT, in that transaction (SQLAlchemy runs the unit of work's
commit events on the async driver), and what it committed is handed at once to the publishing
threads (``AsyncPublishing``), which publish it in call order off the event loop.
Guarantee: as for sync units of work; a cancellation after the commit does not stop the publish,
one before it rolls the transaction back, and one while the COMMIT's answer is awaited leaves the
durable messages to the relay or redelivery (a plain message is then lost, as after a crash).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from ..core.crashpoints import crashpoint
from ..core.sessions import LISTENED_KEY, UNIT_OF_WORK_KEY, listen_to_sessions, session_info
from ..errors import OutboxError
from .async_publishing import AsyncPublishing, wait_for
from .unit_of_work import UnitOfWork, _current, current_unit_of_work, for_tenant, joinable

__all__ = ["AsyncUnitOfWork", "AsyncUnitsOfWork"]

logger = logging.getLogger("celery_outbox.unit_of_work")


class _ListenedSession(Session):
    """The sync Session under the outbox's own ``AsyncSession``s: its events reach its unit of work
    (listened to once, for the class)."""


listen_to_sessions(_ListenedSession)


class AsyncUnitOfWork(UnitOfWork):
    """The messages captured while one ``AsyncSession``'s transaction is open: stored before its
    outermost commit, handed to the publishing threads after it, dropped on its rollback.

    Bound to the Session's events as a sync unit of work is; only the publish differs: it is
    submitted to ``publishing`` instead of run in the committing call, and ``published`` is its
    future."""

    is_async = True

    def __init__(self, publishing: AsyncPublishing, session: Session | None):
        super().__init__(publishing.publisher, session)
        self.publishing = publishing
        self.published: Future[Any] | None = None
        self.async_session: AsyncSession | None = None

    @classmethod
    def of_session(cls, publishing: AsyncPublishing, async_session: AsyncSession) -> "AsyncUnitOfWork":
        """The one unit of work of ``async_session``, made and bound to its events on first use."""
        session = async_session.sync_session
        uow = session.info.get(UNIT_OF_WORK_KEY)
        if uow is None:
            if not session.info.get(LISTENED_KEY):  # an AsyncSession of the caller's own
                listen_to_sessions(session)
                session.info[LISTENED_KEY] = True
            uow = session.info[UNIT_OF_WORK_KEY] = cls(publishing, session)
            uow.async_session = async_session
        elif not isinstance(uow, AsyncUnitOfWork):
            raise OutboxError("this Session already belongs to a sync unit of work")
        return uow

    def _publish_committed(self) -> None:
        """Just after the outermost commit (in the committing call, on the loop's thread): hand what
        was captured to the publishing threads, after this unit's earlier publish."""
        if not self._committing:
            return
        self._committing = False
        messages, self.pending = self.pending, []
        crashpoint("after_commit")
        if messages:
            self.published = self.publishing.submit(self.publisher.publish_committed, messages,
                                                    after=self.published)

    def _rolled_back(self) -> None:
        """After the outermost rollback: drop what was captured; a ``retry`` or ``replace`` of the
        running task still goes out, from a publishing thread."""
        survivors = self._drop_captured()
        if survivors:
            self.published = self.publishing.submit(self.publisher.store_and_forward, survivors,
                                                    after=self.published)

    async def wait_published(self) -> None:
        """Until the publishing threads have published what this unit committed; a cancellation
        of the waiter leaves the publish running."""
        future, self.published = self.published, None
        if future is not None:
            await wait_for(future)


class _ConnectionUnitOfWork(AsyncUnitOfWork):
    """The unit of work of an ``abegin()`` block, on one ``AsyncConnection`` that the block commits.
    A Session asked for inside it joins that transaction: its ``commit()`` only flushes."""

    ended_inside = ("the unit of work's transaction was ended inside its block (commit() or rollback() on its "
                    "connection or Session): let the block end it, committing, or raise an exception to roll it "
                    "back; its messages are dropped")

    def __init__(self, publishing: AsyncPublishing, connection: AsyncConnection):
        super().__init__(publishing, None)
        self.async_connection = connection

    def joined_session(self, sessions: async_sessionmaker[AsyncSession]) -> AsyncSession:
        if self.async_session is None:
            self.async_session = sessions(bind=self.async_connection, join_transaction_mode="rollback_only")
            self.async_session.sync_session.info[UNIT_OF_WORK_KEY] = self
            self._session = self.async_session.sync_session
        return self.async_session

    def commit_in(self, connection: Connection) -> None:
        """In the committing greenlet: flush the joined Session, insert the durable messages and
        COMMIT, refusing a transaction the database aborted."""
        self._refuse_if_aborted(connection)
        if self._session is not None:
            self._session.flush()
        self._store_durable(connection)
        connection.commit()
        self._committed = True

    def published_after_close(self) -> None:
        if self._committed:
            self._committed = False
            self._publish_committed()

    # The Session joined the block's transaction: its commit only flushes; the block commits.
    def _before_commit(self, session: Session) -> None:
        return None

    def _after_commit(self, session: Session) -> None:
        return None

    def _on_transaction_end(self, session: Session, transaction: Any) -> None:
        return None


class AsyncUnitsOfWork:
    """The async units of work of one outbox, on the runtime's async engine; their publishes go to
    ``publishing``'s threads."""

    def __init__(self, publishing: AsyncPublishing):
        self.publishing = publishing
        self._sessions: async_sessionmaker[AsyncSession] | None = None

    @property
    def sessions(self) -> async_sessionmaker[AsyncSession]:
        """The maker of the outbox's ``AsyncSession``s (each is given its engine or connection)."""
        if self._sessions is None:
            self._sessions = async_sessionmaker(expire_on_commit=False, sync_session_class=_ListenedSession,
                                                info=session_info())
        return self._sessions

    @asynccontextmanager
    async def transaction(self, session: AsyncSession | None = None,
                          tenant: str | None = None) -> AsyncIterator[AsyncSession]:
        """Publishes every message the block sends only after the AsyncSession's outermost commit;
        a rollback publishes nothing. On an ``AsyncSession`` of its own, committed when the block
        ends and rolled back on an exception; or joining ``session``, published after that
        Session's commit; a block inside an open async unit of work joins it. With ``tenant``,
        in that tenant's store's database (as the sync ``transaction``)."""
        joinable(_async_outer(), tenant)
        with for_tenant(tenant):
            async with self._transaction(session) as given:
                yield given

    @asynccontextmanager
    async def _transaction(self, session: AsyncSession | None) -> AsyncIterator[AsyncSession]:
        engine = self.publishing.publisher.runtime.async_engine_of_running_loop()  # a missing driver: an error
        outer = _async_outer()
        if session is None and outer is not None:
            yield (outer.joined_session(self.sessions) if isinstance(outer, _ConnectionUnitOfWork)
                   else outer.async_session)
            return
        await self.publishing.prepare()
        if session is not None:
            uow = AsyncUnitOfWork.of_session(self.publishing, session)
            with uow.opened():
                yield session
            await uow.wait_published()
            return
        cancelled = False
        async with self.sessions(bind=engine) as own:
            uow = AsyncUnitOfWork.of_session(self.publishing, own)
            with uow.opened():
                await own.begin()
                try:
                    yield own
                except BaseException:
                    await _rolled_back(own.rollback())
                    raise
                cancelled = await run_to_end(own.commit())
        await _published_unless(cancelled, uow)

    @asynccontextmanager
    async def begin(self, tenant: str | None = None) -> AsyncIterator[AsyncConnection]:
        """Publishes every message the block sends only after the block commits; a rollback
        publishes nothing. An ``AsyncConnection`` as ``async_engine.begin()`` gives one: committed
        when the block ends (durable messages inserted just before the COMMIT), rolled back on an
        exception; a block inside an open async unit of work joins it (its connection). With
        ``tenant``, in that tenant's store's database."""
        joinable(_async_outer(), tenant)
        with for_tenant(tenant):
            async with self._begin() as connection:
                yield connection

    @asynccontextmanager
    async def _begin(self) -> AsyncIterator[AsyncConnection]:
        engine = self.publishing.publisher.runtime.async_engine_of_running_loop()
        outer = _async_outer()
        if outer is not None:
            yield (outer.async_connection if isinstance(outer, _ConnectionUnitOfWork)
                   else await outer.async_session.connection())
            return
        await self.publishing.prepare()
        cancelled = False
        async with engine.connect() as connection:
            uow = _ConnectionUnitOfWork(self.publishing, connection)
            token = _current.set(uow)
            try:
                await connection.begin()
                try:
                    yield connection
                    if not connection.in_transaction():
                        raise OutboxError(uow.ended_inside)
                except BaseException:
                    await _rolled_back(connection.rollback())
                    raise
                cancelled = await run_to_end(connection.run_sync(uow.commit_in))
            except BaseException:
                uow._rolled_back()
                raise
            finally:
                _current.reset(token)
                if uow.async_session is not None:
                    await uow.async_session.close()
        uow.published_after_close()
        await _published_unless(cancelled, uow)


async def run_to_end(commit: Awaitable[Any]) -> bool:
    """Await ``commit`` to its end even when the waiting task is cancelled meanwhile: a COMMIT
    sent is answered, so the unit knows whether it committed and publishes what it did at once
    (cut off, its durable messages would wait for redelivery and its plain ones be lost). Returns
    whether a cancellation came meanwhile, for the caller to raise once the commit has ended.
    A loop shutting down cancels the commit itself: then its outcome is the database's."""
    running = asyncio.ensure_future(commit)
    cancelled = False
    while True:
        try:
            await asyncio.shield(running)
            return cancelled
        except asyncio.CancelledError:
            if running.cancelled():
                raise
            cancelled = True


async def _rolled_back(rollback: Awaitable[Any]) -> None:
    """Roll back after the block raised; a rollback that fails (the connection is gone, or a
    cancellation cut a statement off) is logged: the error of the block is the one raised, and a
    transaction that never commits publishes nothing."""
    try:
        await rollback
    except Exception as exc:  # noqa: BLE001 - the block's error is raised; the connection is discarded
        logger.warning("celery-outbox: could not roll back an async unit of work (its connection is discarded): %s",
                       exc)


async def _published_unless(cancelled: bool, uow: AsyncUnitOfWork) -> None:
    """Wait for the publish of what ``uow`` committed; or, when the task was cancelled during the
    commit, raise the cancellation at once (the publish goes on in its thread)."""
    if cancelled:
        raise asyncio.CancelledError()
    await uow.wait_published()


def _async_outer() -> AsyncUnitOfWork | None:
    """The async unit of work open in the running task, or None; a sync one open there (a task body
    running an event loop) is left alone: the async block is a transaction of its own."""
    outer = current_unit_of_work()
    return outer if isinstance(outer, AsyncUnitOfWork) else None

