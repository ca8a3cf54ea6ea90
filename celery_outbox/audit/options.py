"""What the delivery audit is asked to do (``AuditOptions``), and its one error for bad input.

No transaction. The command line and ``run_audit``'s callers build the options, every part of the
job reads them, and each part reports bad input as an ``AuditInputError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

__all__ = ["AuditInputError", "AuditOptions"]

_SIZE = re.compile(r"[1-9][0-9]*[kmgt]?", re.IGNORECASE)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")  # as outbox_tenants' schemas are checked


class AuditInputError(Exception):
    """The audit's input is missing or unreadable; the message says what and where."""


@dataclass
class AuditOptions:
    out: str
    archive: str | None = None
    jdbc_url: str | None = None
    jdbc_jar: str | None = None
    table_prefix: str = "celery_outbox_"
    # The PostgreSQL schema of the live tables (a tenant placed in a schema); None: the database's
    # search path, as the default store's connections have it.
    schema: str | None = None
    grace_seconds: float = 3600.0
    late_after_seconds: float = 60.0
    stuck_after_seconds: float = 3600.0
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    master: str | None = None
    # The driver JVM's heap (Spark's size syntax: 512m, 6g). Local mode runs everything in the
    # driver; Spark's default is 1g. Only when this job starts Spark: under spark-submit give
    # spark-submit's own --driver-memory.
    driver_memory: str | None = None
    # Partitions of each shuffle. None: the session's own setting, unless that is Spark's default
    # of 200, which is far too many for one machine; then 4 per core Spark has.
    shuffle_partitions: int | None = None
    # Spark's own log on this process's stdout and stderr, as Spark configures it; otherwise, when
    # this job starts the JVM, everything the JVM prints goes to a file (``spark.log`` in --out).
    verbose: bool = False
    # Read the whole archive again, ignoring what the ledger in --out covered (it is written anew).
    full: bool = False
    # Keep a ledger in --out for the next run (``ledger``). Without, the run reads everything and
    # skips the settling pass: a one-off audit, at about half the cost of a full run that keeps one.
    ledger: bool = True
    # How long after a message's newest row the ledger keeps the message to match repeats of its
    # rows (archiving is at least once) before settling it into its totals (``ledger``).
    horizon_seconds: float = 86400.0

    def __post_init__(self) -> None:
        if self.driver_memory is not None and not _SIZE.fullmatch(self.driver_memory):
            raise AuditInputError(f"driver memory must be a size such as 4g or 512m, not {self.driver_memory!r}")
        if self.schema is not None and not _IDENTIFIER.fullmatch(self.schema):
            raise AuditInputError(f"the schema must be an SQL identifier, not {self.schema!r}")
        if self.horizon_seconds < 0:
            raise AuditInputError(f"the horizon must be 0 seconds or more, not {self.horizon_seconds}")
        if self.shuffle_partitions is not None and self.shuffle_partitions < 1:
            raise AuditInputError(f"shuffle partitions must be at least 1, not {self.shuffle_partitions}")
