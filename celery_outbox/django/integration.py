"""Django's side of the core's seam (``celery_outbox.core.integration.Integration``).

Django's database as the store, ``transaction.atomic()`` blocks as units of work, and Django's
connection for an ``IdempotentTask``'s attempt; ``Outbox(app)`` hands it to the runtime, and it
takes part only with ``celery_outbox.django`` in ``INSTALLED_APPS``. Transaction boundary:
Django's (``transactions``, ``unit_of_work``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.config import DEFAULT_DATABASE_URL, OutboxSettings
from ..errors import ConfigurationError
from .settings import database_url, installed, same_database
from .transactions import django_database_of, joined_transaction, tenant_in_atomic_block
from .unit_of_work import DjangoAttempt

__all__ = ["DjangoIntegration"]


class DjangoIntegration:
    """The outbox inside a Django project: its transactions joined, its database the store."""

    name = "django"

    def active(self) -> bool:
        """Whether Django's settings list ``celery_outbox.django``."""
        return installed()

    def store_settings(self, settings: OutboxSettings) -> tuple[OutboxSettings, bool]:
        """The store is Django's database ``outbox_django_database`` unless ``outbox_database_url``
        names another; the outbox joins Django's transactions when its store is that database."""
        if settings.database_url == DEFAULT_DATABASE_URL:
            return dataclasses.replace(settings, database_url=database_url(settings.django_database)), True
        try:
            return settings, same_database(settings.database_url, database_url(settings.django_database))
        except ConfigurationError:  # a Django database the outbox cannot use: not the outbox's store
            return settings, False

    def joined_transaction(self, publisher: Any) -> Any | None:
        """The unit of work of Django's atomic block (or manual transaction) open on the store's database."""
        return joined_transaction(publisher)

    def attempt(self, publisher: Any, settings: OutboxSettings) -> DjangoAttempt | None:
        """An attempt inside Django's transaction on the running tenant's Django database
        (``outbox_django_database`` for none); None for a tenant placed outside Django."""
        using = django_database_of(publisher.runtime)
        return None if using is None else DjangoAttempt(publisher, using)

    def tenant_database_url(self, name: str) -> str:
        """The URL of Django's database ``name``."""
        return database_url(name)

    def tenant_in_transaction(self, publisher: Any) -> str | None:
        """The tenant whose Django database has an atomic block open in this thread, or None."""
        return tenant_in_atomic_block(publisher.runtime)
