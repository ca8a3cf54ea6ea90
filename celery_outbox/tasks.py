"""Task base classes: ``IdempotentTask``, and the base ``Outbox(app)`` gives every task.

``IdempotentTask`` (``@app.task(base=IdempotentTask, bind=True)``): each delivery
is claimed in the inbox before the body runs, and a redelivered duplicate is
discarded (acked, state IGNORED, never a failure). Inside the body
``self.session`` is the SQLAlchemy Session of the task's unit of work (made on first
use) and ``self.connection`` its Core Connection: one transaction, committed when the
body returns, together with the claim (optimistic style) and followed by the publish
of what the body sent; rolled back on an exception or a retry.

``acks_late`` is on, and a task whose worker process is killed is sent again
(``retry_on_worker_lost`` on Celery 5.7+, ``reject_on_worker_lost`` before): the
inbox tells the re-sent attempt from a duplicate. When Celery hands the lost attempt
back to the broker as it is (``reject_on_worker_lost``), the worker's main process
first releases the eager claim the dead process held, so that the copy runs at once.

Celery re-sends a lost attempt only while its retries are below ``max_retries``; past
that cap it acks the message as failed. ``OutboxRequest`` (the worker's request
class of both bases) first ends such an attempt as a dead letter (reason
``worker_lost``), or, when the store cannot take it, hands the message back to the
broker: never a silent ack. When a copy of the message was handled meanwhile, the copy's
outcome stands: no dead letter, no FAILURE over the copy's result. An attempt Celery fails at
its hard time limit (the pool kills its process) ends as a dead letter too (reason ``failed``),
so that neither recovery nor delivery tracking runs it again.

``InboxTask`` is the base ``Outbox(app)`` installs as the app's task class: a task
consumed from a durable queue gets its envelope stored and its duplicates
rejected (eager style: the claim commits before the body) whether or not it is an
``IdempotentTask``. Other tasks run exactly as in plain Celery.
"""

from __future__ import annotations

import logging
import threading
from enum import Enum
from typing import Any, Callable, ContextManager

from billiard.einfo import ExceptionInfo
from celery import Celery, Task
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from celery.worker.request import Request
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from . import log_fields
from .celery_hooks import (
    RESENDS_LOST_ATTEMPTS,
    HookedRequest,
    request_context,
    swap_task_class,
    tracer_pushed_request,
    unwrap_exception,
)
from .delivery import Delivery, dead_letter_row
from .errors import OutboxError
from .inbox import TERMINATED_LOCK_WAIT, Inbox, InFlight, inbox_of
from .node import this_host
from .publish_hook import resending
from .routing import queue_of
from .runtime import runtime_of
from .store import utcnow
from .unit_of_work import current_connection, current_session
from .vocabulary import BUSY_ROW_WAIT, DeadLetterReason

__all__ = ["IdempotentTask", "InboxTask", "OutboxRequest", "give_inbox_to_every_task"]

logger = logging.getLogger("celery_outbox.tasks")

_STYLES = ("optimistic", "eager")


def installed_inbox(app: Celery) -> Inbox:
    """The inbox of the outbox installed on ``app``; a clear error when there is none."""
    inbox = inbox_of(app)
    if inbox is None:
        raise OutboxError(f"no Outbox is installed on app {app.main!r}: call Outbox(app) in your Celery module")
    return inbox


def body_of(task: Task, cls: type, args: tuple, kwargs: dict) -> Callable[[], Any]:
    """The call that runs ``task``'s body behind the inbox: the next ``__call__`` after ``cls``'s.

    Celery's tracer (a worker, or ``apply``) pushes the task and its request before it calls a
    task with a ``__call__`` of its own. When the next ``__call__`` is Celery's ``Task.__call__``,
    which would push both again (a copy of the request, built anew; before Celery 5.5 from the
    arguments alone, with no id, so that a ``retry`` or ``replace`` in the body would not be
    known as the running task's), the body runs directly, as
    Celery runs a task without a ``__call__`` of its own. Called directly (no request pushed),
    and with a ``__call__`` of another class in between, the next one runs as usual."""
    call = super(cls, task).__call__
    if tracer_pushed_request(task, call):
        run = task.run
        return lambda: run(*args, **kwargs)
    return lambda: call(*args, **kwargs)


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

    def before_revoked_announced(self, reason: str, terminated: bool) -> None:
        """Celery marks the task REVOKED and acks its message. Before that, an inbox attempt that
        never ran (revoked before it started, or expired) or whose pool process Celery has just
        killed (``revoke(terminate=True)``) is recorded as ended and its outgoing rows
        acknowledged (``Inbox.end_revoked_attempt``), in one transaction: a later copy is a
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
        return isinstance(task, IdempotentTask) or settings.is_durable(
            queue_of(self.delivery_info, task.app, settings.durable_queues))

    def _end_revoked(self, reason: str, terminated: bool) -> None:
        task = self.task
        delivery = self._delivery()
        try:
            installed_inbox(task.app).end_revoked_attempt(delivery, terminated)
        except InFlight:
            logger.warning("celery-outbox: %s[%s] %s while an attempt of it runs (its transaction holds the "
                           "message's rows): discarded here unrecorded; the running attempt records its own outcome",
                           task.name, self.id, reason, **log_fields.of_delivery(delivery))
            return
        except Exception as error:  # noqa: BLE001 - Celery's revoke stands; delivery tracking may send it again
            logger.error("celery-outbox: cannot record that %s[%s] was %s: %s; it is discarded here, as in "
                         "plain Celery, but a durable message stays unacknowledged and is published again "
                         "after outbox_redeliver_after (a worker that remembers the revoke discards it then)",
                         task.name, self.id, reason, error, **log_fields.of_delivery(delivery))
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
        result backend and no errback runs."""
        exc = exc_info.exception
        exc = unwrap_exception(exc)
        self._process_lost = isinstance(exc, WorkerLostError)
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
        and go back to the broker until recovery declared the process dead. When the store
        cannot take the release, that is logged and the copy waits for recovery."""
        if requeue and self._process_lost and not self.acknowledged and self.worker_pid is not None \
                and self._goes_through_inbox():
            self._release_lost_claim()
        super().reject(requeue=requeue)

    def _release_lost_claim(self) -> None:
        task = self.task
        delivery = self._delivery()
        try:
            released = installed_inbox(task.app).release_lost_process_claim(delivery, this_host(), self.worker_pid)
        except Exception as error:  # noqa: BLE001 - recovery releases it once it declares the process dead
            logger.warning("celery-outbox: could not release the claim of %s[%s], whose pool process %d died; "
                           "its copy goes back to the broker until recovery declares that process dead: %s",
                           task.name, self.id, self.worker_pid, error, **log_fields.of_delivery(delivery))
            return
        if released:
            logger.info("celery-outbox: %s[%s] lost its pool process %d; its claim is released for the copy "
                        "Celery hands back to the broker", task.name, self.id, self.worker_pid,
                        **log_fields.of_delivery(delivery))

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
        broker instead (``acks_late`` with ``acks_on_timeout`` off) or the worker is in a cold
        shutdown, an inbox attempt then ends as ``dead`` with a dead letter (reason ``failed``),
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
        """Whether Celery's ``on_timeout`` fails the task for good: it acks the message (or an early
        ack took it already) and marks ``FAILURE``."""
        task = self.task
        if worker_state.should_terminate:
            return False  # a cold shutdown: Celery marks no failure
        if not task.acks_late:
            return True
        acks = getattr(task, "acks_on_timeout", None)  # Celery 5.7; before it acks_on_failure_or_timeout alone
        return bool(task.acks_on_failure_or_timeout if acks is None else acks)

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
        """``Inbox.end_killed_attempt`` with the dead letter of ``exc``, built on this request's
        context (pushed for the calling thread)."""
        task, context = self.task, request_context(self)
        task.request_stack.push(context)
        try:
            dead_letter = dead_letter_row(task, delivery, reason, exc, utcnow())
            return installed_inbox(task.app).end_killed_attempt(delivery, dead_letter, lock_wait)
        finally:
            task.request_stack.pop()

    def _delivery(self) -> Delivery:
        """The delivery this request names."""
        task = self.task
        return Delivery.from_context(task, request_context(self), installed_inbox(task.app).runtime.settings)


class InboxTask(Task):
    """Plain Celery, except for deliveries from durable queues, which go through the inbox. The body
    runs on the request Celery's tracer pushed, as Celery runs a task without a ``__call__`` of
    its own (``body_of``)."""

    abstract = True
    Request = "celery_outbox.tasks:OutboxRequest"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inbox = inbox_of(self.app)
        if inbox is None:
            return super().__call__(*args, **kwargs)
        request = self.request
        settings = inbox.runtime.settings
        queue = None if request.called_directly else queue_of(request.delivery_info, self.app, settings.durable_queues)
        body = body_of(self, InboxTask, args, kwargs)
        if not settings.is_durable(queue):
            return body()
        return inbox.run(self, args, kwargs, body, style="eager", unit_of_work=False, queue=queue)


class IdempotentTask(Task):
    """A task whose effects happen once per message, however often the broker delivers it."""

    abstract = True
    Request = "celery_outbox.tasks:OutboxRequest"
    acks_late = True
    reject_on_worker_lost = True
    retry_on_worker_lost = True  # Celery >= 5.7: re-send as a new attempt when the process dies
    #: ``"optimistic"`` or ``"eager"``; None takes ``outbox_idempotency_style``.
    idempotency: str | None = None

    @property
    def session(self) -> Session:
        """The SQLAlchemy Session of the running unit of work (only inside the body)."""
        session = current_session()
        if session is None:
            raise OutboxError(f"{self.name}: self.session exists only while the task body runs")
        return session

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy Connection of the running unit of work, for Core statements (only
        inside the body). The same transaction as ``self.session``: it commits with the claim
        and rolls back with it."""
        connection = current_connection()
        if connection is None:
            raise OutboxError(f"{self.name}: self.connection exists only while the task body runs")
        return connection

    @property
    def outbox(self) -> Any:
        """The ``Outbox`` installed on the task's app."""
        installed_inbox(self.app)
        runtime = runtime_of(self.app)
        assert runtime is not None
        return runtime.owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inbox = installed_inbox(self.app)
        style = self.idempotency or inbox.runtime.settings.idempotency_style
        if style not in _STYLES:
            raise OutboxError(f"{self.name}.idempotency = {style!r} is not valid: expected one of {_STYLES}")
        return inbox.run(self, args, kwargs, body_of(self, IdempotentTask, args, kwargs), style=style,
                         unit_of_work=True)


def give_inbox_to_every_task(app: Celery) -> list[str]:
    """Run in the worker's main process at start-up (``worker_init``), before the pool forks or
    the tracers are built: a registered task whose class does not derive from ``InboxTask`` or
    ``IdempotentTask`` (``@app.task(base=celery.Task)``, a base of its own deriving from
    ``celery.Task``) gets the ``InboxTask`` behaviour, and every task a request class that
    derives from ``OutboxRequest``, so that such a task consumed from a durable queue goes
    through the inbox too: it acknowledges its outgoing row and its duplicates are discarded.

    The task object stays the same (its class is swapped for a subclass of its own, shared by
    the tasks of that class), so references to it in the user's modules keep working; a
    ``Request`` class of the user's is kept, combined with ``OutboxRequest``. Celery's own
    tasks (``celery.*``) are left as they are. Returns the names of the tasks changed."""
    changed = []
    classes: dict[type, type] = {}
    for name, task in list(app.tasks.items()):
        if name.startswith("celery."):
            continue
        cls = type(task)
        if cls not in classes:
            classes[cls] = _with_inbox(cls)
        if classes[cls] is not cls:
            swap_task_class(task, classes[cls])
            changed.append(name)
    return changed


def _with_inbox(cls: type) -> type:
    """``cls``, or a subclass of it with the ``InboxTask`` behaviour and an ``OutboxRequest``."""
    from celery.utils.imports import symbol_by_name

    user_request = symbol_by_name(cls.Request) if isinstance(cls.Request, str) else cls.Request
    has_inbox = issubclass(cls, (InboxTask, IdempotentTask))
    has_request = issubclass(user_request, OutboxRequest)
    if has_inbox and has_request:
        return cls
    request = user_request if has_request else (
        OutboxRequest if user_request is Request
        else type(user_request.__name__, (OutboxRequest, user_request), {"__module__": user_request.__module__}))
    bases = (cls,) if has_inbox else (InboxTask, cls)
    return type(cls.__name__, bases, {"Request": request, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
