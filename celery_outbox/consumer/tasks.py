"""Task base classes: ``IdempotentTask``, and ``InboxTask``, the base ``Outbox(app)`` gives every task.

Transaction boundary: an ``IdempotentTask``'s body runs in its attempt's unit of work
(``self.session``, ``self.connection``): one transaction, committed when the body returns (with
the claim, in the optimistic style) and followed by the publish of what the body sent; rolled
back on an exception or a retry. An ``InboxTask`` consumed from a durable queue claims in the
eager style (the claim commits before the body); other tasks run as in plain Celery.
Guarantee: a redelivered copy of a handled attempt is discarded (acked, state ``IGNORED``), and a
killed worker's attempt comes back (``acks_late``, ``worker_request.OutboxRequest``). See
docs/inbox.md.
"""

from __future__ import annotations

from typing import Any, Callable

from celery import Celery, Task
from celery.worker.request import Request
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ..core.runtime import runtime_of
from ..core.setting_values import expected_member_of
from ..core.tenancy import TENANT_HEADER, using_tenant
from ..errors import OutboxError
from ..message.routing import queue_of
from ..producer.unit_of_work import current_connection, current_session
from ..vocabulary import IdempotencyStyle
from .celery_internals import swap_task_class, tracer_pushed_request
from .inbox import inbox_of, installed_inbox
from .worker_request import OutboxRequest

__all__ = ["IdempotentTask", "InboxTask", "give_inbox_to_every_task"]


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


class InboxTask(Task):
    """Plain Celery, except for deliveries from durable queues, which go through the inbox. The body
    runs on the request Celery's tracer pushed, as Celery runs a task without a ``__call__`` of
    its own (``body_of``)."""

    abstract = True
    Request = "celery_outbox.consumer.worker_request:OutboxRequest"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inbox = inbox_of(self.app)
        if inbox is None:
            return super().__call__(*args, **kwargs)
        request = self.request
        settings = inbox.runtime.settings
        queue = None if request.called_directly else queue_of(request.delivery_info, self.app, settings.durable_queues)
        body = body_of(self, InboxTask, args, kwargs)
        if not settings.is_durable(queue):
            with using_tenant(getattr(request, TENANT_HEADER, None) or None):  # what it sends is its tenant's
                return body()
        return inbox.run_durable_delivery(self, args, kwargs, body, queue)


class IdempotentTask(Task):
    """A task whose effects happen once per message, however often the broker delivers it."""

    abstract = True
    Request = "celery_outbox.consumer.worker_request:OutboxRequest"
    #: every delivery goes through the inbox, from any queue (other tasks: from durable queues)
    inbox_on_every_queue = True
    acks_late = True
    reject_on_worker_lost = True
    retry_on_worker_lost = True  # Celery >= 5.7: re-send as a new attempt when the process dies
    #: ``"optimistic"`` or ``"eager"`` (an ``IdempotencyStyle``); None takes ``outbox_idempotency_style``.
    idempotency: IdempotencyStyle | str | None = None

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
        style = self._idempotency_style(inbox.runtime.settings.idempotency_style)
        return inbox.run_idempotent(self, args, kwargs, body_of(self, IdempotentTask, args, kwargs), style)

    def _idempotency_style(self, default: IdempotencyStyle) -> IdempotencyStyle:
        """The task's ``idempotency``, or ``default`` when it is None; a value that is not a style
        raises ``OutboxError`` naming the task."""
        if self.idempotency is None:
            return default
        try:
            return IdempotencyStyle(self.idempotency)
        except ValueError:
            raise OutboxError(f"{self.name}.idempotency = {self.idempotency!r} is not valid: "
                              f"{expected_member_of(IdempotencyStyle)}") from None


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
