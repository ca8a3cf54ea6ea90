"""What the worker's main process records for an attempt that ends outside its pool process.

Revoked, expired or terminated (``end_revoked_attempt``), killed past Celery's re-send cap or at its
hard time limit (``end_killed_attempt``), lost and handed back to the broker
(``release_lost_process_claim``). Transaction boundary: each method is one transaction of its own,
which waits a bounded time for the rows another transaction holds (the killed process's, an
attempt running elsewhere). Guarantee: a message whose attempt ended here is neither run again by
recovery nor published again by delivery tracking, and one handed back is claimed by its copy at
once.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any, Callable

from ..core.runtime import Runtime
from ..core.tenancy import using_tenant
from ..errors import OutboxError
from ..signals import announce_dead_letters
from ..store import is_lock_timeout, utcnow
from ..vocabulary import BUSY_ROW_WAIT, IncomingStatus
from .claims import InboxRows
from .delivery import Delivery
from .outages import TenantOutages

__all__ = ["TERMINATED_LOCK_WAIT", "MainProcessOutcomes", "RevokeRecord", "installed_main_process"]

# Seconds the worker's main process waits for a terminated attempt's open transaction to end (the
# killed process's connection closing rolls it back) before it gives up recording the revoke
TERMINATED_LOCK_WAIT = 5.0

_APP_ATTRIBUTE = "_celery_outbox_main_process"


class RevokeRecord(Enum):
    """What became of the record of a revoked, expired or terminated attempt."""

    RECORDED = "recorded"
    """The attempt ended ``revoked`` (or its row kept the outcome it had)."""
    IN_FLIGHT = "in_flight"
    """An attempt of the message runs elsewhere and holds its rows: the revoke stands in this worker,
    unrecorded; the running attempt records its own outcome."""


def installed_main_process(app: Any) -> "MainProcessOutcomes":
    """The main process's outcomes of the outbox installed on ``app``; a clear error when there is none."""
    outcomes = getattr(app, _APP_ATTRIBUTE, None)
    if outcomes is None:
        raise OutboxError(f"no Outbox is installed on app {app.main!r}: call Outbox(app) in your Celery module")
    return outcomes


def in_tenant_of_delivery(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an outcome's statements in the store of its delivery's tenant (``Delivery.tenant``)."""

    @functools.wraps(method)
    def run(self: Any, delivery: Delivery, *args: Any, **kwargs: Any) -> Any:
        with using_tenant(delivery.tenant):
            return method(self, delivery, *args, **kwargs)

    return run


class MainProcessOutcomes:
    """Records, for the worker's main process, how attempts ended outside their pool process: rows
    built by ``rows``, in the store of ``runtime``."""

    def __init__(self, runtime: Runtime, rows: InboxRows, outages: TenantOutages):
        self.runtime = runtime
        self.rows = rows
        self.outages = outages  # the tenants whose messages the consumer parks without a try

    def install(self) -> None:
        """Make these the outcomes the app's worker requests record (``installed_main_process``)."""
        setattr(self.runtime.app, _APP_ATTRIBUTE, self)

    @in_tenant_of_delivery
    def end_killed_attempt(self, delivery: Delivery, dead_letter: dict[str, Any],
                           lock_wait: float = BUSY_ROW_WAIT) -> bool:
        """The worker's pool process running this attempt is gone and Celery fails the task for
        good: it died once too often (Celery re-sends a lost attempt only up to ``max_retries``),
        or the worker killed it at the task's hard time limit. End the attempt as ``dead`` (over
        the running claim the process left, whoever owns it) and keep its message in dead
        letters, and acknowledge the sender's rows, in one transaction: neither recovery nor
        delivery tracking runs it again. A row another transaction holds (the killed process's,
        until the server ends its session) is waited for at most ``lock_wait`` seconds. Raises on
        a store error or that wait running out. False when the key's row is handled (the attempt
        or a copy committed first) or a later attempt's: nothing is dead-lettered."""
        store = self.runtime.store
        row = self.rows.ended_row(delivery, IncomingStatus.DEAD, utcnow())
        with store.begin(lock_wait=lock_wait) as conn:
            dead_letters = self.rows.record_ended(conn, delivery, row, [dead_letter])
        announce_dead_letters(self.runtime.owner, dead_letters)
        return bool(dead_letters)

    @in_tenant_of_delivery
    def release_lost_process_claim(self, delivery: Delivery, hostname: str, pid: int) -> int:
        """The worker saw its pool process ``pid`` die running this attempt, and Celery hands the
        message back to the broker as it is (``reject_on_worker_lost``): release the eager claim
        that process held (the node of ``pid`` on ``hostname``), so that the copy takes it over at
        once instead of going back to the broker until recovery (or, on PostgreSQL, the silence of
        the process's heartbeat) declares the process dead. Returns how many claims it released
        (0: none was running, or another node holds it). A row another transaction holds (the
        dead process's, until the server ends its session) is waited for at most
        ``BUSY_ROW_WAIT``. Raises on a store error: the copy then waits for recovery."""
        store = self.runtime.store
        with store.begin(lock_wait=BUSY_ROW_WAIT) as conn:
            recover_after = self.runtime.settings.released_claim_recovery(utcnow(), handed_back=True)
            return store.release_claim_of_process(conn, delivery.message_id, delivery.destination, hostname, pid,
                                                  delivery.attempt, recover_after, delivery.send_id)

    @in_tenant_of_delivery
    def end_revoked_attempt(self, delivery: Delivery, terminated: bool = False) -> RevokeRecord:
        """The worker discards this delivery unrun (revoked, or expired), or has killed the pool
        process running it (``terminated``: ``revoke(terminate=True)``), as Celery does: end its
        attempt as ``revoked`` and, for a durable queue, acknowledge the sender's outgoing rows, in
        one transaction, before Celery acks the message. A later copy of the attempt (one the
        broker or recovery sends again, to a worker that has forgotten the revoke) is then a
        duplicate, and delivery tracking stops re-publishing it.

        The attempt is recorded by the claim's own rule (``Store.claim_incoming``): a new row, or
        one this delivery could claim (an earlier attempt, a released claim). A row of an attempt
        that is running in a live worker, or that ended, keeps its outcome, except that a
        terminated attempt takes over its own running claim (the killed process's: recovery must
        not run it again). A terminated optimistic attempt's claim is in the killed process's
        open transaction: its row waits for that transaction to end, at most
        ``TERMINATED_LOCK_WAIT`` seconds. A revoked or expired copy waits at most
        ``BUSY_ROW_WAIT`` for rows another transaction holds: an optimistic attempt of the
        message running elsewhere holds its key, and its sender's row, until it ends, and records
        its own outcome; that wait running out is ``IN_FLIGHT``. Raises on a store error (the
        caller logs it; the revoke stands in this worker)."""
        store = self.runtime.store
        now = utcnow()
        row = {**self.rows.ended_row(delivery, IncomingStatus.REVOKED, now), "recover_after": None}
        stale_before = now if terminated else self.rows.stale_before(now)
        try:
            with store.begin(lock_wait=TERMINATED_LOCK_WAIT if terminated else BUSY_ROW_WAIT) as conn:
                store.claim_incoming(conn, row, stale_before, self.runtime.settings.silent_before(now))
                self.rows.acknowledge_if_durable(conn, delivery)
        except Exception as error:
            if not terminated and is_lock_timeout(error):
                return RevokeRecord.IN_FLIGHT
            raise
        return RevokeRecord.RECORDED
