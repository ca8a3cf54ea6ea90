"""A task attempt inside Django's transaction: the inbox claim and the body's ORM writes commit as one.

Transaction boundary: an ``IdempotentTask``, with ``celery_outbox.django`` installed, runs its
attempt in ``transaction.atomic()`` on the outbox's Django database, on Django's own connection.
Optimistic style: the claim is the block's first statement, the body's ORM writes follow, its
durable messages are inserted just before the block's end, and the block's commit commits them
all. Eager style: the claim commits before the body on the outbox's own connection; the body's
writes, its durable messages and the claim's finish commit together in the block. Everything the
body sent is published just after the commit; an exception rolls the block back.
Guarantee: as for the SQLAlchemy side: effects exactly once; a copy of a handled delivery is
discarded.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import RootTransaction

from ..errors import TransactionAborted
from ..producer.publishing import Publisher
from ..producer.unit_of_work import ConnectionUnitOfWork
from ..store.pipeline import remember_failed_statement
from .engine import django_engine

__all__ = ["DjangoAttempt"]


class _RolledBack(Exception):
    """Tells Django's atomic block to roll back."""


class DjangoAttempt(ConnectionUnitOfWork):
    """A task attempt's unit of work in ``transaction.atomic(using=using)``, on Django's connection.

    The block opens with the attempt, before its claim and its body, so that every ORM write of
    the body is inside it. The eager style's claim commits before the body on the outbox's own
    connection (``connection_before_begin`` is None); its finish is the block's last statement,
    and Django's commit, never one sent with it, ends the block."""

    commits_with_last = False

    def __init__(self, publisher: Publisher, using: str):
        super().__init__(publisher, django_engine(using))
        self._using = using
        self._atomic: Any = None
        self.connection  # noqa: B018 - opens Django's block now, before the body

    @property
    def connection_before_begin(self) -> None:
        return None

    def _begin(self) -> RootTransaction:
        from django.db import connections, transaction

        self._atomic = transaction.atomic(using=self._using)
        self._atomic.__enter__()
        connections[self._using].execute_wrappers.append(self._remember_failure)
        return self._connection.begin()  # bookkeeping only: Django's block owns the transaction

    def _remember_failure(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        """Django's execute wrapper while the block is open: the error of an ORM statement that
        fails is kept, for ``_refuse_if_aborted`` to name if the body catches it."""
        try:
            return execute(sql, params, many, context)
        except Exception as error:
            remember_failed_statement(self._connection, error)
            raise

    def _refuse_if_aborted(self, connection: Any) -> None:
        """Also when Django marked the block for rollback (an ORM statement failed inside it and
        the body caught the error outside a nested ``atomic()``): Django would end the block with
        a ROLLBACK, silently, on every database."""
        from django.db import connections

        if connections[self._using].needs_rollback:
            raise TransactionAborted(self.publisher.runtime.store.failed_statement(connection)
                                     or "Django marked the block for rollback")
        super()._refuse_if_aborted(connection)

    def _commit(self) -> None:
        """Commit the block. The project's ``on_commit`` callbacks run after the COMMIT, each made
        robust for it: one that raises is logged by Django, and the handled attempt stays handled
        (its writes and claim are committed, its messages go out)."""
        from django.db import connections

        self._connection.commit()
        atomic, self._atomic = self._atomic, None
        django_connection = connections[self._using]
        django_connection.run_on_commit = [(sids, func, True) for sids, func, _ in django_connection.run_on_commit]
        atomic.__exit__(None, None, None)

    def close(self) -> None:
        """Close the attempt; a block still open (the attempt ended before its commit or rollback)
        is rolled back."""
        from django.db import connections

        try:
            if self._atomic is not None:
                self._rollback()
        finally:
            wrappers = connections[self._using].execute_wrappers
            if self._remember_failure in wrappers:
                wrappers.remove(self._remember_failure)
            super().close()

    def _rollback(self) -> None:
        if self._transaction is not None and self._transaction.is_active:
            self._transaction.rollback()
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(_RolledBack, _RolledBack(), None)
