"""The inbox: claim a delivery before its body runs; discard a copy of an attempt that ended.

Transaction boundary: in the ``optimistic`` style (``IdempotentTask``'s default) the claim is the
first statement of the body's own transaction, so claim, effects and the messages it sends commit
or roll back together; in the ``eager`` style (and for every plain task from a durable queue) the
claim commits before the body, which marks it handled in its own transaction. A durable queue's
envelope is kept for recovery: with the claim when the sender's tracked row holds it, else
committed first. Guarantee: effects exactly once (optimistic); a copy never runs beside a running
claim; a store outage sends the message back to the broker, or, when the store is a tenant's,
parks it in the default store (acked) for that tenant's recovery to send again. How a claim ended is a value
(``claims.Claim``), answered in one place (``Inbox._answer``); the rule is in docs/inbox.md.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Callable, Iterator, NoReturn

from celery import signals
from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy.engine import Connection

from ..core import log_fields
from ..core.crashpoints import crashpoint
from ..core.node import Nodes
from ..core.runtime import Runtime
from ..core.tenancy import TENANT_HEADER, using_tenant, valid_tenant_name
from ..errors import ConfigurationError, IncompatibleSchema, OutboxError, StoreUnavailable
from ..monitoring import tracing
from ..producer.publishing import Publisher
from ..producer.unit_of_work import ConnectionUnitOfWork, current_unit_of_work, run_body, transaction
from ..signals import message_handled
from ..store import UNOWNED, utcnow
from ..store.outage import is_outage
from ..vocabulary import REQUEUE_BACKOFF, IdempotencyStyle, IncomingStatus
from .claims import Claim, Ended, InboxRows, StoreDown, store_errors
from .delivery import Delivery, envelope_of
from .outages import Parked
from .records import AttemptRecords

__all__ = ["Inbox", "enter_tenant_of_run", "inbox_of", "installed_inbox", "leave_tenant_of_run"]

logger = logging.getLogger("celery_outbox.inbox")

_APP_ATTRIBUTE = "_celery_outbox_inbox"
#: the run a worker entered for its message's tenant (``enter_tenant_of_run``): its request, and the block to leave
_run_of_tenant: ContextVar[tuple[Any, ExitStack] | None] = ContextVar("celery_outbox_run_of_tenant", default=None)


def inbox_of(app: Any) -> "Inbox | None":
    """The inbox installed on ``app`` (``Inbox.install``), or None."""
    return getattr(app, _APP_ATTRIBUTE, None)


def installed_inbox(app: Any) -> "Inbox":
    """The inbox of the outbox installed on ``app``; a clear error when there is none."""
    inbox = inbox_of(app)
    if inbox is None:
        raise OutboxError(f"no Outbox is installed on app {app.main!r}: call Outbox(app) in your Celery module")
    return inbox


def enter_tenant_of_run(sender: Any = None, **_: Any) -> None:
    """Celery's ``task_prerun``, in the process that runs the task: a worker's run of a message
    naming a tenant (``TENANT_HEADER``) is that tenant's until ``task_postrun``
    (``leave_tenant_of_run``). The inbox runs the body for the tenant; what Celery does around the
    body is the tenant's too: the next task of a chain, link callbacks and errbacks are sent for
    the tenant (stored in its database, claimed there), and the task's handlers (``on_success``,
    ``after_return``...) run for it. A name that is not a tenant's is left to the inbox, which
    refuses it."""
    task = sender
    request = getattr(task, "request", None)
    if request is None or request.is_eager or inbox_of(task.app) is None:
        return
    tenant = getattr(request, TENANT_HEADER, None) or None
    if tenant is None or not valid_tenant_name(tenant):
        return
    block = ExitStack()
    block.enter_context(using_tenant(tenant))
    _run_of_tenant.set((request, block))


def leave_tenant_of_run(sender: Any = None, **_: Any) -> None:
    """Celery's ``task_postrun``: the run entered for a tenant (``enter_tenant_of_run``) ends; an
    eager run inside it (``apply()`` in the body) leaves it as it is."""
    entered = _run_of_tenant.get()
    if entered is None or entered[0] is not getattr(sender, "request", None):
        return
    _run_of_tenant.set(None)
    entered[1].close()


class _Attempt:
    """The attempt's transaction as its block sees it: its unit of work, and the claim it ended
    with when the block refused to run the body (rolled back, nothing recorded)."""

    def __init__(self, uow: ConnectionUnitOfWork):
        self.uow = uow
        self.refused: Claim | None = None
        self.lost = False

    def refuse(self, claim: Claim) -> Ended:
        """End the block without the body: its transaction rolls back, and the attempt ends ``claim``."""
        self.refused = claim
        return Ended(claim)

    def ended(self, result: Any) -> Ended:
        """How the attempt ended once its block committed (or found its claim taken over)."""
        return Ended(Claim.LOST) if self.lost else Ended(Claim.CLAIMED, result)


class Inbox:
    """Runs task bodies behind an inbox claim: claims in the store, units of work published by
    ``publisher``, eager claims held by ``node``, rows built by ``rows``, what an attempt leaves
    written by ``records``."""

    def __init__(self, runtime: Runtime, publisher: Publisher, node: Nodes, rows: InboxRows,
                 records: AttemptRecords):
        self.runtime = runtime
        self.publisher = publisher
        self.node = node
        self.rows = rows
        self.records = records

    def install(self) -> None:
        """Make this the inbox the app's tasks run through (``inbox_of``), and a worker's run of a
        message naming a tenant that tenant's from start to end (``enter_tenant_of_run``)."""
        setattr(self.runtime.app, _APP_ATTRIBUTE, self)
        signals.task_prerun.connect(enter_tenant_of_run, weak=False, dispatch_uid="celery_outbox.enter_tenant_of_run")
        signals.task_postrun.connect(leave_tenant_of_run, weak=False, dispatch_uid="celery_outbox.leave_tenant_of_run")

    def run_idempotent(self, task: Any, args: tuple, kwargs: dict, body: Callable[[], Any],
                       style: IdempotencyStyle) -> Any:
        """Run an ``IdempotentTask``'s ``body`` once per delivery, in ``style``, its writes and sends
        in the claim's unit of work (``self.session``, ``self.connection``)."""
        return self._run(task, args, kwargs, body, style, unit_of_work=True, queue=None)

    def run_durable_delivery(self, task: Any, args: tuple, kwargs: dict, body: Callable[[], Any],
                             queue: str) -> Any:
        """Run a plain task's ``body`` once per delivery from the durable ``queue``, behind an eager
        claim, as plain Celery runs it (no unit of work of the inbox's)."""
        return self._run(task, args, kwargs, body, IdempotencyStyle.EAGER, unit_of_work=False, queue=queue)

    def _run(self, task: Any, args: tuple, kwargs: dict, body: Callable[[], Any], style: IdempotencyStyle,
             unit_of_work: bool, queue: str | None) -> Any:
        """Run ``body`` once per delivery of ``task``'s current request (from ``queue``, when the caller
        resolved it already), in the delivery's consumer span (``tracing.delivery_context``)."""
        request = task.request
        if request.called_directly or request.is_eager or not request.id:
            return self._without_claim(body, unit_of_work)  # no message, nothing to deduplicate
        delivery = Delivery.from_request(task, self.runtime.settings, queue)
        with tracing.delivery_context(delivery, request), using_tenant(delivery.tenant):
            return self._run_delivery(task, delivery, args, kwargs, body, style, unit_of_work)

    def _run_delivery(self, task: Any, delivery: Delivery, args: tuple, kwargs: dict, body: Callable[[], Any],
                      style: IdempotencyStyle, unit_of_work: bool) -> Any:
        """Claim ``delivery``, run ``body`` in the style given, and turn how it ended into the answer
        the worker gives the broker."""
        durable = self.runtime.settings.is_durable(delivery.queue)
        envelope = envelope_of(task, args, kwargs) if durable else {}
        claimed = time.monotonic()
        try:
            self._ready_store()
            if style is IdempotencyStyle.EAGER:
                ended = self._run_eager(task, delivery, body, unit_of_work, envelope)
            else:
                ended = self._run_optimistic(task, delivery, body, envelope)
        except StoreDown as down:
            ended = Ended(Claim.STORE_DOWN, down.reason)
        if ended.claim is Claim.STORE_DOWN and delivery.tenant is not None and not self._store_answers():
            ended = self.records.park(task, delivery, ended.value)
        return self._answer(delivery, ended, time.monotonic() - claimed)

    def _store_answers(self) -> bool:
        """Whether the current store answers a new session now: after an outage, a tenant's store that
        does is having a blip (a session ended, a failover done), and the message goes back to the
        broker to be claimed in a moment; one that does not is down, and its message is parked."""
        try:
            self.runtime.store.ping()
            return True
        except Exception:  # noqa: BLE001 - any failure to answer is the store being down
            return False

    def _ready_store(self) -> None:
        """Make the delivery's store ready (``Runtime.ready``) before its claim: the default store
        was at the worker's start, a tenant's is at the first delivery this process claims for it
        (its tables created, with ``outbox_auto_create_schema``, or their schema checked). A store
        that cannot be made ready is ``StoreDown``: the message goes back to the broker until it is."""
        try:
            with store_errors():
                self.runtime.ready()
        except (ConfigurationError, IncompatibleSchema, StoreUnavailable) as exc:
            raise StoreDown(exc) from exc

    def _answer(self, delivery: Delivery, ended: Ended, seconds: float) -> Any:
        """The body's result, or what the worker tells the broker (Celery's ``Ignore``, ``Reject``)."""
        if ended.claim is Claim.CLAIMED:
            if message_handled.receivers:
                message_handled.send(sender=self.runtime.owner, message_id=delivery.message_id,
                                     task_name=delivery.task_name, queue=delivery.queue, attempt=delivery.attempt,
                                     seconds=seconds)
            return ended.value
        if ended.claim is Claim.DUPLICATE:
            outage = self.records.discard(delivery)
            if outage is not None:
                self._send_back(delivery, "record a duplicate of", outage)
            raise Ignore()
        if ended.claim is Claim.IN_FLIGHT:
            logger.info("celery-outbox: %s[%s] from %r is claimed by an attempt still running; the copy goes "
                        "back to the broker", delivery.task_name, delivery.message_id, delivery.queue,
                        **log_fields.of_delivery(delivery))
            time.sleep(REQUEUE_BACKOFF)
            raise Reject("claimed by an attempt still running", requeue=True)
        if ended.claim is Claim.LOST:
            logger.warning("celery-outbox: the claim of %s[%s] was taken over while its body ran (its node was "
                           "declared dead); its writes rolled back and the message goes back to the broker",
                           delivery.task_name, delivery.message_id, **log_fields.of_delivery(delivery))
            raise Reject("claim taken over", requeue=True)
        if ended.claim is Claim.PARKED:
            raise Parked(str(ended.value))
        assert ended.claim is Claim.STORE_DOWN, ended
        self._send_back(delivery, "claim", ended.value)

    def _send_back(self, delivery: Delivery, doing: str, reason: BaseException) -> NoReturn:
        """The store cannot be reached: the message goes back to the broker, to be claimed (or
        discarded and counted) when it comes again."""
        logger.warning(
            "celery-outbox: cannot %s %s[%s] from %r, the message store is unavailable; "
            "the message goes back to the broker: %s", doing, delivery.task_name, delivery.message_id,
            delivery.queue, reason, **log_fields.of_delivery(delivery),
        )
        time.sleep(REQUEUE_BACKOFF)
        raise Reject(str(reason), requeue=True)

    # -- the two styles ------------------------------------------------------------------------

    def _run_optimistic(self, task: Any, delivery: Delivery, body: Callable[[], Any],
                        envelope: dict[str, Any]) -> Ended:
        """The optimistic attempt; with an ``envelope`` (a durable queue), kept for recovery one of
        two ways. When the sender's tracked outgoing row holds the message, the envelope goes in
        with the claim and that row is acknowledged in the same statement, the first of the
        attempt's transaction: nothing commits before the body, and if the attempt dies, its
        rollback puts the sender's row back for delivery tracking to publish again
        (``outbox_redeliver_after``). A copy of an attempt the key's row has ended is found out
        by that first statement, and discarded (``AttemptRecords.discard``). Otherwise (``NOT_HELD``: a sender
        without the outbox or without tracking, a copy recovery published, an attempt after the
        first, one taking over the key's row) the envelope is committed first
        (``AttemptRecords.store_envelope``), for recovery to publish again after ``outbox_node_stale_after``.
        When the body hands that message back (``Reject(requeue=True)``), the envelope waits as a
        released eager claim's does (``AttemptRecords.put_off_recovery``)."""
        if envelope and self._may_be_held(delivery):
            ended = self._run_optimistic_attempt(task, delivery, body, envelope, stored=False)
            if ended.claim is not Claim.NOT_HELD:
                return ended  # else rolled back: nothing but the claim ran in its transaction
        if not envelope:
            return self._run_optimistic_attempt(task, delivery, body, {}, stored=False)
        claim = self.records.store_envelope(delivery, envelope, owner=UNOWNED)
        if claim is not Claim.CLAIMED:
            return Ended(claim)
        try:
            return self._run_optimistic_attempt(task, delivery, body, {}, stored=True)
        except Reject as reject:
            if reject.requeue:
                self.records.put_off_recovery(delivery)
            raise

    def _may_be_held(self, delivery: Delivery) -> bool:
        """The delivery's message may have a tracked outgoing row in this store, and the store can
        claim and acknowledge it in one statement (PostgreSQL). An attempt after the first (a
        retry, a replay, a ``replace``) meets the row of its key's earlier attempt: the held claim
        would roll back, so it takes the committed envelope's way at once."""
        return bool(delivery.sent_as) and not any(delivery.attempt) \
            and self.runtime.settings.redeliver_after is not None and self.runtime.store.is_postgres

    def _run_optimistic_attempt(self, task: Any, delivery: Delivery, body: Callable[[], Any],
                                envelope: dict[str, Any], stored: bool) -> Ended:
        """Claim as the first statement of the attempt's transaction (with the ``envelope`` held by
        the sender's row, ``NOT_HELD`` when it is not; or taking over the row of the envelope when
        the caller ``stored`` it), then the body."""
        store = self.runtime.store
        outcome: BaseException | None = None
        with self._attempt(task, delivery, unit_of_work=True) as attempt:
            uow = attempt.uow
            now = utcnow()
            with store_errors(), tracing.delivery_span(tracing.Step.CLAIM, delivery):
                row = self.rows.claim_row(delivery, IncomingStatus.HANDLED, UNOWNED, now)
                if envelope:
                    row.update(recoveries=delivery.redelivered, recover_after=None, **envelope)
                    held = store.claim_held_envelope(uow.connection, row, delivery.message_id,
                                                     self.rows.acknowledged_destination(delivery), delivery.attempt,
                                                     delivery.sent_as)
                    # 0: no tracked outgoing row of this attempt holds the message; None: the key has a
                    # row, of a copy (refused here) or of an attempt this one takes over
                    if held == 0 or (held is None and self.rows.claim_in(uow.connection, row, now, stored=True)):
                        return attempt.refuse(Claim.NOT_HELD)
                    claimed = bool(held)
                else:
                    claimed = self.rows.claim_in(uow.connection, row, now, stored=stored)
            if not claimed:
                with store_errors():
                    return attempt.refuse(self.rows.not_claimed(uow.connection, delivery))
            crashpoint("after_claim")
            try:
                result = run_body(body, uow)
            except Ignore as ignore:  # the body stopped on purpose (replace does): keep its work
                outcome = ignore
        if outcome is not None:
            raise outcome
        return attempt.ended(result)

    def _run_eager(self, task: Any, delivery: Delivery, body: Callable[[], Any], unit_of_work: bool,
                   envelope: dict[str, Any]) -> Ended:
        with store_errors():  # registering this process's node in the store is a statement of ours
            node_id = self.node.id
        try:
            return self._run_eager_claimed(task, delivery, body, unit_of_work, envelope, node_id)
        except StoreDown:
            self.records.release_claim(delivery, node_id)
            raise
        except Reject as reject:
            if reject.requeue:
                self.records.release_claim(delivery, node_id)
            raise

    def _run_eager_claimed(self, task: Any, delivery: Delivery, body: Callable[[], Any], unit_of_work: bool,
                           envelope: dict[str, Any], node_id: int) -> Ended:
        store = self.runtime.store
        if envelope:  # a durable queue: the envelope is stored already claimed, in one transaction
            with tracing.delivery_span(tracing.Step.CLAIM, delivery):
                claim = self.records.store_envelope(delivery, envelope, owner=node_id)
            if claim is not Claim.CLAIMED:
                return Ended(claim)

        def finish(connection: Connection, commit: bool) -> bool:  # False: another node took the claim over
            finished = utcnow()
            return store.finish_incoming(connection, delivery.message_id, delivery.destination, node_id,
                                         delivery.attempt, finished, self.rows.keep_until(finished), commit=commit,
                                         send_id=delivery.send_id)

        outcome: BaseException | None = None
        with self._attempt(task, delivery, unit_of_work, last=finish) as attempt:
            uow = attempt.uow
            if not envelope:
                now = utcnow()
                # committed without waiting for the disk (the body's commit makes it durable), on the
                # attempt's connection: the body's transaction begins in the same round trip
                with store_errors(), tracing.delivery_span(tracing.Step.CLAIM, delivery):
                    row = self.rows.claim_row(delivery, IncomingStatus.RUNNING, node_id, now)
                    claimed = store.claim_incoming_alone(row, self.rows.stale_before(now),
                                                         uow.connection_before_begin,
                                                         self.runtime.settings.silent_before(now))
                if not claimed:
                    with store_errors(), store.begin(durable=False, on=uow.connection_before_begin) as conn:
                        claim = self.rows.not_claimed(conn, delivery)
                    return attempt.refuse(claim)
            crashpoint("after_claim")
            try:
                result = run_body(body, uow) if unit_of_work else body()
            except Ignore as ignore:
                outcome = ignore
        if outcome is not None:
            raise outcome
        return attempt.ended(result)

    @contextmanager
    def _attempt(self, task: Any, delivery: Delivery, unit_of_work: bool,
                 last: Callable[[Connection, bool], bool] | None = None) -> Iterator[_Attempt]:
        """The attempt's transaction: one pooled connection, committed when the block ends (durable
        messages inserted just before, then ``last``, the statement the COMMIT may go with;
        everything captured published just after) and rolled back on any exception, when the
        block refused the body (``_Attempt.refuse``), or, as ``LOST``, when ``last`` returns
        False. With ``unit_of_work``, the block's publishes are captured into it. When the attempt
        failed, how it ended is recorded after the rollback (``_ending``)."""
        with store_errors():
            uow = self._new_attempt(unit_of_work)
        attempt = _Attempt(uow)
        with self._ending(task, delivery, uow), uow.opened() if unit_of_work else nullcontext():
            try:
                yield attempt
                if attempt.refused is not None:
                    uow.rollback()
                    return
                with store_errors():
                    committed = uow.commit(last)
                if not committed:
                    attempt.lost = True
                    uow.rollback()
            except BaseException:
                uow.rollback()
                raise

    def _new_attempt(self, unit_of_work: bool) -> ConnectionUnitOfWork:
        """The attempt's unit of work: on the outbox's engine, or, for an ``IdempotentTask`` of an
        outbox that joins a framework's transactions (Django's), in that framework's transaction."""
        self.publisher.prepare_sender()
        joined = self.runtime.joined
        attempt = joined.attempt(self.publisher, self.runtime.settings) if unit_of_work and joined is not None \
            else None
        return attempt if attempt is not None else ConnectionUnitOfWork(self.publisher)

    @contextmanager
    def _ending(self, task: Any, delivery: Delivery, uow: ConnectionUnitOfWork) -> Iterator[None]:
        """Close the attempt (its connection back to the pool, then what it publishes or the
        retry that survives its rollback: ``ConnectionUnitOfWork.close``), then record how it
        ended when its transaction rolled back on an exception: an attempt holds one pooled
        connection at a time. An exception of the body that is a store outage, or that left the
        attempt's connection unusable, is an outage: the message goes back, nothing is recorded."""
        lost = False
        try:
            try:
                yield
            except Exception:
                lost = uow.connection_lost()  # judged before the close below closes it
                raise
            finally:
                uow.close()
        except StoreDown:
            raise
        except Reject as reject:
            if not reject.requeue:
                self.records.record(task, delivery, IncomingStatus.DEAD)
            raise
        except Retry:
            self.records.record(task, delivery, IncomingStatus.RETRIED)
            raise
        except Exception as exc:
            if is_outage(exc) or lost:
                raise StoreDown(exc) from exc
            self.records.record(task, delivery, IncomingStatus.DEAD, exc)
            raise

    def _without_claim(self, body: Callable[[], Any], unit_of_work: bool) -> Any:
        if not unit_of_work:
            return body()
        with transaction(self.publisher):  # joins a unit of work already open in this context
            uow = current_unit_of_work()
            assert uow is not None
            return run_body(body, uow)
