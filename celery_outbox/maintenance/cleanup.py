"""Cleanup: the maintenance that keeps the tables bounded (beat's ``celery_outbox.cleanup``).

Transaction boundary: bounded batches (``outbox_cleanup_batch_size``), each its own short
transaction that does not wait for the WAL flush (a lost commit is done again by the next pass),
resting ``outbox_cleanup_rest`` times a batch's duration between batches. Guarantee: an ended
inbox row is deleted only once its ``keep_until`` passed (the dedupe window), a dead letter only
past ``outbox_dead_letter_retention``, and each batch is handed to the archiver, when one is
configured, before it is deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..core.crashpoints import crashpoint
from ..core.runtime import Runtime
from ..store import utcnow
from ..vocabulary import ArchiveKind
from .batches import in_batches

__all__ = ["CleanupResult", "archive_sent_records", "cleanup", "delete_expired_inbox_rows", "expire_dead_letters"]

logger = logging.getLogger("celery_outbox.durability")


@dataclass
class CleanupResult:
    incoming_deleted: int = 0
    dead_letters_deleted: int = 0
    archived: int = 0
    batches: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"incoming_deleted": self.incoming_deleted, "dead_letters_deleted": self.dead_letters_deleted,
                "archived": self.archived, "batches": self.batches}

    def __str__(self) -> str:
        return (f"cleanup: deleted {self.incoming_deleted} handled inbox row(s) and "
                f"{self.dead_letters_deleted} dead letter(s), archived {self.archived}, in {self.batches} batch(es)")


def cleanup(runtime: Runtime, max_batches: int | None = None) -> CleanupResult:
    """One cleanup pass (beat task ``celery_outbox.cleanup``, ``celery outbox cleanup``)."""
    runtime.ready()
    result = CleanupResult()
    delete_expired_inbox_rows(runtime, result, max_batches)
    expire_dead_letters(runtime, result, max_batches)
    archive_sent_records(runtime, result, max_batches)
    if result.incoming_deleted or result.dead_letters_deleted:
        logger.info("celery-outbox %s", result)
    return result


def delete_expired_inbox_rows(runtime: Runtime, result: CleanupResult, max_batches: int | None = None) -> None:
    """Delete ended inbox rows past ``keep_until``, a batch per short transaction, oldest first.

    Each batch starts at the latest ``keep_until`` the batch before it deleted, not at the start of
    the index again: the entries of rows deleted moments ago are still there (see
    ``Store.delete_expired_incoming``). A row skipped because it was locked is left to the next run.
    """
    store, archiver, batch = runtime.store, runtime.archiver, runtime.settings.cleanup_batch_size
    after = None

    def delete(conn: Any) -> int:
        nonlocal after
        now = utcnow()
        if archiver is None:
            count = store.delete_expired_incoming(conn, now, batch, after)
            after = count.last_keep_until or after
        else:
            rows = store.lock_expired_incoming(conn, now, batch, after)
            if rows:
                archiver.archive(ArchiveKind.INCOMING, rows)
                result.archived += len(rows)
                after = max(row.keep_until for row in rows)
            count = store.delete_incoming(conn, [(row.message_id, row.destination, row.send_id) for row in rows])
        if count:
            crashpoint("during_cleanup")
        return count

    # a lost commit: the rows are deleted again
    deleted, batches = in_batches(runtime, batch, max_batches, delete, durable=False,
                                   rest=runtime.settings.cleanup_rest)
    result.incoming_deleted += deleted
    result.batches += batches


def expire_dead_letters(runtime: Runtime, result: CleanupResult, max_batches: int | None = None) -> None:
    """With ``outbox_dead_letter_retention`` set, delete dead letters that failed longer ago."""
    settings, store, archiver = runtime.settings, runtime.store, runtime.archiver
    if settings.dead_letter_retention is None:
        return
    batch = settings.cleanup_batch_size

    def delete(conn: Any) -> int:
        cutoff = utcnow() - timedelta(seconds=settings.dead_letter_retention)
        rows = store.lock_dead_letters(conn, store.dead_letter_filter(failed_before=cutoff), batch,
                                       full=archiver is not None)
        if rows and archiver is not None:
            archiver.archive(ArchiveKind.DEAD_LETTERS, rows)
            result.archived += len(rows)
        return store.delete_dead_letters(conn, [row.id for row in rows])

    # a lost commit: the rows are deleted again
    deleted, batches = in_batches(runtime, batch, max_batches, delete, durable=False,
                                   rest=runtime.settings.cleanup_rest)
    result.dead_letters_deleted += deleted
    result.batches += batches


def archive_sent_records(runtime: Runtime, result: CleanupResult, max_batches: int | None = None) -> None:
    """With an archiver, move the records of sent messages to the archive (the audit's "sent" side)."""
    store, archiver, batch = runtime.store, runtime.archiver, runtime.settings.cleanup_batch_size
    if archiver is None:
        return

    def move(conn: Any) -> int:
        rows = store.lock_sent_records(conn, batch)
        if rows:
            archiver.archive(ArchiveKind.SENT, rows)
        return store.delete_sent_records(conn, [row.id for row in rows])

    # a lost commit: the rows are archived again
    archived, batches = in_batches(runtime, batch, max_batches, move, durable=False,
                                    rest=runtime.settings.cleanup_rest)
    result.archived += archived
    result.batches += batches
