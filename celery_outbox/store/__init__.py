"""The message store: tables (one MetaData per prefix) and the only SQL of celery-outbox."""

from .base import (
    as_utc,
    is_content_error,
    is_lock_timeout,
    is_statement_timeout,
    is_unique_violation,
    node_lock_key,
    utcnow,
)
from .engine import build_engine, masked_options, redact, safe_url
from .migration import MigrationResult
from .schema import SCHEMA_VERSION, SEND_ID_SIZE, UNOWNED, Tables, build_tables, text_problem
from .store import Store

__all__ = [
    "SCHEMA_VERSION",
    "SEND_ID_SIZE",
    "UNOWNED",
    "MigrationResult",
    "Store",
    "Tables",
    "as_utc",
    "build_engine",
    "build_tables",
    "is_content_error",
    "is_lock_timeout",
    "is_statement_timeout",
    "is_unique_violation",
    "masked_options",
    "node_lock_key",
    "redact",
    "safe_url",
    "text_problem",
    "utcnow",
]
