"""Every place the consumer side relies on a private part of Celery, kombu or billiard; nowhere else.

No transaction. Each function, class or constant (the app's task base, the worker's request,
consumer and pool) says which internal, why, and for which versions it holds, and
``tests/unit/consumer/test_celery_internals.py`` pins that behaviour by name.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

from billiard.einfo import ExceptionWithTraceback
from celery.app.task import Task
from celery.worker.request import Request
from kombu.transport import virtual

__all__ = ["HANDS_BACK_AT_TIME_LIMIT", "HookedRequest", "RESENDS_LOST_ATTEMPTS", "TASKS_STEP", "app_task_base_used",
    "build_channel_messages_with", "call_later", "consumer_event_dispatcher", "pool_module", "request_context",
    "set_app_task_base", "swap_task_class", "task_consumer_channel", "task_strategies", "tracer_pushed_request",
    "unwrap_exception", "worker_concurrency", "wrap_task_handler"]


def app_task_base_used(app: Any) -> bool:
    """Whether ``app.Task`` (the task base built from ``app.task_cls``) was already built.

    Touches ``Celery.Task``, a cached property (Celery 4 to 5.7) whose value lives in
    ``app.__dict__``."""
    return "Task" in app.__dict__


def set_app_task_base(app: Any, cls: type) -> None:
    """Make ``cls`` the app's task base: tasks defined from now on derive from it.

    Touches ``Celery.task_cls`` and the cached property ``Celery.Task`` (Celery 4 to 5.7): a
    ``Task`` already built from the old ``task_cls`` is dropped from ``app.__dict__`` so that the
    next ``app.Task`` (and ``@app.task``) is built from ``cls``."""
    app.__dict__.pop("Task", None)
    app.task_cls = cls


def tracer_pushed_request(task: Any, next_call: Callable[..., Any]) -> bool:
    """Whether ``next_call`` (the next ``__call__`` of ``task``'s classes) is Celery's own
    ``Task.__call__`` while Celery's tracer runs the task, so that the body can run directly.

    Relies on ``celery.app.trace.build_tracer`` (Celery 4 to 5.7, a worker and ``Task.apply``):
    a task with a ``__call__`` of its own is called as ``task(*args, **kwargs)`` after the tracer
    pushed the task and its request (``request.called_directly`` is False); a task without one
    is run through ``task.run``. ``Task.__call__`` pushes the task and a new request again."""
    from celery import Task

    return not task.request.called_directly and getattr(next_call, "__func__", None) is Task.__call__


def swap_task_class(task: Any, cls: type) -> None:
    """Give a registered task object the class ``cls`` (a subclass of its own class) in place.

    Relies on Celery (4 to 5.7) reading a task's ``Request`` class and ``__call__`` only when the
    worker builds its strategies (``Consumer.update_strategies``, ``Task.start_strategy``, which
    resolves ``task.Request``) and tracers, after ``worker_init``; and on ``app.tasks`` holding the
    task objects themselves, which the user's modules refer to, so the object must stay the same."""
    task.__class__ = cls


class HookedRequest(Request):
    """The worker's request class with two hooks into its private steps.

    Touches ``Request._announce_revoked(reason, terminated, signum, expired)`` (Celery 5 up to
    5.7), which ``Request.revoked()`` (a revoked or expired message, before it runs) and
    ``Request.terminate`` call to mark the task REVOKED and ack its message, and
    ``Request._retry_worker_lost(exc, exc_info)`` (Celery 5.7, ``retry_on_worker_lost``), which
    ``on_failure`` calls for a ``WorkerLostError`` to re-send the task as its next retry through
    ``task.signature_from_request(request._context, ...).apply_async()``."""

    def before_revoked_announced(self, reason: str, terminated: bool) -> None:
        """Runs before Celery marks the task REVOKED and acks its message."""

    def resending_lost_attempt(self) -> ContextManager[Any]:
        """Entered while Celery re-sends the attempt of a lost worker process."""

        return nullcontext()

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> None:
        self.before_revoked_announced(reason, terminated)
        super()._announce_revoked(reason, terminated, signum, expired)

    def _retry_worker_lost(self, exc: BaseException, exc_info: Any) -> bool:
        with self.resending_lost_attempt():
            return super()._retry_worker_lost(exc, exc_info)


#: Celery re-sends the attempt of a lost pool process as its next retry, up to ``max_retries``
#: (``retry_on_worker_lost``, ``Request._retry_worker_lost``: Celery 5.7); before 5.7 it hands every
#: lost attempt of an ``acks_late`` task with ``reject_on_worker_lost`` back to the broker as it is.
RESENDS_LOST_ATTEMPTS = hasattr(Request, "_retry_worker_lost")


#: At an ``acks_late`` task's hard time limit Celery acks the message when the task's
#: ``acks_on_timeout`` is on and hands it back to the broker when it is off (Celery 5.7); before 5.7
#: ``acks_on_failure_or_timeout`` alone decides, and a message it does not ack is dropped (rejected,
#: not requeued): the task fails for good either way.
HANDS_BACK_AT_TIME_LIMIT = hasattr(Task, "acks_on_timeout")


def request_context(request: Any) -> Any:
    """The task ``Context`` a worker's ``Request`` runs with, as the task sees it in ``task.request``.

    Touches ``Request._context`` (Celery 4 to 5.7, a cached property): the same ``Context``
    Celery passes to the backend, the signals and ``signature_from_request``."""
    return request._context


def unwrap_exception(exc: BaseException) -> BaseException:
    """The exception a pool process raised, as the worker's main process sees it.

    Touches billiard's ``ExceptionWithTraceback`` (billiard 4): the prefork pool sends an
    exception back wrapped in it, and ``Request.on_failure`` receives it as
    ``exc_info.exception``; the original is its ``exc``."""
    return getattr(exc, "exc", exc) if isinstance(exc, ExceptionWithTraceback) else exc


def pool_module(worker: Any) -> str:
    """The module of the worker's pool class, without importing it.

    Touches ``WorkController.pool_cls`` (a class, an alias such as ``"threads"`` or a
    ``"module:Class"`` string, as set before the pool is built, at ``worker_init``) and
    ``celery.concurrency.ALIASES`` (Celery 5)."""
    from celery import concurrency

    pool = worker.pool_cls
    if isinstance(pool, str):  # an alias or "module:Class": read, not imported
        return concurrency.ALIASES.get(pool, pool).split(":", 1)[0]
    return getattr(pool, "__module__", "")


def worker_concurrency(worker: Any) -> int:
    """How many tasks the worker runs at once: ``WorkController.concurrency`` (Celery 5; 0 or
    None at ``worker_init`` means the CPU count, as Celery decides later)."""
    count = worker.concurrency
    if not isinstance(count, int) or count <= 0:
        count = os.cpu_count() or 1
    return count


#: The consumer step that makes the task consumer (Celery 4 to 5.7); the guard's step requires it.
TASKS_STEP = "celery.worker.consumer.tasks:Tasks"


def wrap_task_handler(consumer: Any, wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> None:
    """Make the consumer's task message handler ``wrap(handler)``.

    Touches ``Consumer.create_task_handler`` (Celery 4 to 5.7): the Tasks step calls it on the
    consumer when it builds the task consumer, and its result is the ``on_message`` callback
    that receives every task message. Replaced on the consumer object, before that step starts."""
    create = consumer.create_task_handler

    def create_task_handler(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return wrap(create(*args, **kwargs))

    consumer.create_task_handler = create_task_handler


def task_consumer_channel(consumer: Any) -> Any:
    """The channel of the consumer's task consumer, or None before the Tasks step made it.

    Touches ``Consumer.task_consumer`` (Celery 4 to 5.7, set by the Tasks step at each
    (re)connection)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    return task_consumer.channel if task_consumer is not None else None


def task_strategies(consumer: Any) -> Any:
    """The consumer's registered task names, as the mapping from a name to its strategy.

    Touches ``Consumer.strategies`` (Celery 4 to 5.7): the handler made by
    ``create_task_handler`` looks a message's task up there, and a name missing there is an
    unknown task (``on_unknown_task``)."""
    return consumer.strategies


def call_later(consumer: Any, seconds: float, fun: Callable[..., Any], args: tuple) -> None:
    """Call ``fun(*args)`` after ``seconds`` in the consumer's thread.

    Touches ``Consumer.timer`` (Celery 4 to 5.7): the event loop's own timer (the hub's, on
    py-amqp and Redis) whose ``call_after`` schedules without blocking the consumer."""
    consumer.timer.call_after(seconds, fun, args)


def consumer_event_dispatcher(consumer: Any) -> Any:
    """The consumer's event dispatcher, or None: ``Consumer.event_dispatcher`` (Celery 4 to 5.7,
    set by the Events step; a disabled dispatcher when events are off)."""
    return getattr(consumer, "event_dispatcher", None)


def build_channel_messages_with(channel: Any, mixin: type) -> None:
    """Make a kombu virtual-transport ``channel`` build its messages from a class with ``mixin``
    first in its bases (once per channel); channels of other transports are left as they are.

    Touches ``kombu.transport.virtual.Channel.Message`` (kombu 5): a virtual channel (Redis, SQS,
    memory...) builds each delivered message with ``self.Message(payload, channel=self)`` in
    ``_restore``, ``basic_get`` and ``_deliver``, so an instance attribute replaces the class for
    that channel only. ``mixin.__init__(payload, channel=None, **kwargs)`` must call the
    transport's ``Message.__init__`` with that signature."""
    if isinstance(channel, virtual.Channel) and not issubclass(channel.Message, mixin):
        channel.Message = type(f"Tolerant{channel.Message.__name__}", (mixin, channel.Message), {})
