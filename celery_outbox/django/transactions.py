"""Publishes inside Django's ``transaction.atomic()`` join Django's transaction.

Transaction boundary: inside an atomic block on the outbox's Django database (nested
blocks, savepoints and ``ATOMIC_REQUESTS`` included), a captured message for a durable
queue is inserted at once through Django's own connection, in the block's transaction:
a savepoint or block that rolls back takes its row back with the user's writes. Every
captured message is published by ``transaction.on_commit`` after Django's outermost
commit (durable rows taken as the commit-time publisher takes them), never after a
rollback: Django drops the callbacks of a rolled-back block. A ``retry`` or ``replace``
of the running task, which Celery decided on, is not tied to the block: it is stored and
forwarded at once, as outside a unit of work.

Guarantee: as for a unit of work. A durable message commits with the user's data or not
at all; once committed it is published now or by the relay later, never lost.
"""

from __future__ import annotations

from functools import partial

from ..envelope import OutgoingMessage
from ..publishing import Publisher, store_durable
from ..store import Store
from .engine import django_engine

__all__ = ["DjangoTransaction", "joined_transaction"]


class DjangoTransaction:
    """The capture target of one publish inside Django's atomic block on database ``using``."""

    def __init__(self, publisher: Publisher, using: str, store: Store):
        self.publisher = publisher
        self.using = using
        self.store = store

    def add(self, messages: list[OutgoingMessage]) -> None:
        """Insert the durable messages in Django's transaction; publish all after its commit."""
        from django.db import transaction

        decided = [m for m in messages if m.survives_rollback]
        if decided:
            self.publisher.store_and_forward(decided)
        joined = [m for m in messages if not m.survives_rollback]
        durable = [m for m in joined if m.durable]
        if durable:
            with self.store.engine.connect() as conn:  # Django's connection, in its open transaction
                store_durable(self.store, conn, durable)
        if joined:
            transaction.on_commit(partial(self.publisher.publish_committed, joined), using=self.using, robust=True)


_stores: dict[tuple[str, str], Store] = {}


def joined_transaction(publisher: Publisher) -> DjangoTransaction | None:
    """The Django transaction a publish joins now: an atomic block open on the outbox's Django
    database in this thread, or None."""
    from django.db import connections

    settings = publisher.runtime.settings
    using = settings.django_database
    if not connections[using].in_atomic_block:
        return None
    key = (using, settings.table_prefix)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = Store(django_engine(using), settings.table_prefix)
    return DjangoTransaction(publisher, using, store)
