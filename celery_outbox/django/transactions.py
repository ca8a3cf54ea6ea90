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

import weakref
from functools import partial
from typing import Any

from sqlalchemy.exc import DBAPIError

from ..envelope import OutgoingMessage
from ..errors import StoreUnavailable
from ..publishing import Publisher
from ..store import Store
from .engine import django_engine

__all__ = ["DjangoTransaction", "joined_transaction"]


class DjangoTransaction:
    """The capture target of the publishes inside Django's atomic block on database ``using``.

    Messages captured at one savepoint level share one ``on_commit`` callback, so they are
    published together after the commit; Django drops the callback, with the level's messages,
    when that savepoint (or an outer one) rolls back.
    """

    def __init__(self, publisher: Publisher, using: str, store: Store):
        self.publisher = publisher
        self.using = using
        self.store = store
        self._hooks: Any = None  # Django's list of on_commit callbacks the batches below were registered in
        self._batches: dict[tuple[str, ...], list[OutgoingMessage]] = {}

    def add(self, messages: list[OutgoingMessage]) -> None:
        """Insert the durable messages in Django's transaction; publish all after its commit."""
        from django.db import connections, transaction

        decided = [m for m in messages if m.survives_rollback]
        if decided:
            self.publisher.store_and_forward(decided)
        joined = [m for m in messages if not m.survives_rollback]
        durable = [m for m in joined if m.durable]
        connection = connections[self.using]
        if durable:
            try:
                with self.store.engine.connect() as conn:  # Django's connection, in its open transaction
                    self.publisher.store_durable(conn, durable)
            except (StoreUnavailable, DBAPIError) as exc:
                _raise_as_django_error(exc, connection)
        if not joined:
            return
        if self._hooks is not connection.run_on_commit:  # a new transaction, or a savepoint rolled back
            self._hooks, self._batches = connection.run_on_commit, {}
        level = tuple(connection.savepoint_ids)
        batch = self._batches.get(level)
        if batch is None:
            batch = self._batches[level] = []
            transaction.on_commit(partial(self.publisher.publish_committed, batch), using=self.using, robust=True)
        batch.extend(joined)


def _raise_as_django_error(exc: StoreUnavailable | DBAPIError, connection: Any) -> None:
    """Raise ``exc``, an error of a statement sent on Django's ``connection``, as the ORM raises
    the driver's error behind it: Django's own class (``django.db.OperationalError`` for a lost
    connection), caused by the driver's error, with the connection's ``errors_occurred`` set, so
    a caller's ``except django.db.Error`` catches it and Django checks the connection before
    reusing it. ``exc`` itself when no driver error caused it."""
    cause = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
    driver_error = getattr(cause, "orig", cause)
    if not isinstance(driver_error, connection.Database.Error):
        raise exc
    with connection.wrap_database_errors:  # Django's mapping of the driver's classes onto its own
        raise driver_error


# per Django connection (one per thread or greenlet): its joined transaction, per outbox
_joined: weakref.WeakKeyDictionary[Any, dict[int, DjangoTransaction]] = weakref.WeakKeyDictionary()


def joined_transaction(publisher: Publisher) -> DjangoTransaction | None:
    """The Django transaction a publish joins now: an atomic block open on the outbox's Django
    database in this thread, or None."""
    from django.db import connections

    settings = publisher.runtime.settings
    using = settings.django_database
    connection = connections[using]
    if not connection.in_atomic_block:
        return None
    of_connection = _joined.setdefault(connection, {})
    joined = of_connection.get(id(publisher))
    if joined is None or joined.publisher is not publisher:
        joined = of_connection[id(publisher)] = DjangoTransaction(publisher, using,
                                                                  _store(using, settings.table_prefix))
    return joined


_stores: dict[tuple[str, str], Store] = {}


def _store(using: str, prefix: str) -> Store:
    """The store on Django's connection ``using``: one per database and prefix, shared by every
    thread (its engine hands out the calling thread's connection)."""
    store = _stores.get((using, prefix))
    if store is None:
        store = _stores[(using, prefix)] = Store(django_engine(using), prefix)
    return store
