"""The Django app of celery-outbox (label ``celery_outbox``)."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryOutboxConfig(AppConfig):
    """The outbox's tables (its migrations) and its admin."""

    name = "celery_outbox.django"
    label = "celery_outbox"
    verbose_name = "celery-outbox"
    default = True
