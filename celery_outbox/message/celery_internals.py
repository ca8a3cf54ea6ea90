"""Every place a message's capture or its caller's result relies on a private part of Celery.

No transaction. Nowhere else touches those parts: each function or constant says which internal,
why, and for which versions it holds, and ``tests/unit/message/test_celery_internals.py`` pins
that behaviour by name.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

from celery import VERSION as CELERY_VERSION

__all__ = ["STORE_ERRORS_READS_THE_MESSAGE", "without_callback_publish_retry"]


try:  # Celery >= 5.7 re-publishes worker callbacks with its own retry loop; we defer instead
    from celery.app.amqp import _callback_publish_retry
except ImportError:  # pragma: no cover - older Celery
    _callback_publish_retry = contextvars.ContextVar("_callback_publish_retry_unused", default=False)


@contextmanager
def without_callback_publish_retry() -> Iterator[None]:
    """While the block runs, Celery's sender publishes with a plain ``producer.publish`` call.

    Touches ``celery.app.amqp._callback_publish_retry`` (a ``ContextVar``, Celery >= 5.7; a
    stand-in before): ``AMQP._retry_publish`` sets it while a worker publishes a task's callbacks,
    and ``send_task_message`` then wraps ``producer.publish`` in ``retry_over_time``. The outbox
    captures the publish instead (``envelope.capture``): the recording producer must see the one
    ``publish`` call, not a retry loop around it."""
    token = _callback_publish_retry.set(False)
    try:
        yield
    finally:
        _callback_publish_retry.reset(token)


#: Celery's ``Request.store_errors`` (whether a FAILURE or REVOKED is stored) reads the message's
#: ``ignore_result`` header from Celery 5.6 (``Request._ignore_result``); before 5.6 the task's
#: ``ignore_result`` alone.
STORE_ERRORS_READS_THE_MESSAGE = (CELERY_VERSION.major, CELERY_VERSION.minor) >= (5, 6)
