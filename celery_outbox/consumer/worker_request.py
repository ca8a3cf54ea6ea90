"""The worker's request class (``OutboxRequest``): attempts that end outside their pool process.

Transaction boundary: in the worker's main process, each record is one transaction of its own
(``main_process``): a revoked, expired or terminated attempt ends as ``revoked`` and one lost past
Celery's re-send cap as a ``worker_lost`` dead letter, both before Celery acks the message; one
failed at its hard time limit ends as a ``failed`` dead letter; a lost attempt Celery hands back
has its eager claim released. Guarantee: an attempt recorded here is neither run again by
recovery nor published again by delivery tracking, and a lost one whose dead letter the store
cannot take goes back to the broker, never acked unrecorded. The cases: docs/inbox.md.
"""

from __future__ import annotations

import logging
import threading
from enum import Enum
from typing import Any, ContextManager

from billiard.einfo import ExceptionInfo
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from kombu.asynchronous import get_event_loop

from ..core import log_fields
from ..core.node import this_host
from ..message.routing import queue_of
from ..producer.publish_hook import resending
from ..store import utcnow
from ..vocabulary import BUSY_ROW_WAIT, DeadLetterReason
from .celery_internals import (
    HANDS_BACK_AT_TIME_LIMIT,
    RESENDS_LOST_ATTEMPTS,
    HookedRequest,
    request_context,
    unwrap_exception,
)
from .delivery import Delivery, dead_letter_row
from .inbox import inbox_of, installed_inbox
from .main_process import TERMINATED_LOCK_WAIT, RevokeRecord, installed_main_process
from .outages import Parked

__all__ = ["OutboxRequest"]

logger = logging.getLogger("celery_outbox.worker_request")


class LostAttemptEnd(Enum):
    """How the worker's main process ended an attempt whose pool process was lost past the cap."""

    #: the dead letter committed: the task fails as in plain Celery
    DEAD_LETTERED = "dead_lettered"
    #: a copy was handled meanwhile, or a later attempt holds the key: that attempt's outcome is the message's
    ANOTHER_ATTEMPTS_OUTCOME = "another_attempts_outcome"
    #: the store could not take it: the message goes back to the broker
    NOT_RECORDED = "not_recorded"


class OutboxRequest(HookedRequest):
    """The worker's request (in the worker's main process): a pool process lost running an
    inbox attempt past Celery's re-send cap ends as a dead letter before Celery acks it; one lost
    that Celery hands back to the broker has its eager claim released first; one Celery fails at
    its hard time limit ends as a dead letter; an inbox attempt the worker discards unrun
    (revoked, expired) or terminates (``revoke(terminate=True)``) ends as ``revoked`` before
    Celery acks it."""

    #: the pool process running this request died (``WorkerLostError``)
    _process_lost = False
    #: the request passed its hard time limit: the pool reports it (``on_failure``, then
    #: ``on_timeout``) and kills the process once both return
    _past_hard_time_limit = False

    def before_revoked_announced(self, reason: str, terminated: bool) -> None:
        """Celery marks the task REVOKED and acks its message. Before that, an inbox attempt that
        never ran (revoked before it started, or expired) or whose pool process Celery has just
        killed (``revoke(terminate=True)``) is recorded as ended and its outgoing rows
        acknowledged (``MainProcessOutcomes.end_revoked_attempt``), in one transaction: a later copy is a
        duplicate, and neither delivery tracking nor recovery publishes the message again. When
        the store cannot take it, or an attempt of the message running elsewhere holds its rows
        (that attempt records its own outcome), that is logged and the revoke stands in this
        worker, as in plain Celery."""
        if self._goes_through_inbox():
            self._end_revoked(reason, terminated)

    def _goes_through_inbox(self) -> bool:
        task = self.task
        inbox = inbox_of(task.app)
        if inbox is None:
            return False
        settings = inbox.runtime.settings
        return getattr(task, "inbox_on_every_queue", False) or settings.is_durable(
            queue_of(self.delivery_info, task.app, settings.durable_queues))

    def _end_revoked(self, reason: str, terminated: bool) -> None:
        task = self.task
        delivery = self._delivery()
        try:
            record = installed_main_process(task.app).end_revoked_attempt(delivery, terminated)
        except Exception as error:  # noqa: BLE001 - Celery's revoke stands; delivery tracking may send it again
            logger.error("celery-outbox: cannot record that %s[%s] was %s: %s; it is discarded here, as in "
                         "plain Celery, but a durable message stays unacknowledged and is published again "
                         "after outbox_redeliver_after (a worker that remembers the revoke discards it then)",
                         task.name, self.id, reason, error, **log_fields.of_delivery(delivery))
            return
        if record is RevokeRecord.IN_FLIGHT:
            logger.warning("celery-outbox: %s[%s] %s while an attempt of it runs (its transaction holds the "
                           "message's rows): discarded here unrecorded; the running attempt records its own outcome",
                           task.name, self.id, reason, **log_fields.of_delivery(delivery))
            return
        logger.info("celery-outbox: %s[%s] %s: its attempt ended %s, not to be redelivered", task.name,
                    self.id, reason, "in its killed pool process" if terminated else "unrun",
                    **log_fields.of_delivery(delivery))

    def on_failure(self, exc_info: ExceptionInfo, send_failed_event: bool = True, return_ok: bool = False) -> None:
        """An attempt lost past the cap ends as a dead letter, then fails as in plain Celery
        (FAILURE(WorkerLostError), errbacks, the ``task-failed`` event). When the store cannot take
        the dead letter the message goes back to the broker. When a copy of the message was
        handled meanwhile (or a later attempt holds its key), that attempt's outcome is the
        message's: the delivery is acked with no failure, so the copy's SUCCESS stays in the
        result backend and no errback runs. An attempt that parked its message (``Parked``: its
        tenant's store is down) marks that tenant down for the consumer, then is acked as Celery
        acks an ``Ignore``."""
        exc = exc_info.exception
        exc = unwrap_exception(exc)
        if isinstance(exc, Parked):  # its tenant's store is down: park its next messages from the consumer
            tenant = self._delivery().tenant
            if tenant is not None:
                installed_main_process(self.task.app).outages.down(tenant)
        self._process_lost = isinstance(exc, WorkerLostError)
        self._past_hard_time_limit = isinstance(exc, TimeLimitExceeded) and not return_ok
        if self._lost_past_the_cap(exc):
            ended = self._end_lost_attempt(exc)
            if ended is LostAttemptEnd.NOT_RECORDED:
                self.reject(requeue=True)
                return
            if ended is LostAttemptEnd.ANOTHER_ATTEMPTS_OUTCOME:
                self.acknowledge()
                return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def reject(self, requeue: bool = False) -> None:
        """Celery hands the message back to the broker (``requeue``) or drops it. When it hands back
        the attempt of a pool process it saw die (``reject_on_worker_lost``: every lost attempt
        before Celery 5.7, and on 5.7 one of a task without ``retry_on_worker_lost`` or whose
        re-send failed), the eager claim that process held is released first, in a transaction of
        its own: the copy takes it over at once. Without that the copy would meet a running claim
        and go back to the broker until recovery declared the process dead. When it hands back an
        attempt at its hard time limit (``acks_late`` with ``acks_on_timeout`` off), the process
        still runs: the release waits for the worker's event loop to come round, after the pool
        has killed the process, so that the body never overlaps its copy. When the store cannot
        take the release, that is logged and the copy waits for recovery."""
        if requeue and not self.acknowledged and self.worker_pid is not None and self._goes_through_inbox():
            if self._process_lost:
                self._release_lost_claim()
            elif self._past_hard_time_limit:
                self._release_claim_once_killed()
        super().reject(requeue=requeue)

    def _release_claim_once_killed(self) -> None:
        """Release the claim of the process the pool kills at the hard time limit, in a timer of the
        worker's event loop due at once: the pool's hard-time-limit timer reports the job
        (``on_failure``, where Celery hands the message back, then ``on_timeout``) and then kills the
        process (TERM, at most 0.1 s, KILL), and the loop fires the timer due next as soon as that
        one returns, before it reads another message. A worker with no event loop (a pool without
        one) leaves the claim to recovery."""
        hub = get_event_loop()
        if hub is None:
            logger.info("celery-outbox: %s[%s] is handed back at its hard time limit; with no event loop to "
                        "release its claim after the kill, its copy waits for recovery", self.task.name, self.id,
                        **log_fields.of_delivery(self._delivery()))
            return
        hub.call_later(0, self._release_lost_claim)

    def _release_lost_claim(self) -> None:
        task = self.task
        delivery = self._delivery()
        try:
            outcomes = installed_main_process(task.app)
            released = outcomes.release_lost_process_claim(delivery, this_host(), self.worker_pid)
        except Exception as error:  # noqa: BLE001 - recovery releases it once it declares the process dead
            logger.warning("celery-outbox: could not release the claim of %s[%s], whose pool process %d ended; "
                           "its copy goes back to the broker until recovery declares that process dead: %s",
                           task.name, self.id, self.worker_pid, error, **log_fields.of_delivery(delivery))
            return
        if released:
            ended = "lost its pool process" if self._process_lost else \
                "passed its hard time limit; the pool killed its process"
            logger.info("celery-outbox: %s[%s] %s %d; its claim is released for the copy Celery hands back to "
                        "the broker", task.name, self.id, ended, self.worker_pid, **log_fields.of_delivery(delivery))

    def resending_lost_attempt(self) -> ContextManager[Any]:
        """Celery re-sends the attempt of a lost worker process as its next retry: the message keeps
        the publish identity of this delivery, so the inbox takes it for the same message."""
        return resending(request_context(self))

    def _lost_past_the_cap(self, exc: BaseException) -> bool:
        task = self.task
        if not (RESENDS_LOST_ATTEMPTS and isinstance(exc, WorkerLostError) and task.acks_late
                and task.retry_on_worker_lost):
            return False
        if not self._goes_through_inbox():
            return False
        return task.max_retries is not None and (request_context(self).retries or 0) >= task.max_retries

    def _end_lost_attempt(self, exc: BaseException) -> LostAttemptEnd:
        """Write the dead letter, in one transaction with the attempt's end (none when another
        attempt of the message was handled meanwhile); how it ended, logged."""
        task, context = self.task, request_context(self)
        delivery = self._delivery()
        try:
            stored = self._dead_letter_killed_attempt(delivery, DeadLetterReason.WORKER_LOST, exc, BUSY_ROW_WAIT)
        except Exception as error:  # noqa: BLE001 - without a dead letter the message must not be acked
            logger.error("celery-outbox: cannot dead-letter %s[%s], lost with its worker process %d times; the "
                         "message goes back to the broker: %s", task.name, self.id, (context.retries or 0) + 1, error,
                         **log_fields.of_delivery(delivery))
            return LostAttemptEnd.NOT_RECORDED
        if not stored:
            logger.warning("celery-outbox: %s[%s] lost its worker process %d times (max_retries %s); another "
                           "attempt of it was handled meanwhile or holds its key: no dead letter, acked with no "
                           "failure", task.name, self.id, (context.retries or 0) + 1, task.max_retries,
                           **log_fields.of_delivery(delivery))
            return LostAttemptEnd.ANOTHER_ATTEMPTS_OUTCOME
        logger.error("celery-outbox: %s[%s] lost its worker process %d times (max_retries %s); dead-lettered "
                     "(reason worker_lost)", task.name, self.id, (context.retries or 0) + 1, task.max_retries,
                     **log_fields.of_delivery(delivery))
        return LostAttemptEnd.DEAD_LETTERED

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """At the task's hard time limit Celery fails it for good (``FAILURE(TimeLimitExceeded)``,
        its errbacks) and the pool kills its process. Unless Celery hands the message back to the
        broker instead (``acks_late`` with ``acks_on_timeout`` off, Celery 5.7) or the worker is in
        a cold shutdown, an inbox attempt then ends as ``dead`` with a dead letter (reason ``failed``),
        as a failure does: without it recovery would publish a durable message's envelope again
        once the killed process was declared dead, and delivery tracking its sender's row, and
        the task would run again, time out again, and so on. The record runs in a thread of its
        own, so that the pool kills the process meanwhile: it takes over the claim the process
        left and waits for its open transaction to end (``TERMINATED_LOCK_WAIT``). When the store
        cannot take it, that is logged, and the message is run again as before."""
        if not soft and self._fails_for_good_at_time_limit() and self._goes_through_inbox():
            threading.Thread(target=self._end_timed_out, args=(timeout,), name="celery-outbox-time-limit",
                             daemon=True).start()
        super().on_timeout(soft, timeout)

    def _fails_for_good_at_time_limit(self) -> bool:
        """Whether Celery fails the task for good at its hard time limit: it acks the message or
        drops it (or an early ack took it already) and marks ``FAILURE``."""
        task = self.task
        if worker_state.should_terminate:
            return False  # a cold shutdown: Celery marks no failure
        if not task.acks_late or not HANDS_BACK_AT_TIME_LIMIT:
            return True  # before Celery 5.7 an acks_late task's message is acked, or dropped (rejected unrequeued)
        return bool(task.acks_on_failure_or_timeout if task.acks_on_timeout is None else task.acks_on_timeout)

    def _end_timed_out(self, timeout: float) -> None:
        task = self.task
        delivery = self._delivery()
        try:
            stored = self._dead_letter_killed_attempt(delivery, DeadLetterReason.FAILED, TimeLimitExceeded(timeout),
                                                      TERMINATED_LOCK_WAIT)
        except Exception as error:  # noqa: BLE001 - Celery's failure stands; the message may run again
            logger.error("celery-outbox: cannot record that %s[%s] failed at its hard time limit (%ss): %s; "
                         "a durable message is run again by recovery or delivery tracking", task.name, self.id,
                         timeout, error, **log_fields.of_delivery(delivery))
            return
        if stored:
            logger.error("celery-outbox: %s[%s] failed at its hard time limit (%ss); dead-lettered (reason "
                         "failed)", task.name, self.id, timeout, **log_fields.of_delivery(delivery))
        else:
            logger.warning("celery-outbox: %s[%s] reached its hard time limit (%ss) after it, or a copy of it, was "
                           "handled, or while a later attempt holds its key: no dead letter", task.name, self.id,
                           timeout, **log_fields.of_delivery(delivery))

    def _dead_letter_killed_attempt(self, delivery: Delivery, reason: DeadLetterReason, exc: BaseException,
                                    lock_wait: float) -> bool:
        """``MainProcessOutcomes.end_killed_attempt`` with the dead letter of ``exc``, built on this request's
        context (pushed for the calling thread)."""
        task, context = self.task, request_context(self)
        task.request_stack.push(context)
        try:
            dead_letter = dead_letter_row(task, delivery, reason, exc, utcnow())
            return installed_main_process(task.app).end_killed_attempt(delivery, dead_letter, lock_wait)
        finally:
            task.request_stack.pop()

    def _delivery(self) -> Delivery:
        """The delivery this request names."""
        task = self.task
        return Delivery.from_context(task, request_context(self), installed_inbox(task.app).runtime.settings)
