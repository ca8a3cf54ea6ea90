"""The seam through which a framework joins the core: its store, its units of work, its attempts.

A framework gives its database as the store, its open transaction as the unit of work of a send,
and its connection for an ``IdempotentTask``'s attempt. ``Outbox(app)`` hands the runtime the
integrations it composes (Django's, in ``celery_outbox.django.integration``); the core asks them
through this protocol and never imports a framework. Transaction boundary: the framework's; a
joined transaction is a unit of work like any other (durable rows in it, the publish after its
commit, nothing on its rollback).
"""

from __future__ import annotations

from typing import Any, Protocol

from .config import OutboxSettings

__all__ = ["Integration"]


class Integration(Protocol):
    """A framework the outbox joins. Its methods are called only when ``active()`` said so, once
    the settings are read."""

    #: the framework's name, for messages
    name: str

    def active(self) -> bool:
        """Whether the framework is set up in this process (asked when the settings are read)."""

    def store_settings(self, settings: OutboxSettings) -> tuple[OutboxSettings, bool]:
        """``settings`` with the framework's database as the store's where they name none, and
        whether the outbox joins the framework's transactions (the store is that database)."""

    def joined_transaction(self, publisher: Any) -> Any | None:
        """The unit of work of the framework's transaction open in this thread on the store's
        database (for ``publisher``, a ``Publisher``), or None when none is open."""

    def attempt(self, publisher: Any, settings: OutboxSettings) -> Any | None:
        """An ``IdempotentTask`` attempt (a ``ConnectionUnitOfWork``) that claims and writes in the
        framework's transaction, on its connection; None when the running tenant's store is not a
        database of the framework's."""

    def tenant_database_url(self, name: str) -> str:
        """The URL of the framework's database ``name`` (a tenant placed there, ``TenantPlace.django``)."""

    def tenant_in_transaction(self, publisher: Any) -> str | None:
        """The tenant whose framework database has a transaction open in this thread (a send in it is
        that tenant's), or None."""
