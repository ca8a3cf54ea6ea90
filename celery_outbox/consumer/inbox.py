"""The inbox: claim a delivery before its body runs; reject a redelivered duplicate.

Transaction boundaries, by idempotency style:

* ``optimistic`` (default for ``IdempotentTask``): the claim is the first statement
  of the task's own transaction and the body's writes through ``self.session``
  or ``self.connection`` follow in it (one pooled connection; the Session is made
  on it only if the body asks for one); claim, effects and outgoing messages commit or roll back
  together. Effects exactly once. A concurrent copy waits for the first
  transaction and is then discarded.
* ``eager`` (``idempotency = "eager"``, and every plain task consumed from a
  durable queue): the claim commits before the body; a concurrent copy never
  runs beside it (it goes back to the broker until the claim ends). The row is
  marked handled in the body's transaction. A claim whose owner died (or older
  than ``outbox_inbox_stale_time``) can be taken over.

For durable queues the full envelope is kept, so that the message can be published again
if the attempt dies. The eager style commits it with its claim, before the body; recovery
re-publishes it once the claim's node is found dead. The optimistic style commits nothing
before the body when the sender's tracked outgoing row holds the message: the envelope goes
in with the claim, and the acknowledgment of that row with them, as the first statement of
the attempt's transaction; an attempt that dies rolls back and leaves the sender's row, which
delivery tracking publishes again. Otherwise (no tracked row, or a key with a row already) it
commits the envelope, unowned, before the body, as the eager style does.

An attempt that ends in a retry is recorded as ``retried``; one that fails for good as
``dead``, with a dead letter; one the worker discards unrun (revoked or expired) as
``revoked``; each acknowledges the sender's rows of a durable queue. A
duplicate (the attempt already handled or ended) is acked, counted, logged at
INFO, signalled and ends IGNORED.

The claim rule: a claim never outlives the attempt that holds the message.

* A copy that meets a running claim of the same attempt whose owner is alive (it
  may still finish) is not a duplicate yet: it goes back to the broker after a
  back-off, until that claim is handled (then it is discarded) or released (then
  it runs).
* An attempt whose claim was taken from it (its node was declared dead) rolls
  back and sends its message back to the broker; it never acks it as a duplicate.
* Every store outage (see ``store.outage``), in the claim, the body's own
  statements, the finish, the record of a failed attempt (``dead``) or the count of a
  discarded duplicate, sends the message back to
  the broker: nothing is acked, nothing is recorded as a failure. (A retry's record that
  meets one is logged: the retry's own message is out already.) An eager claim
  that committed is released first; when the database cannot be reached for that
  either, the node's heartbeat thread releases it once it can.
* ``Reject(requeue=True)`` from the body releases the claim before the message
  goes back; ``Reject(requeue=False)`` ends it, like a failure without a dead
  letter (the broker dead-letters or drops the message, as in plain Celery).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any, Callable, Iterator, NoReturn

from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError

from ..core import log_fields
from ..core.crashpoints import crashpoint
from ..core.node import Node
from ..core.runtime import Runtime
from ..errors import OutboxError
from ..message import dead_letter_rows
from ..monitoring import tracing
from ..producer.publishing import Publisher
from ..producer.unit_of_work import ConnectionUnitOfWork, current_unit_of_work, run_body, transaction
from ..signals import announce_dead_letters, duplicate_discarded, message_handled
from ..store import UNOWNED, is_lock_timeout, utcnow
from ..store.outage import is_outage
from ..vocabulary import BUSY_ROW_WAIT, REQUEUE_BACKOFF, IdempotencyStyle, IncomingStatus
from .delivery import Delivery, dead_letter_row, envelope_of

__all__ = ["Inbox", "inbox_of", "installed_inbox"]

logger = logging.getLogger("celery_outbox.inbox")

# Seconds the worker's main process waits for a terminated attempt's open transaction to end (the
# killed process's connection closing rolls it back) before it gives up recording the revoke
TERMINATED_LOCK_WAIT = 5.0


class Duplicate(Exception):
    """The delivery was already handled or ended: discard it."""


class InFlight(Exception):
    """The delivery is claimed by a running attempt that may still finish: a copy goes back to
    the broker; a revoked one is discarded unrecorded (that attempt records its own outcome)."""


class ClaimLost(Exception):
    """The attempt's claim was taken over while its body ran: roll back and hand the message back."""


class _NotHeld(Exception):
    """No tracked outgoing row of the sender holds the delivery's message, or the attempt takes
    over a row its key has already: the attempt rolls back its claim, and the envelope is
    committed on its own first."""


_APP_ATTRIBUTE = "_celery_outbox_inbox"


def inbox_of(app: Any) -> "Inbox | None":
    """The inbox installed on ``app`` (``Inbox.install``), or None."""
    return getattr(app, _APP_ATTRIBUTE, None)


def installed_inbox(app: Any) -> "Inbox":
    """The inbox of the outbox installed on ``app``; a clear error when there is none."""
    inbox = inbox_of(app)
    if inbox is None:
        raise OutboxError(f"no Outbox is installed on app {app.main!r}: call Outbox(app) in your Celery module")
    return inbox


class Inbox:
    """Runs task bodies behind an inbox claim: claims in the store, units of work published by
    ``publisher``, eager claims held by ``node``."""

    def __init__(self, runtime: Runtime, publisher: Publisher, node: Node):
        self.runtime = runtime
        self.publisher = publisher
        self.node = node

    def install(self) -> None:
        """Make this the inbox the app's tasks run through (``inbox_of``)."""
        setattr(self.runtime.app, _APP_ATTRIBUTE, self)

    def run(self, task: Any, args: tuple, kwargs: dict, body: Callable[[], Any], style: IdempotencyStyle,
            unit_of_work: bool, queue: str | None = None) -> Any:
        """Run ``body`` once per delivery of ``task``'s current request (from ``queue``, when the caller
        resolved it already), in the delivery's consumer span (``tracing.delivery_context``)."""
        request = task.request
        if request.called_directly or request.is_eager or not request.id:
            return self._without_claim(body, unit_of_work)  # no message, nothing to deduplicate
        delivery = Delivery.from_request(task, self.runtime.settings, queue)
        with tracing.delivery_context(delivery, request):
            return self._run_delivery(task, delivery, args, kwargs, body, style, unit_of_work)

    def _run_delivery(self, task: Any, delivery: Delivery, args: tuple, kwargs: dict, body: Callable[[], Any],
                      style: IdempotencyStyle, unit_of_work: bool) -> Any:
        """Claim ``delivery``, run ``body`` in the style given, and turn each outcome into the
        answer the worker gives the broker."""
        durable = self.runtime.settings.is_durable(delivery.queue)
        envelope = envelope_of(task, args, kwargs) if durable else {}
        claimed = time.monotonic()
        try:
            if style is IdempotencyStyle.EAGER:
                result = self._run_eager(task, delivery, body, unit_of_work, envelope)
            else:
                result = self._run_optimistic(task, delivery, body, envelope)
            if message_handled.receivers:
                message_handled.send(sender=self.runtime.owner, message_id=delivery.message_id,
                                     task_name=delivery.task_name, queue=delivery.queue, attempt=delivery.attempt,
                                     seconds=time.monotonic() - claimed)
            return result
        except Duplicate:
            try:
                self._discard(delivery)
            except _StoreDown as down:
                self._send_back(delivery, "record a duplicate of", down)
            raise Ignore() from None
        except InFlight:
            logger.info("celery-outbox: %s[%s] from %r is claimed by an attempt still running; the copy goes "
                        "back to the broker", delivery.task_name, delivery.message_id, delivery.queue,
                        **log_fields.of_delivery(delivery))
            time.sleep(REQUEUE_BACKOFF)
            raise Reject("claimed by an attempt still running", requeue=True) from None
        except ClaimLost:
            logger.warning("celery-outbox: the claim of %s[%s] was taken over while its body ran (its node was "
                           "declared dead); its writes rolled back and the message goes back to the broker",
                           delivery.task_name, delivery.message_id, **log_fields.of_delivery(delivery))
            raise Reject("claim taken over", requeue=True) from None
        except _StoreDown as down:
            self._send_back(delivery, "claim", down)

    def _send_back(self, delivery: Delivery, doing: str, down: _StoreDown) -> NoReturn:
        """The store cannot be reached: the message goes back to the broker, to be claimed (or
        discarded and counted) when it comes again."""
        logger.warning(
            "celery-outbox: cannot %s %s[%s] from %r, the message store is unavailable; "
            "the message goes back to the broker: %s", doing, delivery.task_name, delivery.message_id,
            delivery.queue, down.reason, **log_fields.of_delivery(delivery),
        )
        time.sleep(REQUEUE_BACKOFF)
        raise Reject(str(down.reason), requeue=True) from None

    # -- the two styles ------------------------------------------------------------------------

    def _claim_row(self, delivery: Delivery, status: IncomingStatus, owner: int, now: datetime) -> dict[str, Any]:
        status = IncomingStatus(status)
        row = {
            **delivery.key(), "task_name": delivery.task_name, "queue": delivery.queue, "status": status.value,
            "owner": owner, "retries": delivery.retries, "nesting": delivery.nesting,
            "replays": delivery.replays, "received_at": now, "claimed_at": now,
        }
        if status == IncomingStatus.HANDLED:
            row.update(handled_at=now, keep_until=self._keep_until(now))
        else:
            row.update(keep_until=None)
        return row

    def _keep_until(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.runtime.settings.keep_after_handling)

    def _stale_before(self, now: datetime) -> datetime | None:
        stale = self.runtime.settings.inbox_stale_time
        return None if stale is None else now - timedelta(seconds=stale)

    def _not_claimed(self, conn: Connection, delivery: Delivery) -> Exception:
        """Why a claim failed: ``InFlight`` when a running claim of this attempt may still finish,
        else ``Duplicate``."""
        with _store_errors():
            in_flight = self.runtime.store.claim_in_flight(conn, delivery.message_id, delivery.destination,
                                                          delivery.attempt, delivery.send_id)
        return InFlight() if in_flight else Duplicate()

    def _run_optimistic(self, task: Any, delivery: Delivery, body: Callable[[], Any],
                        envelope: dict[str, Any]) -> Any:
        """The optimistic attempt; with an ``envelope`` (a durable queue), kept for recovery one of
        two ways. When the sender's tracked outgoing row holds the message, the envelope goes in
        with the claim and that row is acknowledged in the same statement, the first of the
        attempt's transaction: nothing commits before the body, and if the attempt dies, its
        rollback puts the sender's row back for delivery tracking to publish again
        (``outbox_redeliver_after``). A copy of an attempt the key's row has ended is found out
        by that first statement, and discarded (``_discard``). Otherwise (a sender without the
        outbox or without tracking, a copy recovery published, an attempt after the first, one
        taking over the key's row) the envelope is committed first (``_store_envelope``), for
        recovery to publish again after ``outbox_node_stale_after``. When the body hands that
        message back (``Reject(requeue=True)``), the envelope waits as a released eager claim's
        does (``_put_off_recovery``)."""
        if envelope and self._may_be_held(delivery):
            try:
                return self._run_optimistic_attempt(task, delivery, body, envelope, stored=False)
            except _NotHeld:
                pass  # rolled back: nothing but the claim ran in its transaction
        if not envelope:
            return self._run_optimistic_attempt(task, delivery, body, {}, stored=False)
        self._store_envelope(delivery, envelope, owner=UNOWNED)
        try:
            return self._run_optimistic_attempt(task, delivery, body, {}, stored=True)
        except Reject as reject:
            if reject.requeue:
                self._put_off_recovery(delivery)
            raise

    def _may_be_held(self, delivery: Delivery) -> bool:
        """The delivery's message may have a tracked outgoing row in this store, and the store can
        claim and acknowledge it in one statement (PostgreSQL). An attempt after the first (a
        retry, a replay, a ``replace``) meets the row of its key's earlier attempt: the held claim
        would roll back, so it takes the committed envelope's way at once."""
        return bool(delivery.sent_as) and not any(delivery.attempt) \
            and self.runtime.settings.redeliver_after is not None and self.runtime.store.is_postgres

    def _run_optimistic_attempt(self, task: Any, delivery: Delivery, body: Callable[[], Any],
                                envelope: dict[str, Any], stored: bool) -> Any:
        """Claim as the first statement of the attempt's transaction (with the ``envelope`` held by
        the sender's row, raising ``_NotHeld`` when it is not; or taking over the row of the
        envelope when the caller ``stored`` it), then the body."""
        store = self.runtime.store
        outcome: BaseException | None = None
        with self._attempt(task, delivery, unit_of_work=True) as uow:
            now = utcnow()
            with _store_errors(), tracing.delivery_span(tracing.Step.CLAIM, delivery):
                row = self._claim_row(delivery, IncomingStatus.HANDLED, UNOWNED, now)
                if envelope:
                    row.update(recoveries=delivery.redelivered, recover_after=None, **envelope)
                    held = store.claim_held_envelope(uow.connection, row, delivery.message_id,
                                                     self._acknowledged_destination(delivery), delivery.attempt,
                                                     delivery.sent_as)
                    if held == 0:  # no tracked outgoing row of this attempt holds the message
                        raise _NotHeld()
                    # None: the key has a row, of a copy (discarded here) or of an attempt this one takes over
                    if held is None and self._claim_in(uow.connection, row, now, stored=True):
                        raise _NotHeld()
                    claimed = bool(held)
                else:
                    claimed = self._claim_in(uow.connection, row, now, stored=stored)
            if not claimed:
                raise self._not_claimed(uow.connection, delivery)
            crashpoint("after_claim")
            try:
                result = run_body(body, uow)
            except Ignore as ignore:  # the body stopped on purpose (replace does): keep its work
                outcome = ignore
        if outcome is not None:
            raise outcome
        return result

    def _claim_in(self, conn: Any, row: dict[str, Any], now: datetime, stored: bool = False) -> bool:
        """``Store.claim_incoming`` in the open transaction ``conn``, by this inbox's stale and silent
        times as of ``now``."""
        return self.runtime.store.claim_incoming(conn, row, self._stale_before(now),
                                                 self.runtime.settings.silent_before(now), stored=stored)

    def _run_eager(self, task: Any, delivery: Delivery, body: Callable[[], Any], unit_of_work: bool,
                   envelope: dict[str, Any]) -> Any:
        node_id = self.node.id
        try:
            return self._run_eager_claimed(task, delivery, body, unit_of_work, envelope, node_id)
        except _StoreDown:
            self._release_claim(delivery, node_id)
            raise
        except Reject as reject:
            if reject.requeue:
                self._release_claim(delivery, node_id)
            raise

    def _release_claim(self, delivery: Delivery, node_id: int) -> None:
        """The attempt ends without finishing its eager claim, and its message goes back to the
        broker (a store outage, ``Reject(requeue=True)``): release the claim, in a transaction of
        its own, so that the copy takes it over instead of meeting it running. When the database
        cannot be reached for that either, the node's heartbeat thread releases it later; until
        then a copy goes back to the broker again. Recovery waits as ``_release_in_store`` says."""
        try:
            self._release_in_store(delivery, node_id)
        except Exception as error:  # noqa: BLE001 - the node's heartbeat thread tries again
            logger.warning("celery-outbox: could not release the claim of %s[%s] (the node releases it when the "
                           "database answers): %s", delivery.task_name, delivery.message_id, error,
                           **log_fields.of_delivery(delivery))
            self.node.release_later(delivery.message_id, delivery.destination, delivery.attempt,
                                    delivery.send_id, delivery.acks_late)

    def _put_off_recovery(self, delivery: Delivery) -> None:
        """An optimistic attempt whose envelope committed before the body (``UNOWNED``) hands its
        message back (``Reject(requeue=True)``), and its claim rolled back: the envelope waits for
        recovery as a released eager claim does (``_release_in_store``). When the store cannot
        take that, recovery publishes it when it was due (a copy the inbox discards, nothing lost)."""
        try:
            self._release_in_store(delivery, UNOWNED)
        except Exception as error:  # noqa: BLE001 - recovery publishes when it was due: a discarded copy at worst
            logger.warning("celery-outbox: could not put off the recovery of %s[%s], handed back to the broker "
                           "(recovery may publish a copy, which the inbox discards): %s", delivery.task_name,
                           delivery.message_id, error, **log_fields.of_delivery(delivery))

    def _release_in_store(self, delivery: Delivery, node_id: int) -> None:
        """Release ``node_id``'s claim of the delivery's row in a transaction of its own, with the
        time recovery may re-publish its envelope (``OutboxSettings.released_claim_recovery``): an
        ``acks_late`` task's message is held by the broker, so recovery waits; otherwise Celery
        acked the message on receipt, and the envelope, due at once, is the message's only copy."""
        store = self.runtime.store
        with store.begin() as conn:
            recover_after = self.runtime.settings.released_claim_recovery(utcnow(), delivery.acks_late)
            store.release_claim(conn, delivery.message_id, delivery.destination, node_id, delivery.attempt,
                                recover_after, delivery.send_id)

    def _run_eager_claimed(self, task: Any, delivery: Delivery, body: Callable[[], Any], unit_of_work: bool,
                           envelope: dict[str, Any], node_id: int) -> Any:
        store = self.runtime.store
        if envelope:  # a durable queue: the envelope is stored already claimed, in one transaction
            with tracing.delivery_span(tracing.Step.CLAIM, delivery):
                self._store_envelope(delivery, envelope, owner=node_id)

        def finish(connection: Connection, commit: bool) -> bool:  # False: another node took the claim over
            finished = utcnow()
            return store.finish_incoming(connection, delivery.message_id, delivery.destination, node_id,
                                         delivery.attempt, finished, self._keep_until(finished), commit=commit,
                                         send_id=delivery.send_id)

        outcome: BaseException | None = None
        with self._attempt(task, delivery, unit_of_work, last=finish) as uow:
            if not envelope:
                now = utcnow()
                # committed without waiting for the disk (the body's commit makes it durable), on the
                # attempt's connection: the body's transaction begins in the same round trip
                with _store_errors(), tracing.delivery_span(tracing.Step.CLAIM, delivery):
                    row = self._claim_row(delivery, IncomingStatus.RUNNING, node_id, now)
                    claimed = store.claim_incoming_alone(row, self._stale_before(now), uow.connection_before_begin,
                                                         self.runtime.settings.silent_before(now))
                if not claimed:
                    with _store_errors(), store.begin(durable=False, on=uow.connection_before_begin) as conn:
                        raise self._not_claimed(conn, delivery)
            crashpoint("after_claim")
            try:
                result = run_body(body, uow) if unit_of_work else body()
            except Ignore as ignore:
                outcome = ignore
        if outcome is not None:
            raise outcome
        return result

    @contextmanager
    def _attempt(self, task: Any, delivery: Delivery, unit_of_work: bool,
                 last: Callable[[Connection, bool], bool] | None = None) -> Iterator[ConnectionUnitOfWork]:
        """The attempt's transaction: one pooled connection, committed when the block ends (durable
        messages inserted just before, then ``last``, the statement the COMMIT may go with;
        everything captured published just after) and rolled back on any exception, or as
        ``ClaimLost`` when ``last`` returns False. With ``unit_of_work``, the block's publishes
        are captured into it. When the attempt failed, how it ended is recorded after the
        rollback (``_ending``)."""
        with _store_errors():
            uow = self._new_attempt(unit_of_work)
        with self._ending(task, delivery, uow), uow.opened() if unit_of_work else nullcontext():
            try:
                yield uow
                with _store_errors():
                    committed = uow.commit(last)
                if not committed:
                    raise ClaimLost()
            except BaseException:
                uow.rollback()
                raise

    def _new_attempt(self, unit_of_work: bool) -> ConnectionUnitOfWork:
        """The attempt's unit of work: on the outbox's engine, or, for an ``IdempotentTask`` of an
        outbox that joins a framework's transactions (Django's), in that framework's transaction."""
        self.publisher.prepare_sender()
        joined = self.runtime.joined
        if unit_of_work and joined is not None:
            return joined.attempt(self.publisher, self.runtime.settings)
        return ConnectionUnitOfWork(self.publisher)

    @contextmanager
    def _ending(self, task: Any, delivery: Delivery, uow: ConnectionUnitOfWork) -> Iterator[None]:
        """Close the attempt (its connection back to the pool, then what it publishes or the
        retry that survives its rollback: ``ConnectionUnitOfWork.close``), then record how it
        ended when its transaction rolled back: an attempt holds one pooled connection at a time.
        An exception of the body that is a store outage, or that left the attempt's connection
        unusable, is an outage: the message goes back, nothing is recorded."""
        lost = False
        try:
            try:
                yield
            except Exception:
                lost = uow.connection_lost()  # judged before the close below closes it
                raise
            finally:
                uow.close()
        except (Duplicate, InFlight, ClaimLost, _NotHeld, _StoreDown):
            raise
        except Reject as reject:
            if not reject.requeue:
                self._record(task, delivery, IncomingStatus.DEAD)
            raise
        except Retry:
            self._record(task, delivery, IncomingStatus.RETRIED)
            raise
        except Exception as exc:
            if is_outage(exc) or lost:
                raise _StoreDown(exc) from exc
            self._record(task, delivery, IncomingStatus.DEAD, exc)
            raise

    def _without_claim(self, body: Callable[[], Any], unit_of_work: bool) -> Any:
        if not unit_of_work:
            return body()
        with transaction(self.publisher):  # joins a unit of work already open in this context
            uow = current_unit_of_work()
            assert uow is not None
            return run_body(body, uow)

    # -- outcomes ------------------------------------------------------------------------------

    def _store_envelope(self, delivery: Delivery, envelope: dict[str, Any], owner: int) -> None:
        """Keep this attempt's envelope, committed, before the body runs: if this process dies
        before the attempt ends, recovery re-publishes it after ``outbox_node_stale_after``
        (once the claim of a dead ``owner`` is released). Unowned for an optimistic attempt
        whose message no tracked outgoing row holds (its claim commits with the body); claimed
        by this node for the eager style, which saves it a transaction. In the same transaction
        the sender's sent outgoing row is acknowledged (deleted): from here on the inbox answers
        for the message. Raises ``Duplicate`` when the attempt was already claimed or handled,
        or ``InFlight`` when a running claim of it may still finish: the same rules as the claim
        itself."""
        store = self.runtime.store
        now = utcnow()
        grace = timedelta(seconds=self.runtime.settings.node_stale_after)
        row = {**self._claim_row(delivery, IncomingStatus.RUNNING, owner, now), "recoveries": delivery.redelivered,
               "recover_after": now + grace, **envelope}
        if owner == UNOWNED:
            del row["claimed_at"]  # nobody has claimed it yet
        with _store_errors():  # a new key, the common case: one round trip on PostgreSQL
            if store.store_envelope_alone(row, delivery.message_id, self._acknowledged_destination(delivery),
                                          delivery.attempt, delivery.sent_as):
                return
        with _store_errors(), store.begin(durable=False) as conn:  # the body's commit makes it durable
            if not self._claim_in(conn, row, now):
                raise self._not_claimed(conn, delivery)
            self._acknowledge(conn, delivery)  # the inbox has the message now: the sender's row can go

    def _record(self, task: Any, delivery: Delivery, status: IncomingStatus, exc: BaseException | None = None) -> None:
        """After a rollback: remember that this attempt ended (retried, or dead, with a dead letter
        when it failed). A dead attempt whose record meets a store outage is an outage: its
        message goes back to the broker rather than be acked with no dead letter."""
        store = self.runtime.store
        now = utcnow()
        row = self._claim_row(delivery, status, UNOWNED, now)
        row.update(keep_until=self._keep_until(now), handled_at=now)
        failed = dead_letter_rows.DeadLetterReason.FAILED
        dead_letters = [] if exc is None else [dead_letter_row(task, delivery, failed, exc, now)]
        try:
            with store.begin() as conn:
                dead_letters = self._record_ended(conn, delivery, row, dead_letters)
            announce_dead_letters(self.runtime.owner, dead_letters)
        except Exception as error:  # noqa: BLE001 - the task's own outcome stands; say what was not recorded
            if status == IncomingStatus.DEAD and is_outage(error, transient=True):
                raise _StoreDown(error) from error
            logger.error("celery-outbox: could not record that %s[%s] ended %s: %s",
                         delivery.task_name, delivery.message_id, status, error, **log_fields.of_delivery(delivery))

    def end_killed_attempt(self, delivery: Delivery, dead_letter: dict[str, Any],
                           lock_wait: float = BUSY_ROW_WAIT) -> bool:
        """The worker's pool process running this attempt is gone and Celery fails the task for
        good: it died once too often (Celery re-sends a lost attempt only up to ``max_retries``),
        or the worker killed it at the task's hard time limit. End the attempt as ``dead`` (over
        the running claim the process left, whoever owns it) and keep its message in dead
        letters, and acknowledge the sender's rows, in one transaction: neither recovery nor
        delivery tracking runs it again. Runs in the worker's main process: a row another
        transaction holds (the killed process's, until the server ends its session) is waited
        for at most ``lock_wait`` seconds. Raises on a store error or that wait running out.
        False when the key's row is handled (the attempt or a copy committed first) or a later
        attempt's: nothing is dead-lettered."""
        store = self.runtime.store
        now = utcnow()
        row = self._claim_row(delivery, IncomingStatus.DEAD, UNOWNED, now)
        row.update(keep_until=self._keep_until(now), handled_at=now)
        with store.begin(lock_wait=lock_wait) as conn:
            dead_letters = self._record_ended(conn, delivery, row, [dead_letter])
        announce_dead_letters(self.runtime.owner, dead_letters)
        return bool(dead_letters)

    def release_lost_process_claim(self, delivery: Delivery, hostname: str, pid: int) -> int:
        """The worker saw its pool process ``pid`` die running this attempt, and Celery hands the
        message back to the broker as it is (``reject_on_worker_lost``): release the eager claim
        that process held (the node of ``pid`` on ``hostname``), in a transaction of its own, so
        that the copy takes it over at once instead of going back to the broker until recovery
        (or, on PostgreSQL, the silence of the process's heartbeat) declares the process dead.
        Returns how many claims it released (0: none was running, or another node holds it). Runs
        in the worker's main process: a row another transaction holds (the dead process's, until
        the server ends its session) is waited for at most ``BUSY_ROW_WAIT``. Raises on a store
        error: the copy then waits for recovery, as before."""
        store = self.runtime.store
        with store.begin(lock_wait=BUSY_ROW_WAIT) as conn:
            recover_after = self.runtime.settings.released_claim_recovery(utcnow(), handed_back=True)
            return store.release_claim_of_process(conn, delivery.message_id, delivery.destination, hostname, pid,
                                                  delivery.attempt, recover_after, delivery.send_id)

    def _record_ended(self, conn: Connection, delivery: Delivery, row: dict[str, Any],
                      dead_letters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """In the open transaction ``conn``: record the ended attempt ``row`` with its
        ``dead_letters``, and acknowledge the sender's rows (a rolled-back claim put them back).
        Returns the dead letters stored: none when the key's row is handled (a copy ran
        meanwhile) or a later attempt's, whose outcome is the message's."""
        store = self.runtime.store
        stored = dead_letters if store.record_outcome(conn, row) else []
        store.insert_dead_letters(conn, stored)
        self._acknowledge_if_durable(conn, delivery)
        return stored

    def end_revoked_attempt(self, delivery: Delivery, terminated: bool = False) -> None:
        """The worker discards this delivery unrun (revoked, or expired), or has killed the pool
        process running it (``terminated``: ``revoke(terminate=True)``), as Celery does: end its
        attempt as ``revoked`` and, for a durable queue, acknowledge the sender's outgoing rows, in
        one transaction, before Celery acks the message. A later copy of the attempt (one the
        broker or recovery sends again, to a worker that has forgotten the revoke) is then a
        duplicate, and delivery tracking stops re-publishing it.

        The attempt is recorded by the claim's own rule (``Store.claim_incoming``): a new row, or
        one this delivery could claim (an earlier attempt, a released claim). A row of an attempt
        that is running in a live worker, or that ended, keeps its outcome, except that a
        terminated attempt takes over its own running claim (the killed process's: recovery must
        not run it again). A terminated optimistic attempt's claim is in the killed process's
        open transaction: its row waits for that transaction to end, at most
        ``TERMINATED_LOCK_WAIT`` seconds. A revoked or expired copy waits at most
        ``BUSY_ROW_WAIT`` for rows another transaction holds: an optimistic attempt of the
        message running elsewhere holds its key, and its sender's row, until it ends, and records
        its own outcome; that wait running out raises ``InFlight`` (the revoke stands in this
        worker, unrecorded). Raises on a store error (the caller logs it; the revoke stands in
        this worker)."""
        store = self.runtime.store
        now = utcnow()
        row = self._claim_row(delivery, IncomingStatus.REVOKED, UNOWNED, now)
        row.update(handled_at=now, keep_until=self._keep_until(now), recover_after=None)
        stale_before = now if terminated else self._stale_before(now)
        try:
            with store.begin(lock_wait=TERMINATED_LOCK_WAIT if terminated else BUSY_ROW_WAIT) as conn:
                store.claim_incoming(conn, row, stale_before, self.runtime.settings.silent_before(now))
                self._acknowledge_if_durable(conn, delivery)
        except Exception as error:
            if not terminated and is_lock_timeout(error):
                raise InFlight() from error
            raise

    def _acknowledge(self, conn: Any, delivery: Delivery) -> None:
        """Delete the sender's outgoing rows of this attempt and earlier ones (delivery tracking)."""
        self.runtime.store.acknowledge_outgoing(conn, delivery.message_id, self._acknowledged_destination(delivery),
                                               delivery.attempt, delivery.sent_as)

    def _acknowledge_if_durable(self, conn: Any, delivery: Delivery) -> None:
        """``_acknowledge`` for a delivery from a durable queue; one from a plain queue has no
        sender's rows."""
        if self.runtime.settings.is_durable(delivery.queue):
            self._acknowledge(conn, delivery)

    def _acknowledged_destination(self, delivery: Delivery) -> str | None:
        """The destination whose outgoing rows the delivery acknowledges: its queue with message
        identity ``id_and_destination``; None (every destination) with identity ``id``."""
        return self.runtime.settings.destination_of(delivery.queue)

    def _discard(self, delivery: Delivery) -> None:
        """Count the duplicate on its inbox row and, for a durable queue, acknowledge the sender's
        outgoing rows of its attempt, in one transaction. Raises ``_StoreDown`` when the store
        cannot be reached (the copy goes back to the broker, to be counted when it comes again);
        on any other store error the discard stands uncounted (a copy whose row cannot be
        counted must not circle for ever)."""
        try:
            with _store_errors(), tracing.delivery_span(tracing.Step.DISCARD, delivery), \
                    self.runtime.store.begin(durable=False) as conn:
                self.runtime.store.count_duplicate(conn, delivery.message_id, delivery.destination, delivery.send_id)
                self._acknowledge_if_durable(conn, delivery)  # the inbox has this attempt: stop redelivering it
        except _StoreDown:
            raise
        except Exception as error:  # noqa: BLE001 - not an outage: the discard stands, uncounted
            logger.warning("celery-outbox: could not record a duplicate of %s: %s", delivery.message_id, error,
                           **log_fields.of_delivery(delivery))
        logger.info("celery-outbox: discarded duplicate %s[%s] from queue %r (attempt %s)",
                    delivery.task_name, delivery.message_id, delivery.queue, delivery.attempt,
                    **log_fields.of_delivery(delivery))
        duplicate_discarded.send(sender=self.runtime.owner, message_id=delivery.message_id,
                                 task_name=delivery.task_name, queue=delivery.queue)


class _StoreDown(Exception):
    def __init__(self, reason: BaseException):
        super().__init__(str(reason))
        self.reason = reason


class _store_errors:
    """Turn "the database cannot be reached" during our own statements into ``_StoreDown``."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, (OperationalError, InterfaceError)) or is_outage(exc, transient=True):
            raise _StoreDown(exc) from exc
        return False
