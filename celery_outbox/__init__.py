"""celery-outbox: the transactional outbox and the idempotent inbox for Celery.

``Outbox(app)`` installs everything on a Celery app. ``metadata`` holds the
tables under the default prefix, for Alembic autogenerate.
"""

from .consumer.tasks import IdempotentTask
from .core.config import OutboxSettings
from .core.tenancy import TENANT_HEADER, current_tenant, using_tenant
from .errors import (
    ConfigurationError,
    IncompatibleSchema,
    OutboxBypassed,
    OutboxError,
    StoreUnavailable,
    TransactionAborted,
    UndecidableRoute,
    UnknownTenant,
    UnstorableMessage,
)
from .outbox import Outbox
from .store import build_tables
from .vocabulary import SEND_HEADER, IdempotencyStyle, MessageIdentity

metadata = build_tables().metadata

__all__ = [
    "SEND_HEADER",
    "TENANT_HEADER",
    "ConfigurationError",
    "IdempotencyStyle",
    "IdempotentTask",
    "IncompatibleSchema",
    "MessageIdentity",
    "Outbox",
    "OutboxBypassed",
    "OutboxError",
    "OutboxSettings",
    "StoreUnavailable",
    "TransactionAborted",
    "UndecidableRoute",
    "UnknownTenant",
    "UnstorableMessage",
    "current_tenant",
    "metadata",
    "using_tenant",
]
