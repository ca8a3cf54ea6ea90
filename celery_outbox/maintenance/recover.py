"""Recovery: the maintenance that leaves no row stranded (beat's ``celery_outbox.recover``).

Transaction boundary: each step works in bounded batches (``outbox_recover_batch_size``), every
batch its own short transaction, at most ``outbox_max_batches_per_run`` batches per step and run;
the next run continues. Safe to run twice at once: rows are taken with ``FOR UPDATE SKIP LOCKED``
on PostgreSQL and under SQLite's single write lock. Guarantee: a dead node's claims are released
and its unpublished sends redelivered, committed rows nobody published are relayed, sent ones no
inbox acknowledged are redelivered, a stranded envelope runs again or ends as a
``worker_lost`` dead letter, and (a tenant's pass, its store answering) the tenant's messages
parked in the default store while its store was down are sent again (``parked``). The steps, in
order: docs/operations.md (Durability on celery beat).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from ..core import log_fields
from ..core.runtime import Runtime
from ..message.dead_letter_rows import stored_dead_letter_row
from ..message.envelope import from_row
from ..message.results import EndedMessage, store_dead_letter_results
from ..monitoring import tracing
from ..producer.broker import outlet
from ..signals import announce_dead_letters, claims_released, message_redelivered
from ..store import utcnow
from ..vocabulary import ClaimRelease, DeadLetterReason, RedeliveryReason
from .batches import in_batches
from .parked import send_parked
from .relay import RelayResult, redeliver, relay

__all__ = ["RecoverResult", "detect_dead_nodes", "recover", "redeliver_sends_of_dead_nodes", "release_dead_claims",
           "release_stale_claims", "republish_stranded_envelopes"]

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
    parked_sent: int = 0
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
            "parked_sent": self.parked_sent,
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
        if self.parked_sent:
            lines.append(f"parked messages of this tenant sent again: {self.parked_sent}")
        if self.broker_error:
            lines.append(f"broker unavailable: {self.broker_error}")
        return "\n".join(lines)


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
        if not result.broker_error:
            result.parked_sent, result.broker_error = send_parked(runtime, max_batches)
    if result.nodes_declared_dead or result.sends_of_dead_nodes or result.claims_released \
            or result.stale_claims_released or result.redelivered or result.envelopes_republished \
            or result.envelopes_dead_lettered or result.parked_sent:
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

    handed, _ = in_batches(runtime, settings.recover_batch_size, max_batches, hand_over, durable=False)
    if handed:
        logger.warning("celery-outbox: %d sent messages of dead nodes are due for redelivery now (their publish "
                       "after the commit may not have happened)", handed)
    return handed


def release_dead_claims(runtime: Runtime, max_batches: int | None = None) -> int:
    """Release the inbox claims of dead nodes and orphaned owners; forget fully released nodes."""
    settings, store = runtime.settings, runtime.store

    def release(conn: Any) -> int:
        return store.release_owned(conn, store.dead_owners(conn), settings.recover_batch_size, utcnow())

    released, _ = in_batches(runtime, settings.recover_batch_size, max_batches, release)
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

    released = in_batches(runtime, settings.recover_batch_size, max_batches, release)[0]
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
