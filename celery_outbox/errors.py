"""Exceptions of celery-outbox: each names what is wrong and what to do about it."""

from __future__ import annotations

__all__ = ["OutboxError", "ConfigurationError", "IncompatibleSchema", "StoreUnavailable"]


class OutboxError(Exception):
    """Base class of every error celery-outbox raises on purpose."""


class ConfigurationError(OutboxError, ValueError):
    """A setting is missing, malformed or out of range.

    Raised once, when ``Outbox(app)`` reads ``app.conf``; the message names the
    setting, the bad value and what is allowed.
    """


class StoreUnavailable(OutboxError):
    """The message store cannot be reached or used (database down, driver missing)."""


class IncompatibleSchema(OutboxError):
    """The store's tables carry a schema version newer than this release's: a newer
    celery-outbox migrated them. Nothing is changed in the store; upgrade this process."""
