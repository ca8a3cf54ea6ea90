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
inbox tells the re-sent attempt from a duplicate.

``InboxTask`` is the base ``Outbox(app)`` installs as the app's task class: a task
consumed from a durable queue gets its envelope stored and its duplicates
rejected (eager style: the claim commits before the body) whether or not it is an
``IdempotentTask``. Other tasks run exactly as in plain Celery.
"""

from __future__ import annotations

from typing import Any, Callable

from celery import Task
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from .errors import OutboxError
from .inbox import current_connection, current_session
from .outbox import outbox_of
from .routing import queue_of

__all__ = ["IdempotentTask", "InboxTask"]

_STYLES = ("optimistic", "eager")


def body_of(task: Task, cls: type, args: tuple, kwargs: dict) -> Callable[[], Any]:
    """The call that runs ``task``'s body behind the inbox: the next ``__call__`` after ``cls``'s.

    Celery's tracer (a worker, or ``apply``) pushes the task and its request before it calls a
    task with a ``__call__`` of its own. When the next ``__call__`` is Celery's ``Task.__call__``,
    which would push both again (a copy of the request, built anew), the body runs directly, as
    Celery runs a task without a ``__call__`` of its own. Called directly (no request pushed),
    and with a ``__call__`` of another class in between, the next one runs as usual."""
    call = super(cls, task).__call__
    if not task.request.called_directly and getattr(call, "__func__", None) is Task.__call__:
        run = task.run
        return lambda: run(*args, **kwargs)
    return lambda: call(*args, **kwargs)


class InboxTask(Task):
    """Plain Celery, except for deliveries from durable queues, which go through the inbox."""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outbox = getattr(self.app, "_celery_outbox", None)
        if outbox is None:
            return super().__call__(*args, **kwargs)
        request = self.request
        queue = queue_of(request.delivery_info, self.app)
        if request.called_directly or not outbox.settings.is_durable(queue):
            return super().__call__(*args, **kwargs)
        return outbox.inbox.run(self, args, kwargs, body_of(self, InboxTask, args, kwargs), style="eager",
                                unit_of_work=False)


class IdempotentTask(Task):
    """A task whose effects happen once per message, however often the broker delivers it."""

    abstract = True
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
        return outbox_of(self.app)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outbox = outbox_of(self.app)
        style = self.idempotency or outbox.settings.idempotency_style
        if style not in _STYLES:
            raise OutboxError(f"{self.name}.idempotency = {style!r} is not valid: expected one of {_STYLES}")
        return outbox.inbox.run(self, args, kwargs, body_of(self, IdempotentTask, args, kwargs), style=style,
                                unit_of_work=True)
