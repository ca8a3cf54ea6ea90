"""celery-outbox: the transactional outbox and the idempotent inbox for Celery.

``Outbox(app)`` installs everything on a Celery app. ``metadata`` holds the
tables under the default prefix, for Alembic autogenerate.
"""

from .config import OutboxSettings
from .envelope import SEND_HEADER
from .errors import (
    ConfigurationError,
    IncompatibleSchema,
    OutboxError,
    StoreUnavailable,
    UndecidableRoute,
    UnstorableMessage,
)
from .outbox import Outbox
from .store import build_tables
from .tasks import IdempotentTask

metadata = build_tables().metadata

__all__ = [
    "SEND_HEADER",
    "ConfigurationError",
    "IdempotentTask",
    "IncompatibleSchema",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "StoreUnavailable",
    "UndecidableRoute",
    "UnstorableMessage",
    "metadata",
]
