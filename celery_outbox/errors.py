"""Exceptions of celery-outbox: each names what is wrong and what to do about it."""

from __future__ import annotations

__all__ = ["OutboxError", "ConfigurationError", "IncompatibleSchema", "OutboxBypassed", "StoreUnavailable",
           "UndecidableRoute", "UnknownTenant", "UnstorableMessage"]


class OutboxError(Exception):
    """Base class of every error celery-outbox raises on purpose."""


class ConfigurationError(OutboxError, ValueError):
    """A setting is missing, malformed or out of range.

    Raised once, when ``Outbox(app)`` reads ``app.conf``; the message names the
    setting, the bad value and what is allowed.
    """


class StoreUnavailable(OutboxError):
    """The message store cannot be reached or used (database down, driver missing)."""


class UnknownTenant(OutboxError, LookupError):
    """Code or a message names a tenant that ``outbox_tenants`` does not know (now, after asking a
    callable source again). Nothing is written: a unit of work for it does not begin, and a
    delivery naming it is a dead letter in the default store, its reason naming the tenant."""

    def __init__(self, tenant: object, reason: str = "outbox_tenants does not name it"):
        self.tenant = tenant
        super().__init__(f"unknown tenant {tenant!r}: {reason}")


class IncompatibleSchema(OutboxError):
    """The store's tables carry a schema version newer than this release's: a newer
    celery-outbox migrated them. Nothing is changed in the store; upgrade this process."""


class UnstorableMessage(OutboxError, ValueError):
    """A message for a durable queue carries a value its outgoing row cannot hold (an id over the
    column's length, a NUL character, a character UTF-8 cannot encode).

    Raised by the call that sends it (``apply_async``, ``send_task``...), before anything is
    stored: the caller's transaction is untouched. The message names the value and the limit.
    """


class UndecidableRoute(OutboxError, ValueError):
    """A message is published through an exchange whose routing celery-outbox does not follow (a
    ``headers`` exchange), and a durable queue is bound to it: whether it is durable cannot be
    decided. Raised by the call that sends it, before anything is stored."""


class TransactionAborted(OutboxError):
    """The database aborted a unit of work's transaction before its commit: a statement in it
    failed and the code caught the error without a savepoint, so the COMMIT would silently roll
    back every write, message and inbox claim of it. Raised instead of that commit."""

    def __init__(self, cause: str):
        self.cause = cause
        super().__init__(
            f"the database aborted this transaction before its commit: a statement in it failed ({cause}) and the "
            "error was caught without a savepoint, so committing would roll back every write of it; run a "
            "statement that may fail in a savepoint (session.begin_nested(), connection.begin_nested(), or "
            "transaction.atomic() inside the block on Django)")


class OutboxBypassed(UserWarning):
    """A task message is sent through a Celery app that has no ``Outbox`` (Celery's default app, or
    one whose module this process never imported) in a process that uses celery-outbox: it is
    published at once, outside every guarantee. Warned once per process."""
