"""The Django app of celery-outbox (label ``celery_outbox``)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from django.apps import AppConfig

from ..errors import OutboxBypassed

logger = logging.getLogger("celery_outbox")

BYPASS_WARNING = (
    "celery-outbox: task {task!r} was sent through a Celery app without an Outbox, outside every guarantee of "
    "the outbox (no outgoing row, published at once, not after the commit). This Django process never imported "
    "your Celery module: import it in your project package's __init__.py "
    "(from .celery import app as celery_app), as Celery's Django guide does."
)


class CeleryOutboxConfig(AppConfig):
    """The outbox's tables (its migrations) and its admin; and a warning, once per process, when a
    task message is sent through a Celery app that has no ``Outbox``."""

    name = "celery_outbox.django"
    label = "celery_outbox"
    verbose_name = "celery-outbox"
    default = True

    def ready(self) -> None:
        from celery import signals

        signals.before_task_publish.connect(_warn_when_bypassed, weak=False,
                                            dispatch_uid="celery_outbox.django.bypass")


_warned = False


def _warn_when_bypassed(sender: Any = None, **_: Any) -> None:
    """``before_task_publish``: Celery sends it for the messages of every app; those of an app with
    an ``Outbox`` pass through its publish hook first."""
    global _warned
    from ..producer.publish_hook import sending_through_outbox

    if _warned or sending_through_outbox():
        return
    _warned = True
    message = BYPASS_WARNING.format(task=sender)
    logger.warning(message)
    warnings.warn(message, OutboxBypassed, stacklevel=2)
