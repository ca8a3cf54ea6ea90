"""The publisher: stores a unit of work's durable messages in its transaction, publishes after it.

Transaction boundary: durable messages are inserted in the unit of work's transaction, marked sent
(naming this process's node, once it is registered) when the commit publishes them at once; after
the commit every captured message is published in call order with one producer, and a failed
publish unmarks its row in a transaction of its own. With an archive, or delivery tracking off,
the rows are taken after the commit by one statement whose transaction commits after the publish.
Outside a unit of work a durable message is stored in a transaction of its own, then published.
Guarantee: no broker error is raised once the commit happened; a durable message whose publish
fails waits for the relay, and one never published for redelivery: delayed, never lost.
"""

from __future__ import annotations

import logging
from datetime import datetime
from itertools import groupby
from operator import attrgetter
from typing import Any, Iterable

from kombu.exceptions import OperationalError as KombuOperationalError

from ..core import log_fields
from ..core.crashpoints import crashpoint
from ..core.node import Nodes
from ..core.runtime import Runtime
from ..message.envelope import OutgoingMessage
from ..monitoring import tracing
from ..signals import message_published, messages_stored, publish_failed
from ..store import is_lock_timeout, utcnow
from ..vocabulary import BUSY_ROW_WAIT
from .broker import BoundQueues, Outlet, connection_errors, outlet

__all__ = ["Publisher"]

logger = logging.getLogger("celery_outbox.publishing")


class Publisher:
    """Publishes committed messages; the one place that talks to the broker on commit. The rows
    it stores marked sent name ``node`` as their sender (``Node.sender_id``)."""

    def __init__(self, runtime: Runtime, node: Nodes):
        self.runtime = runtime
        self.node = node

    @property
    def marks_sent(self) -> bool:
        """Whether a due durable message is stored marked sent: delivery tracking on, no archive."""
        return self.runtime.archiver is None and self.runtime.settings.redeliver_after is not None

    def prepare_sender(self) -> None:
        """Before a unit of work begins: register this process's node, the sender its rows stored
        marked sent name, when there are durable queues to store them for (``Node.prepare``), on
        PostgreSQL. On SQLite a process is a node only for its eager claims: a heartbeat writing to
        the file every few seconds beside a web process's own transactions could make them fail
        (a deferred transaction's lock upgrade meets it: "database is locked")."""
        if self.runtime.settings.durable_queues and self.marks_sent and self.runtime.store.is_postgres:
            self.node.prepare()

    def store_durable(self, conn: Any, messages: list[OutgoingMessage], commit: bool = False) -> None:
        """Insert durable messages in ``conn``'s transaction (one statement) and note their row ids;
        with ``commit``, the transaction's last statement, which the COMMIT may go with.

        With delivery tracking on and no archive, a message ``publish_committed``
        publishes at once (no eta, or one already released) is stored marked sent, its
        redelivery due as if it had just been published: after the commit the publisher only
        publishes, with no round trip to the store, and gives a row whose publish failed back to
        the relay. A commit whose publish never happens (the process died in between) is what a
        broker that lost the message is to delivery tracking: redelivery sends it once due
        (``outbox_redeliver_after``), and the relay never sends it meanwhile, so nothing publishes
        it twice."""
        settings = self.runtime.settings
        now = utcnow()
        marking = self.marks_sent
        release_before = settings.release_before(now) if marking else now
        sender = self.node.sender_id() if marking else None
        rows = []
        for message in messages:
            row = message.to_row(now)
            message.marked_sent = marking and message.is_due(release_before)
            if message.marked_sent:  # every row's columns in the same order: one prepared INSERT
                row["sent_at"], row["redeliver_at"] = now, settings.first_redelivery(now, message.deliver_at)
                row["sender"] = sender
            else:
                row["sent_at"] = row["redeliver_at"] = row["sender"] = None
            rows.append(row)
        store = self.runtime.store
        with tracing.messages_span(tracing.Step.STORE, messages):
            ids = store.insert_outgoing(conn, rows, commit=commit)
        for message, row_id in zip(messages, ids, strict=True):
            message.row_id = row_id

    def store_and_forward(self, messages: list[OutgoingMessage], producer: Any = None) -> None:
        """Outside a unit of work (or for what survives its rollback): store durable messages in their
        own transaction, then publish with ``producer`` (the one the sender holds: taking a second
        one from the app's pool while holding the first deadlocks once the pool is exhausted), or
        one from the pool."""
        durable = [m for m in messages if m.durable]
        if durable:
            store = self.runtime.ready().store
            self.prepare_sender()
            with store.begin() as conn:  # on PostgreSQL, BEGIN, the INSERT and the COMMIT in one round trip
                self.store_durable(conn, durable, commit=True)
            crashpoint("after_commit")
        self.publish_committed(messages, producer)

    def publish_committed(self, messages: list[OutgoingMessage], producer: Any = None) -> None:
        """Publish in call order with one producer (``producer``, or one from the app's pool).

        Durable rows stored marked sent (``store_durable``) are only published: no round trip
        to the store; a row whose publish failed is unmarked afterwards, in a transaction of its
        own, for the relay (should that fail too, its redelivery sends it). With an archive the
        durable rows are stored unmarked and taken here, in one transaction: locked (``SKIP
        LOCKED``: a relay running at the same moment never sends them too) and marked sent; then
        published; a row whose publish failed is unmarked, for the relay; each send is recorded
        in the same transaction. A crash before its commit rolls the marks back: the relay sends
        those rows. With delivery tracking off the rows are deleted instead (see
        ``_publish_deleting``). Never raises for a broker error: the commit already happened.

        A durable message with an eta goes out now, eta kept, when ``release_before`` (the
        relay's rule too) releases it, and its redelivery counts from its eta; a later one waits
        in the store for the relay. Each send's ``task-sent`` event follows its message (a held
        one's is sent now, as Celery sends it with the message).
        """
        now = utcnow()
        for message in messages:
            message.committed_at = message.committed_at or now
        if not any(message.durable for message in messages):  # nothing stored: only published
            with outlet(self.runtime.app, producer) as out:
                self._publish_plain(messages, out.producer, out.bound, False)
            return
        if messages_stored.receivers:
            stored = [m for m in messages if m.durable]
            if stored:
                messages_stored.send(sender=self.runtime.owner, messages=stored)
        settings = self.runtime.settings
        release_before = settings.release_before(now)
        held: list[OutgoingMessage] = []  # wait in the store (one stored marked sent was due when it was stored)
        due: list[OutgoingMessage] = []
        marked: set[int] = set()  # rows stored marked sent: only published
        to_take: list[int] = []  # rows stored unmarked: taken for the publish
        for message in messages:
            if message.durable and not message.marked_sent and not message.is_due(release_before):
                held.append(message)
                continue
            due.append(message)
            if message.durable and message.row_id is not None:
                (marked.add if message.marked_sent else to_take.append)(message.row_id)
        messages = due
        if not to_take:
            sent = self._publish_all(messages, marked, producer, held)
            if marked:
                crashpoint("after_publish")
                self._give_back(sorted(marked.difference(sent)))
            return
        store = self.runtime.store
        redeliver_at = settings.first_redelivery(now)
        try:
            if redeliver_at is None:
                self._publish_deleting(messages, to_take, now, producer, held)
                return
            with store.taking_outgoing(to_take, now, redeliver_at) as (conn, taken):
                owned = set(taken)
                store.postpone_redelivery(conn, [
                    {"id": m.row_id, "redeliver_at": settings.first_redelivery(now, m.deliver_at)}
                    for m in messages if m.row_id in owned and m.deliver_at is not None and m.deliver_at > now])
                # a message stored not yet due that came due since (its eta passed the release
                # line meanwhile) is taken here, beside ones stored marked sent in the same unit
                owned |= marked
                sent = self._publish_all(messages, owned, producer, held)
                crashpoint("after_publish")
                if sent and self.runtime.archiver is not None:
                    store.record_sent(conn, sent, now)
                store.unmark_sent(conn, sorted(owned.difference(sent)))
        except Exception as exc:  # noqa: BLE001 - the rows stay for the relay; the caller's commit stands
            logger.error("celery-outbox: could not finish publishing committed messages (the relay will): %s", exc)
            if any(message.sent_event is not None for message in held):  # the store failed before the publish
                self._publish_all([], set(), producer, held)

    def _give_back(self, ids: list[int]) -> None:
        """Rows stored marked sent whose publish failed: unsent again, in a transaction of their
        own, so the relay sends them at its next pass. If the store is down too, they stay
        marked and their redelivery sends them. A publish can fail after the broker took the
        message: a consumer's optimistic attempt then holds the row (its claim deleted it, in a
        transaction open until the body ends); that is waited for at most ``BUSY_ROW_WAIT``,
        then the rows stay marked sent: delivery tracking publishes them again if that attempt
        rolls back."""
        if not ids:
            return
        store = self.runtime.store
        try:
            with store.begin(durable=False, lock_wait=BUSY_ROW_WAIT) as conn:  # lost in a crash: redelivered
                store.unmark_sent(conn, ids)
        except Exception as exc:  # noqa: BLE001 - the rows stay marked; the caller's commit stands
            if is_lock_timeout(exc):
                logger.warning("celery-outbox: %d messages whose publish failed are held by a consumer's running "
                               "attempt (the broker took them); they stay marked sent, for their redelivery if "
                               "that attempt rolls back", len(ids))
                return
            logger.error("celery-outbox: could not give %d unpublished messages back to the relay "
                         "(their redelivery sends them): %s", len(ids), exc)

    def _publish_deleting(self, messages: list[OutgoingMessage], durable_ids: list[int], now: datetime,
                          producer: Any, held: list[OutgoingMessage]) -> None:
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
                sent = self._publish_all(messages, {row.id for row in taken}, producer, held)
                crashpoint("after_publish")
                if len(sent) < len(taken):
                    raise _PartlyPublished(sent)
                if record:
                    store.record_sends(conn, taken, now)
        except _PartlyPublished as partly:
            if partly.sent:
                with store.begin(durable=False) as conn:
                    store.finish_sent(conn, partly.sent, now, None, record=record)

    def _publish_all(self, messages: list[OutgoingMessage], owned: set[int], producer: Any,
                     held: list[OutgoingMessage]) -> list[int]:
        """With one producer: the ``task-sent`` events of the ``held`` messages (stored to wait),
        then the messages in call order; durable messages in batches (``Outlet.publish_each``),
        plain ones one by one with Celery's own retry. Returns the row ids of the durable messages
        sent."""
        sent: list[int] = []
        with outlet(self.runtime.app, producer) as out:
            # durable messages fail fast when the broker is down: their rows wait for the relay
            broker_down = bool(owned) and out.unreachable() is not None
            for message in held:
                self._send_event(message, out.producer, broker_down)
            for durable, run in groupby(messages, key=attrgetter("durable")):
                if not durable:
                    broker_down = self._publish_plain(run, out.producer, out.bound, broker_down)
                    continue
                run = list(run)
                published, broker_down = self._publish_durable(out, run, owned, broker_down)
                sent += [message.row_id for message in published]
                for message in run:  # stored: sent, whether the broker has it now or the relay sends it
                    self._send_event(message, out.producer, broker_down)
        return sent

    def _publish_plain(self, messages: Iterable[OutgoingMessage], producer: Any, entities: BoundQueues,
                       broker_down: bool) -> bool:
        """Publish messages that have no row with ``producer``, one by one with Celery's retry
        policy, each followed by its ``task-sent`` event; a failed one is reported and lost
        (nothing stored it). Returns whether the broker is known to be down."""
        for message in messages:
            try:
                with tracing.publish_span(tracing.Step.PUBLISH, message):
                    message.publish(producer, entities=entities)
            except Exception as exc:  # noqa: BLE001 - reported: a plain message is lost
                broker_down = broker_down or isinstance(exc, connection_errors(producer.connection))
                self._failed(message, exc)
            else:
                message_published.send(sender=self.runtime.owner, message=message, relayed=False)
                self._send_event(message, producer, broker_down)
        return broker_down

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
            error = KombuOperationalError("the broker did not answer")
            tracing.publish_failed(tracing.Step.PUBLISH, run, error)
            for message in run:
                self._failed(message, error)
            return [], True
        done = out.publish_each([(message, message) for message in run])
        for message, _, exc in done.failed:
            self._failed(message, exc)
        for message, _ in done.not_sent:
            self._failed(message, done.broker_error or KombuOperationalError("the broker did not answer"))
        published = [message for message, _ in done.published]
        if message_published.receivers:
            for message in published:
                message_published.send(sender=self.runtime.owner, message=message, relayed=False)
        return published, done.broker_error is not None

    def _failed(self, message: OutgoingMessage, exc: BaseException) -> None:
        if message.durable:
            logger.warning(
                "celery-outbox: publish of %s[%s] to %r failed, the relay will retry it: %r",
                message.task_name, message.message_id, message.destination, exc, **log_fields.of_message(message),
            )
        else:
            logger.error(
                "celery-outbox: publish of %s[%s] to %r failed after commit and the queue is not durable, "
                "the message is lost: %r",
                message.task_name, message.message_id, message.destination, exc, **log_fields.of_message(message),
            )
        publish_failed.send(sender=self.runtime.owner, message=message, exception=exc)


class _PartlyPublished(Exception):
    """Rolls back a transaction that deleted rows whose publish then failed."""

    def __init__(self, sent: list[int]):
        super().__init__(f"{len(sent)} published")
        self.sent = sent
