"""A task attempt inside Django's transaction: the inbox claim and the body's ORM writes commit
together.

Transaction boundary: an ``IdempotentTask`` of the optimistic style, with
``celery_outbox.django`` installed, runs its attempt in ``transaction.atomic()`` on the outbox's
Django database: the claim is the block's first statement, on Django's own connection (the
one the ORM uses in this thread), the body's ORM writes follow, its durable messages are
inserted just before the block's end, and the block's commit commits them all; everything it
sent is published just after. An exception rolls the block back, claim included.

Guarantee: as for the SQLAlchemy side: effects exactly once; a copy of a handled delivery is
discarded.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import RootTransaction

from ..publishing import Publisher
from ..unit_of_work import ConnectionUnitOfWork
from .engine import django_engine

__all__ = ["DjangoAttempt"]


class _RolledBack(Exception):
    """Tells Django's atomic block to roll back."""


class DjangoAttempt(ConnectionUnitOfWork):
    """A task attempt's unit of work in ``transaction.atomic(using=using)``, on Django's connection."""

    def __init__(self, publisher: Publisher, using: str):
        super().__init__(publisher, django_engine(using))
        self._using = using
        self._atomic: Any = None

    def _begin(self) -> RootTransaction:
        from django.db import transaction

        self._atomic = transaction.atomic(using=self._using)
        self._atomic.__enter__()
        return self._connection.begin()  # bookkeeping only: Django's block owns the transaction

    def _commit(self) -> None:
        self._connection.commit()
        atomic, self._atomic = self._atomic, None
        atomic.__exit__(None, None, None)

    def _rollback(self) -> None:
        assert self._transaction is not None
        self._transaction.rollback()
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(_RolledBack, _RolledBack(), None)
