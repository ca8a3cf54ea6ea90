"""Recovery and cleanup: the maintenance that makes sure no row is stranded and no table grows forever.

``recover(runtime)`` and ``cleanup(runtime)`` are what the beat tasks
``celery_outbox.recover`` and ``celery_outbox.cleanup`` run, and what
``celery -A proj outbox recover|cleanup`` runs by hand. Each step is a small
function working in bounded batches (``outbox_recover_batch_size``,
``outbox_cleanup_batch_size``), every batch its own short transaction, at most
``outbox_max_batches_per_run`` batches per step and run; the next run continues.

Safe to run twice at once (two beats, many workers): rows are taken with
``FOR UPDATE SKIP LOCKED`` on PostgreSQL and under SQLite's single write lock,
and a node's stale check counts at most once per check period.

Recover, in order:

1. declare dead the nodes whose heartbeat is older than ``outbox_node_stale_after``
   for ``outbox_node_stale_checks`` consecutive checks, or silent, on the database's
   clock; on PostgreSQL only once their process no longer holds its liveness lock;
2. make the sent rows that dead nodes stored due for redelivery now (a sender that died between
   its commit and its publish), and release the inbox claims of dead nodes (and of owner ids
   with no node row);
3. release claims older than ``outbox_inbox_stale_time`` (opt-in);
4. relay the due outgoing rows: unsent ones and durable scheduled messages whose
   time has come; expired ones go to dead letters (reason ``expired``);
5. redeliver sent durable messages that no inbox acknowledged within
   ``outbox_redeliver_after`` (the broker lost them);
6. re-publish the stored envelopes of durable-queue deliveries that are running,
   unowned and due for recovery, so they run again: the inbox accepts the copy
   (a recovery, not a duplicate). Each re-publish backs the row off
   exponentially; after ``outbox_relay_max_attempts`` re-publishes the delivery is
   dead-lettered (reason ``worker_lost``) and, once that commits, its result is
   FAILURE(WorkerLostError) (``celery_outbox.message.results``).

Cleanup deletes ended inbox rows whose ``keep_until`` passed and, with
``outbox_dead_letter_retention`` set, dead letters older than that, handing each
batch to the archiver first when one is configured; with an archiver it also moves
the records of sent messages to the archive.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Sequence

from ..core import log_fields
from ..core.crashpoints import crashpoint
from ..core.runtime import Archiver, Runtime
from ..message.dead_letter_rows import stored_dead_letter_row
from ..message.envelope import from_row
from ..message.results import EndedMessage, store_dead_letter_results
from ..monitoring import tracing
from ..producer.broker import outlet
from ..signals import announce_dead_letters, claims_released, message_redelivered
from ..store import utcnow
from ..vocabulary import ArchiveKind, ClaimRelease, DeadLetterReason, RedeliveryReason
from .relay import RelayResult, redeliver, relay

__all__ = ["Archiver", "CleanupResult", "RecoverResult", "cleanup", "recover"]

logger = logging.getLogger("celery_outbox.durability")

# Longest back-off between two re-publishes of one stranded envelope.
MAX_RECOVERY_BACKOFF = timedelta(hours=1)


@dataclass
class RecoverResult:
    nodes_declared_dead: list[int] = field(default_factory=list)
    claims_released: int = 0
    stale_claims_released: int = 0
    sends_of_dead_nodes: int = 0
    relay: RelayResult = field(default_factory=RelayResult)
    redelivered: int = 0
    envelopes_republished: int = 0
    envelopes_dead_lettered: int = 0
    broker_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes_declared_dead": self.nodes_declared_dead,
            "claims_released": self.claims_released,
            "stale_claims_released": self.stale_claims_released,
            "sends_of_dead_nodes": self.sends_of_dead_nodes,
            "published": self.relay.published,
            "publish_failures": self.relay.failed,
            "expired": self.relay.expired,
            "redelivered": self.redelivered,
            "dead_lettered": self.relay.dead_lettered + self.envelopes_dead_lettered,
            "envelopes_republished": self.envelopes_republished,
            "broker_error": self.broker_error or self.relay.broker_error,
        }

    def __str__(self) -> str:
        dead = ", ".join(map(str, self.nodes_declared_dead)) or "none"
        lines = [
            f"nodes declared dead: {dead}",
            f"claims released: {self.claims_released} of dead nodes, {self.stale_claims_released} stale",
            f"sends of dead nodes due for redelivery now: {self.sends_of_dead_nodes}",
            str(self.relay),
            f"sent messages redelivered (no inbox acknowledged them): {self.redelivered}",
            f"envelopes re-published: {self.envelopes_republished}, "
            f"dead-lettered after too many recoveries: {self.envelopes_dead_lettered}",
        ]
        if self.broker_error:
            lines.append(f"broker unavailable: {self.broker_error}")
        return "\n".join(lines)


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


# -- recover ---------------------------------------------------------------------------------------


def recover(runtime: Runtime, max_batches: int | None = None) -> RecoverResult:
    """One recover pass (beat task ``celery_outbox.recover``, ``celery outbox recover``)."""
    runtime.ready()
    result = RecoverResult()
    result.nodes_declared_dead = detect_dead_nodes(runtime)
    result.sends_of_dead_nodes = redeliver_sends_of_dead_nodes(runtime, max_batches)
    result.claims_released = release_dead_claims(runtime, max_batches)
    result.stale_claims_released = release_stale_claims(runtime, max_batches)
    result.relay = relay(runtime, max_batches)
    if not result.relay.broker_error:
        result.redelivered, result.broker_error = redeliver(runtime, max_batches)
    if not result.broker_error and not result.relay.broker_error:
        republish_stranded_envelopes(runtime, result, max_batches)
    if result.nodes_declared_dead or result.sends_of_dead_nodes or result.claims_released \
            or result.stale_claims_released \
            or result.redelivered or result.envelopes_republished or result.envelopes_dead_lettered:
        logger.info("celery-outbox recover: %s", "; ".join(str(result).splitlines()))
    return result


def detect_dead_nodes(runtime: Runtime) -> list[int]:
    """Count one stale check per node and declare dead those that reached the threshold."""
    settings, store = runtime.settings, runtime.store
    with store.begin() as conn:
        now = store.database_now(conn)  # the heartbeats' clock
        dead = store.check_nodes(
            conn, now,
            stale_before=now - timedelta(seconds=settings.node_stale_after),
            checks_needed=settings.node_stale_checks,
            counted_before=now - timedelta(seconds=settings.recover_interval / 2),
            silent_before=settings.silent_before(now),
        )
    for node_id in dead:
        logger.warning("celery-outbox: node %d declared dead; its claims are released", node_id)
    return dead


def redeliver_sends_of_dead_nodes(runtime: Runtime, max_batches: int | None = None) -> int:
    """Make the sent rows the dead nodes stored (marked sent, to publish after their commit) due
    for redelivery now, in batches: a sender killed between its commit and its publish has its
    messages published by this pass's redelivery, not ``outbox_redeliver_after`` later. Returns
    how many rows."""
    settings, store = runtime.settings, runtime.store

    def hand_over(conn: Any) -> int:
        return store.redeliver_rows_of_senders(conn, store.dead_nodes(conn), utcnow(), settings.recover_batch_size)

    handed, _ = _in_batches(runtime, settings.recover_batch_size, max_batches, hand_over, durable=False)
    if handed:
        logger.warning("celery-outbox: %d sent messages of dead nodes are due for redelivery now (their publish "
                       "after the commit may not have happened)", handed)
    return handed


def _in_batches(runtime: Runtime, batch_size: int, max_batches: int | None,
                step: Callable[[Any], int], durable: bool = True, rest: float = 0.0) -> tuple[int, int]:
    """Run ``step(conn)`` (which handles at most ``batch_size`` rows and returns how many), each time in
    its own short transaction, until a batch comes back short or the cap per run is reached.
    ``durable=False`` for steps whose lost commit is simply done again by the next pass: their
    commits do not wait for the WAL flush (nor hold up the flushes of other transactions). Before
    each next batch, sleep ``rest`` times as long as the batch took.
    Returns (rows handled, batches that handled any)."""
    total = batches = 0
    took = 0.0
    for _ in range(max_batches or runtime.settings.max_batches_per_run):
        if rest and took:
            time.sleep(rest * took)
        started = time.monotonic()
        with runtime.store.begin(durable=durable) as conn:
            count = step(conn)
        took = time.monotonic() - started
        total += count
        batches += bool(count)
        if count < batch_size:
            break
    return total, batches


def release_dead_claims(runtime: Runtime, max_batches: int | None = None) -> int:
    """Release the inbox claims of dead nodes and orphaned owners; forget fully released nodes."""
    settings, store = runtime.settings, runtime.store

    def release(conn: Any) -> int:
        return store.release_owned(conn, store.dead_owners(conn), settings.recover_batch_size, utcnow())

    released, _ = _in_batches(runtime, settings.recover_batch_size, max_batches, release)
    if released:
        claims_released.send(sender=runtime.owner, count=released, reason=ClaimRelease.DEAD_NODE)
    with store.begin() as conn:
        store.forget_released_nodes(conn)  # only nodes that own nothing any more
    return released


def release_stale_claims(runtime: Runtime, max_batches: int | None = None) -> int:
    """With ``outbox_inbox_stale_time`` set, release claims older than that, live owner or not."""
    settings, store = runtime.settings, runtime.store
    if settings.inbox_stale_time is None:
        return 0

    def release(conn: Any) -> int:
        now = utcnow()
        return store.release_stale_incoming(
            conn, now - timedelta(seconds=settings.inbox_stale_time), settings.recover_batch_size, now)

    released = _in_batches(runtime, settings.recover_batch_size, max_batches, release)[0]
    if released:
        claims_released.send(sender=runtime.owner, count=released, reason=ClaimRelease.STALE)
    return released


def republish_stranded_envelopes(runtime: Runtime, result: RecoverResult, max_batches: int | None = None) -> None:
    """Re-publish stored envelopes of durable-queue deliveries nobody is running.

    Transaction boundary: per batch, the rows are locked, published and marked
    (``recoveries + 1``, next recovery after a back-off) in one transaction. A crash
    after the publish re-publishes them on a later pass: the inbox discards the copy.
    """
    settings, store, app = runtime.settings, runtime.store, runtime.app
    grace = timedelta(seconds=settings.node_stale_after)
    with outlet(app) as out:
        connected = False
        for _ in range(max_batches or settings.max_batches_per_run):
            with store.begin(durable=False) as conn:  # lost in a crash, the envelopes are only sent again
                now = utcnow()
                rows = store.lock_recoverable_incoming(conn, now, settings.recover_batch_size)
                if not rows:
                    return
                if not connected:
                    result.broker_error = out.unreachable()
                    if result.broker_error:
                        logger.warning("celery-outbox recover: broker unavailable, envelopes wait: %s",
                                       result.broker_error)
                        return
                    connected = True
                exhausted = [row for row in rows if row.recoveries >= settings.relay_max_attempts]
                dead_letters = _give_up(runtime, conn, exhausted, now) if exhausted else []
                result.envelopes_dead_lettered += len(exhausted)
                done = out.publish_each([(row, from_row(row, out.queues)) for row in rows
                                         if row.recoveries < settings.relay_max_attempts], crash_point="during_recover",
                                         step=tracing.Step.RECOVER)
                for row, _, exc in done.failed:  # counted as a recovery; it dies after the cap
                    logger.error("celery-outbox recover: cannot re-publish %s[%s]: %r",
                                 row.task_name, row.message_id, exc, **log_fields.of_row(row))
                result.envelopes_republished += len(done.published)
                result.broker_error = done.broker_error_text
                store.mark_recovered(conn, [
                    {"message_id": row.message_id, "destination": row.destination, "send_id": row.send_id,
                     "recover_after": now + min(grace * 2 ** row.recoveries, MAX_RECOVERY_BACKOFF)}
                    for row, *_ in done.published + done.failed])
            # committed: their callers get FAILURE(WorkerLostError), as from Celery past its re-send cap
            announce_dead_letters(runtime.owner, dead_letters)
            for _, message in done.published:
                message_redelivered.send(sender=runtime.owner, message=message, reason=RedeliveryReason.WORKER_LOST)
            store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [
                EndedMessage.of_row(row) for row in exhausted])
            if result.broker_error or len(rows) < settings.recover_batch_size:
                return


def _give_up(runtime: Runtime, conn: Any, rows: Sequence[Any], now: datetime) -> list[dict[str, Any]]:
    """End the envelopes recovery re-published too often, in ``conn``'s transaction: their rows
    dead, their messages in dead letters (returned)."""
    store, settings = runtime.store, runtime.settings
    keep_until = now + timedelta(seconds=settings.keep_after_handling)
    store.mark_incoming_dead(conn, [(row.message_id, row.destination, row.send_id) for row in rows], now, keep_until)
    dead_letters = [stored_dead_letter_row(
        row, reason=DeadLetterReason.WORKER_LOST, failed_at=now, destination=row.destination, queue=row.queue,
        description=f"the worker running it was lost {row.recoveries} time(s); recovery gave up",
        retries=row.retries, nesting=row.nesting, replays=row.replays,
    ) for row in rows]
    store.insert_dead_letters(conn, dead_letters)
    for row in rows:
        logger.error("celery-outbox: %s[%s] was recovered %d time(s) and never finished; dead-lettered",
                     row.task_name, row.message_id, row.recoveries, **log_fields.of_row(row))
    return dead_letters


# -- cleanup ---------------------------------------------------------------------------------------


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
    deleted, batches = _in_batches(runtime, batch, max_batches, delete, durable=False,
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
    deleted, batches = _in_batches(runtime, batch, max_batches, delete, durable=False,
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
    archived, batches = _in_batches(runtime, batch, max_batches, move, durable=False,
                                    rest=runtime.settings.cleanup_rest)
    result.archived += archived
    result.batches += batches
