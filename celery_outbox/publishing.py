"""The publish hook and the unit of work.

Transaction boundary: while a unit of work is open (``outbox.transaction()``, or
an ``IdempotentTask`` body), every publish of the app (``delay``, ``apply_async``,
``send_task``, canvas, callbacks, ``retry``, ``replace``) is captured, fully built,
into the unit of work instead of going to the broker:

* before the Session's outermost commit, messages for durable queues are written
  to the outgoing table with one INSERT, inside that same transaction;
* after the commit, the durable rows are taken (locked and marked sent) with one
  UPDATE, every captured message is published in call order with one producer,
  and the marks commit (the consuming inbox deletes the rows when it has the
  message; redelivery publishes them again if it never does); with delivery
  tracking off, one DELETE takes them instead;
* on rollback nothing is published; a rolled-back SAVEPOINT discards only the
  messages captured inside it.

Guarantee: nothing is published unless the transaction commits; a durable message
whose publish fails after the commit (broker down, process killed) stays in the
outgoing table for the relay, so it is delayed, never lost. Outside a unit of work
plain Celery behaviour is unchanged, except that a message for a durable queue is
stored, published and deleted (store-and-forward).

State lives in a ``ContextVar``: it follows the thread or task that opened it, in
prefork, threads and eventlet/gevent pools alike.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from itertools import groupby
from operator import attrgetter
from typing import Any, Callable, Iterator

from celery.app.amqp import AMQP
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy.engine import Connection, RootTransaction
from sqlalchemy.orm import Session, SessionTransaction

from .broker import Outlet, outlet
from .celery_hooks import default_event_dispatcher, install_task_sender
from .crashpoints import crashpoint
from .envelope import OutgoingMessage, capture, check_storable, new_send_id, valid_send_id
from .errors import OutboxError
from .routing import durable_destination, published_route
from .runtime import Runtime
from .sessions import LISTENED_KEY, UNIT_OF_WORK_KEY, listen_to_sessions
from .signals import message_published, publish_failed
from .store import utcnow
from .vocabulary import SEND_HEADER

__all__ = ["UnitOfWork", "ConnectionUnitOfWork", "current_unit_of_work", "Publisher", "install_publish_hook"]

logger = logging.getLogger("celery_outbox.publishing")

_current: ContextVar["UnitOfWork | None"] = ContextVar("celery_outbox_unit_of_work", default=None)


def current_unit_of_work() -> "UnitOfWork | None":
    """The unit of work open in this thread or task, if any."""
    return _current.get()


class UnitOfWork:
    """The messages captured while one Session's transaction is open.

    Bound to the Session through its events, so it publishes at that Session's
    outermost commit wherever the commit happens.
    """

    def __init__(self, publisher: "Publisher", session: Session | None):
        self.publisher = publisher
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
        uow = session.info.get(UNIT_OF_WORK_KEY)
        if uow is None:
            if not session.info.get(LISTENED_KEY):  # a Session of the caller's own: listen to it
                listen_to_sessions(session)
                session.info[LISTENED_KEY] = True
            uow = session.info[UNIT_OF_WORK_KEY] = cls(publisher, session)
        return uow

    @contextmanager
    def opened(self) -> Iterator["UnitOfWork"]:
        """Make this the current unit of work of the running context."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def add(self, messages: list[OutgoingMessage]) -> None:
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

    def _before_commit(self, session: Session) -> None:
        if not session.in_nested_transaction():
            self._store_durable(session.connection())

    def _after_commit(self, session: Session) -> None:
        # Not published here: the Session still holds its connection until the transaction ends, and
        # publishing takes a second one; units of work committing at once would wait on the pool.
        if not session.in_nested_transaction():
            self._committed = True

    # -- the transaction's ends ----------------------------------------------------------------

    def _store_durable(self, connection: Connection) -> None:
        """Just before the outermost commit: insert the durable messages, in its transaction."""
        durable = [m for m in self.pending if m.durable and m.row_id is None]
        if durable:
            store_durable(self.publisher.runtime.store, connection, durable)
        self._committing = True
        crashpoint("before_commit")

    def _publish_committed(self) -> None:
        """Just after the outermost commit: publish what was captured, in call order."""
        if not self._committing:
            return
        self._committing = False
        messages, self.pending = self.pending, []
        crashpoint("after_commit")
        if messages:
            self.publisher.publish_committed(messages)

    def _rolled_back(self) -> None:
        """After the outermost rollback: drop what was captured, except a retry or replace of the
        running task, which Celery decided on: it still goes out."""
        for message in self.pending:
            message.row_id = None  # rows inserted by a failed commit are gone with it
        self._committing = False
        self._savepoints.clear()
        survivors = [m for m in self.pending if m.survives_rollback]
        self.pending.clear()
        if survivors:
            self.publisher.store_and_forward(survivors)


class ConnectionUnitOfWork(UnitOfWork):
    """A task attempt's unit of work: one transaction on one pooled Core connection, which its
    owner (the inbox) ends with ``commit`` or ``rollback``.

    A Session is made on that connection, inside the same transaction, only when the body
    asks for ``session``: an attempt that never touches it pays for no ORM. That Session's
    own ``commit()`` only flushes (it cannot end the owner's transaction), its
    ``rollback()`` rolls the whole transaction back, and its savepoints work as in any
    unit of work. Guarantee: as for ``UnitOfWork``; durable messages are inserted just
    before ``commit`` commits, and everything captured is published just after.
    """

    def __init__(self, publisher: "Publisher"):
        super().__init__(publisher, None)
        # like every entry point: the store answers, tables exist
        self._connection = publisher.runtime.ready().engine.connect()
        self._transaction: RootTransaction | None = None

    @property
    def connection(self) -> Connection:
        """The connection, its transaction begun (on first use: on SQLite, BEGIN takes the write lock)."""
        if self._transaction is None:
            self._transaction = self._connection.begin()
        return self._connection

    @property
    def connection_before_begin(self) -> Connection | None:
        """The connection, while SQLAlchemy has begun no transaction on it (None after): for a
        statement that opens the database transaction itself (the eager claim)."""
        return self._connection if self._transaction is None else None

    @property
    def session(self) -> Session:
        if self._session is None:
            session = self._session = self.publisher.runtime.new_session(bind=self.connection)
            session.info[UNIT_OF_WORK_KEY] = self
        return self._session

    def commit(self, last: Callable[[Connection], bool] | None = None) -> bool:
        """Flush the Session, insert the durable messages, run ``last`` (the transaction's last
        statement, which may send the COMMIT with it), commit, then publish. False, with nothing
        committed or published, when ``last`` returns False: the caller rolls back."""
        if self._transaction is not None and not self._transaction.is_active:
            raise OutboxError("the task's transaction was rolled back inside its body (self.session.rollback()), "
                              "its inbox claim with it: raise an exception to fail the task instead")
        if self._session is not None:
            self._session.flush()
        connection = self.connection
        self._store_durable(connection)
        if last is not None and not last(connection):
            return False
        connection.commit()
        self._publish_committed()
        return True

    def connection_lost(self) -> bool:
        """Whether the attempt's connection was invalidated or closed under it (the server ended
        its session): its transaction cannot commit, whatever the body made of the error."""
        return self._connection.invalidated or self._connection.closed

    def rollback(self) -> None:
        """Roll the transaction back (unless the body's ``session.rollback()`` did) and drop
        what was captured."""
        try:
            if self._transaction is not None and self._transaction.is_active:
                self._transaction.rollback()
        except Exception as exc:  # noqa: BLE001 - the error that led here is the one to raise; closing ends it
            logger.warning("celery-outbox: could not roll back a task's transaction (closing its connection): %s",
                           exc)
        finally:
            self._rolled_back()

    def close(self) -> None:
        """Close the Session, if one was made, and give the connection back to the pool."""
        try:
            if self._session is not None:
                self._session.close()
        finally:
            self._connection.close()

    # The Session joined the owner's transaction: its commit only flushes; the owner commits.
    def _before_commit(self, session: Session) -> None:
        return None

    def _after_commit(self, session: Session) -> None:
        return None


def store_durable(store: Any, conn: Any, messages: list[OutgoingMessage]) -> None:
    """Insert durable messages in ``conn``'s transaction (one statement) and note their row ids."""
    ids = store.insert_outgoing(conn, [m.to_row(utcnow()) for m in messages])
    for message, row_id in zip(messages, ids, strict=True):
        message.row_id = row_id


class Publisher:
    """Publishes committed messages; the one place that talks to the broker on commit. Opens the
    units of work whose messages it publishes (``transaction``)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    @contextmanager
    def transaction(self, session: Session | None = None) -> Iterator[Session]:
        """A unit of work (``Outbox.transaction``): on a Session of its own, committed when the block
        ends and rolled back on an exception; or joining ``session``, published after that
        Session's commit; a block inside an open one joins it."""
        outer = current_unit_of_work()
        if session is None and outer is not None:
            yield outer.session
            return
        self.runtime.ready()
        if session is not None:
            with UnitOfWork.of(self, session).opened():
                yield session
            return
        with self.runtime.new_session() as own:
            with UnitOfWork.of(self, own).opened(), own.begin():
                yield own

    def store_and_forward(self, messages: list[OutgoingMessage], producer: Any = None) -> None:
        """Outside a unit of work: store durable messages in their own transaction, then publish
        with ``producer`` (the one the sender holds: taking a second one from the app's pool while
        holding the first deadlocks once the pool is exhausted), or one from the pool."""
        durable = [m for m in messages if m.durable]
        if durable:
            store = self.runtime.ready().store
            with store.begin() as conn:
                store_durable(store, conn, durable)
            crashpoint("after_commit")
        self.publish_committed(messages, producer)

    def publish_committed(self, messages: list[OutgoingMessage], producer: Any = None) -> None:
        """Publish in call order with one producer (``producer``, or one from the app's pool);
        durable rows are taken in one statement.

        In one transaction: the durable rows are locked (``SKIP LOCKED``: a relay running
        at the same moment never sends them too) and marked sent; then published; a row
        whose publish failed is unmarked, for the relay. With delivery tracking off they
        are deleted instead (see ``_publish_deleting``). With an archive, each send is
        recorded in the same transaction. A crash before the commit rolls the marks back:
        the relay sends those rows. Never raises for a broker error: the commit already
        happened.

        A durable message with an eta goes out now, eta kept, when ``release_before`` (the
        relay's rule too) releases it, and its redelivery counts from its eta; a later one waits
        in the store for the relay. Each send's ``task-sent`` event follows its message (a held
        one's is sent now, as Celery sends it with the message).
        """
        now = utcnow()
        settings = self.runtime.settings
        release_before = settings.release_before(now)
        held = [m for m in messages if m.durable and not m.is_due(release_before)]  # wait in the store
        if any(m.sent_event is not None for m in held):
            with self.runtime.app.producer_or_acquire(producer) as event_producer:
                for message in held:
                    self._send_event(message, event_producer, broker_down=False)
        messages = [m for m in messages if not m.durable or m.is_due(release_before)]
        durable_ids = [m.row_id for m in messages if m.durable and m.row_id is not None]
        if not durable_ids:
            self._publish_all(messages, set(), producer)
            return
        store = self.runtime.store
        redeliver_at = settings.first_redelivery(now)
        try:
            if redeliver_at is None:
                self._publish_deleting(messages, durable_ids, now, producer)
                return
            with store.begin(durable=False) as conn:  # lost in a crash, the rows are only sent again
                owned = set(store.take_outgoing(conn, durable_ids, now, redeliver_at))
                store.postpone_redelivery(conn, [
                    {"id": m.row_id, "redeliver_at": settings.first_redelivery(now, m.deliver_at)}
                    for m in messages if m.row_id in owned and m.deliver_at is not None and m.deliver_at > now])
                sent = self._publish_all(messages, owned, producer)
                crashpoint("after_publish")
                if sent and self.runtime.archiver is not None:
                    store.record_sent(conn, sent, now)
                store.unmark_sent(conn, sorted(owned.difference(sent)))
        except Exception as exc:  # noqa: BLE001 - the rows stay for the relay; the caller's commit stands
            logger.error("celery-outbox: could not finish publishing committed messages (the relay will): %s", exc)

    def _publish_deleting(self, messages: list[OutgoingMessage], durable_ids: list[int], now: datetime,
                          producer: Any) -> None:
        """Delivery tracking off: one DELETE takes the rows before the publish and commits after
        it (with an archive, together with the records of the sends). If a publish failed, that
        transaction rolls back (every row is back) and a new one deletes, and records, the
        published rows: the failed ones stay for the relay (which may, between the two, send a
        published one again: the inbox discards it)."""
        store = self.runtime.store
        record = self.runtime.archiver is not None
        try:
            with store.begin(durable=False) as conn:  # lost in a crash, the rows are only sent again
                taken = store.take_outgoing_to_delete(conn, durable_ids, record)
                sent = self._publish_all(messages, {row.id for row in taken}, producer)
                crashpoint("after_publish")
                if len(sent) < len(taken):
                    raise _PartlyPublished(sent)
                if record:
                    store.record_sends(conn, taken, now)
        except _PartlyPublished as partly:
            if partly.sent:
                with store.begin(durable=False) as conn:
                    store.finish_sent(conn, partly.sent, now, None, record=record)

    def _publish_all(self, messages: list[OutgoingMessage], owned: set[int], producer: Any) -> list[int]:
        """Publish in call order; durable messages in batches (``Outlet.publish_each``), plain ones
        one by one with Celery's own retry. Returns the row ids of the durable messages sent."""
        sent: list[int] = []
        with outlet(self.runtime.app, producer) as out:
            # durable messages fail fast when the broker is down: their rows wait for the relay
            broker_down = bool(owned) and out.unreachable() is not None
            for durable, run in groupby(messages, key=attrgetter("durable")):
                if not durable:
                    for message in run:
                        try:
                            out.publish_one(message)
                        except Exception as exc:  # noqa: BLE001 - reported: a plain message is lost
                            broker_down = broker_down or isinstance(exc, out.broker_errors)
                            self._failed(message, exc)
                        else:
                            message_published.send(sender=self.runtime.owner, message=message, relayed=False)
                            self._send_event(message, out.producer, broker_down)
                    continue
                run = list(run)
                published, broker_down = self._publish_durable(out, run, owned, broker_down)
                sent += [message.row_id for message in published]
                for message in run:  # stored: sent, whether the broker has it now or the relay sends it
                    self._send_event(message, out.producer, broker_down)
        return sent

    @staticmethod
    def _send_event(message: OutgoingMessage, producer: Any, broker_down: bool) -> None:
        """The ``task-sent`` event of the send of ``message`` (once: the event is not stored, so
        the relay and redelivery never send it), through Celery's dispatcher, which buffers it
        if it cannot be published; no retries when the broker is known to be down."""
        if message.sent_event is not None:
            event, message.sent_event = message.sent_event, None
            event.send(producer, retry=False if broker_down else None)

    def _publish_durable(self, out: Outlet, run: list[OutgoingMessage], owned: set[int], broker_down: bool,
                         ) -> tuple[list[OutgoingMessage], bool]:
        """One batch of consecutive durable messages; a failed one keeps its row for the relay."""
        run = [message for message in run if message.row_id in owned]  # the others, a relay took
        if broker_down:
            for message in run:
                self._failed(message, KombuOperationalError("the broker did not answer"))
            return [], True
        done = out.publish_each([(message, message) for message in run])
        for message, _, exc in done.failed:
            self._failed(message, exc)
        for message, _ in done.not_sent:
            self._failed(message, done.broker_error or KombuOperationalError("the broker did not answer"))
        published = [message for message, _ in done.published]
        for message in published:
            message_published.send(sender=self.runtime.owner, message=message, relayed=False)
        return published, done.broker_error is not None

    def _failed(self, message: OutgoingMessage, exc: BaseException) -> None:
        if message.durable:
            logger.warning(
                "celery-outbox: publish of %s[%s] to %r failed, the relay will retry it: %r",
                message.task_name, message.message_id, message.destination, exc,
            )
        else:
            logger.error(
                "celery-outbox: publish of %s[%s] to %r failed after commit and the queue is not durable, "
                "the message is lost: %r",
                message.task_name, message.message_id, message.destination, exc,
            )
        publish_failed.send(sender=self.runtime.owner, message=message, exception=exc)


class _PartlyPublished(Exception):
    """Rolls back a transaction that deleted rows whose publish then failed."""

    def __init__(self, sent: list[int]):
        super().__init__(f"{len(sent)} published")
        self.sent = sent


def _make_sender(publisher: Publisher, amqp: AMQP, celery_sender: Callable[..., Any]) -> Callable[..., Any]:
    runtime = publisher.runtime

    def durable_queue(exchange: str, routing_key: str) -> str | None:
        durable = runtime.settings.durable_queues
        return durable_destination(amqp.queues, durable, exchange, routing_key) if durable else None

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        continued = stamp_send_id(runtime.app, message.headers)
        uow = _current.get()
        if uow is None and durable_queue(*published_route(amqp, options)) is None:
            return celery_sender(producer, name, message, **options)
        captured = capture(celery_sender, producer, name, message, options, lambda: default_event_dispatcher(amqp))
        if captured:
            task_message = captured[0]
            destination = durable_queue(task_message.exchange, task_message.routing_key)  # as it is published
            if destination is not None:
                task_message.destination = destination
                task_message.make_durable()
                check_storable(task_message, runtime.store.tables.outgoing)  # fails the call, not the commit
                _declare_also(task_message, amqp.queues.get(destination))
            task_message.survives_rollback = continued
        if uow is not None:
            uow.add(captured)
        else:
            publisher.store_and_forward(captured, producer)
        return None

    return send_task_message


def _declare_also(message: OutgoingMessage, queue: Any) -> None:
    """Declare the durable queue a message reaches with its publish, as the relay does: Celery
    declares only the queue it resolved, and a message routed by exchange and routing key to a
    queue no consumer has declared yet would reach no queue."""
    declare = list(message.sending.get("declare") or ())
    if queue is not None and queue not in declare:
        message.sending["declare"] = [*declare, queue]


_resent_attempt: ContextVar[Any] = ContextVar("celery_outbox_resent_attempt", default=None)


@contextmanager
def resending(request: Any) -> Iterator[None]:
    """While Celery re-sends ``request``'s task as a later attempt from outside its body (the
    worker's main process, after a lost worker process), the message keeps its publish identity."""
    token = _resent_attempt.set(request)
    try:
        yield
    finally:
        _resent_attempt.reset(token)


def stamp_send_id(app: Any, headers: Any) -> bool:
    """Give a task message its publish identity (``SEND_HEADER``): a new one per send, except for a
    later attempt of a delivery, a ``retry`` or ``replace`` of the task running now or Celery's
    re-send of a lost one, which keeps the identity of the delivery it continues. Returns whether
    the message continues the task running now (Celery decided on it: it survives a rollback)."""
    if not isinstance(headers, dict):
        return False
    running = request = _running_request_continued(app, headers)
    if request is None:
        resent = _resent_attempt.get()
        request = resent if resent is not None and _continues(resent, headers) else None
    if request is None:
        headers[SEND_HEADER] = new_send_id()
        return False
    inherited = valid_send_id(getattr(request, SEND_HEADER, None))
    if inherited:
        headers[SEND_HEADER] = inherited
    else:  # the delivery came from a sender without the outbox: keyed by its task id, so is this attempt
        headers.pop(SEND_HEADER, None)
    return running is not None


def _running_request_continued(app: Any, headers: dict[str, Any]) -> Any:
    """The request of the task running now when ``headers`` are a ``retry`` or ``replace`` of it
    (same id, later attempt), else None."""
    task = app.current_task
    if task is None:
        return None
    request = task.request
    return request if _continues(request, headers) else None


def _continues(request: Any, headers: dict[str, Any]) -> bool:
    """Whether ``headers`` are a later attempt (more retries, or a replacement) of ``request``."""
    if not headers.get("id") or headers.get("id") != request.id:
        return False
    return (headers.get("retries") or 0) > (request.retries or 0) or (
        (headers.get("replaced_task_nesting") or 0) > (getattr(request, "replaced_task_nesting", 0) or 0)
    )


def install_publish_hook(publisher: Publisher) -> None:
    """Make the app's AMQP an ``OutboxAMQP``: every publish passes through ``send_task_message``."""
    install_task_sender(publisher.runtime.app, publisher,
                        lambda amqp, celery_sender: _make_sender(publisher, amqp, celery_sender))
