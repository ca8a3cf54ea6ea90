"""What an inbox attempt leaves in transactions of its own, outside the attempt's.

The envelope kept before the body, the record of an attempt that ended (retried, dead with its dead
letter), the count of a discarded copy, a released claim. Transaction boundary: each write is one
short transaction of its own. Guarantee: an envelope committed before the body is re-published by
recovery if the process dies; a failed attempt's record and its dead letter commit together with
the acknowledgment of the sender's rows, or (on an outage) the message goes back to the broker; a
released claim lets the copy run at once.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from ..core import log_fields
from ..core.node import Nodes
from ..core.runtime import Runtime
from ..core.tenancy import using_tenant
from ..message import dead_letter_rows
from ..monitoring import tracing
from ..signals import announce_dead_letters, duplicate_discarded
from ..store import UNOWNED, utcnow
from ..store.outage import is_outage
from ..vocabulary import IncomingStatus
from .claims import Claim, Ended, InboxRows, StoreDown, store_errors
from .delivery import Delivery, dead_letter_row

__all__ = ["AttemptRecords"]

logger = logging.getLogger("celery_outbox.inbox")


class AttemptRecords:
    """Writes what the inbox's attempts leave, in the store of ``runtime``: rows built by ``rows``;
    a claim the store cannot release is handed to ``node``'s heartbeat thread."""

    def __init__(self, runtime: Runtime, rows: InboxRows, node: Nodes):
        self.runtime = runtime
        self.rows = rows
        self.node = node

    def release_claim(self, delivery: Delivery, node_id: int) -> None:
        """The attempt ends without finishing its eager claim, and its message goes back to the
        broker (a store outage, ``Reject(requeue=True)``): release the claim, in a transaction of
        its own, so that the copy takes it over instead of meeting it running. When the database
        cannot be reached for that either, the node's heartbeat thread releases it later; until
        then a copy goes back to the broker again. Recovery waits as ``release_in_store`` says."""
        try:
            self.release_in_store(delivery, node_id)
        except Exception as error:  # noqa: BLE001 - the node's heartbeat thread tries again
            logger.warning("celery-outbox: could not release the claim of %s[%s] (the node releases it when the "
                           "database answers): %s", delivery.task_name, delivery.message_id, error,
                           **log_fields.of_delivery(delivery))
            self.node.release_later(delivery.message_id, delivery.destination, delivery.attempt,
                                    delivery.send_id, delivery.acks_late)

    def put_off_recovery(self, delivery: Delivery) -> None:
        """An optimistic attempt whose envelope committed before the body (``UNOWNED``) hands its
        message back (``Reject(requeue=True)``), and its claim rolled back: the envelope waits for
        recovery as a released eager claim does (``release_in_store``). When the store cannot
        take that, recovery publishes it when it was due (a copy the inbox discards, nothing lost)."""
        try:
            self.release_in_store(delivery, UNOWNED)
        except Exception as error:  # noqa: BLE001 - recovery publishes when it was due: a discarded copy at worst
            logger.warning("celery-outbox: could not put off the recovery of %s[%s], handed back to the broker "
                           "(recovery may publish a copy, which the inbox discards): %s", delivery.task_name,
                           delivery.message_id, error, **log_fields.of_delivery(delivery))

    def release_in_store(self, delivery: Delivery, node_id: int) -> None:
        """Release ``node_id``'s claim of the delivery's row in a transaction of its own, with the
        time recovery may re-publish its envelope (``OutboxSettings.released_claim_recovery``): an
        ``acks_late`` task's message is held by the broker, so recovery waits; otherwise Celery
        acked the message on receipt, and the envelope, due at once, is the message's only copy."""
        store = self.runtime.store
        with store.begin() as conn:
            recover_after = self.runtime.settings.released_claim_recovery(utcnow(), delivery.acks_late)
            store.release_claim(conn, delivery.message_id, delivery.destination, node_id, delivery.attempt,
                                recover_after, delivery.send_id)

    def store_envelope(self, delivery: Delivery, envelope: dict[str, Any], owner: int) -> Claim:
        """Keep this attempt's envelope, committed, before the body runs: if this process dies
        before the attempt ends, recovery re-publishes it after ``outbox_node_stale_after``
        (once the claim of a dead ``owner`` is released). Unowned for an optimistic attempt
        whose message no tracked outgoing row holds (its claim commits with the body); claimed
        by this node for the eager style, which saves it a transaction. In the same transaction
        the sender's sent outgoing row is acknowledged (deleted): from here on the inbox answers
        for the message. ``DUPLICATE`` when the attempt was already claimed or handled, or
        ``IN_FLIGHT`` when a running claim of it may still finish: the same rules as the claim
        itself."""
        store = self.runtime.store
        now = utcnow()
        grace = timedelta(seconds=self.runtime.settings.node_stale_after)
        row = {**self.rows.claim_row(delivery, IncomingStatus.RUNNING, owner, now),
               "recoveries": delivery.redelivered, "recover_after": now + grace, **envelope}
        if owner == UNOWNED:
            del row["claimed_at"]  # nobody has claimed it yet
        with store_errors():  # a new key, the common case: one round trip on PostgreSQL
            if store.store_envelope_alone(row, delivery.message_id, self.rows.acknowledged_destination(delivery),
                                          delivery.attempt, delivery.sent_as):
                return Claim.CLAIMED
        with store_errors(), store.begin(durable=False) as conn:  # the body's commit makes it durable
            if not self.rows.claim_in(conn, row, now):
                return self.rows.not_claimed(conn, delivery)
            self.rows.acknowledge(conn, delivery)  # the inbox has the message now: the sender's row can go
        return Claim.CLAIMED

    def record(self, task: Any, delivery: Delivery, status: IncomingStatus, exc: BaseException | None = None) -> None:
        """After a rollback: remember that this attempt ended (retried, or dead, with a dead letter
        when it failed). A dead attempt whose record meets a store outage is an outage: its
        message goes back to the broker rather than be acked with no dead letter."""
        store = self.runtime.store
        now = utcnow()
        row = self.rows.ended_row(delivery, status, now)
        failed = dead_letter_rows.DeadLetterReason.FAILED
        dead_letters = [] if exc is None else [dead_letter_row(task, delivery, failed, exc, now)]
        try:
            with store.begin() as conn:
                dead_letters = self.rows.record_ended(conn, delivery, row, dead_letters)
            announce_dead_letters(self.runtime.owner, dead_letters)
        except Exception as error:  # noqa: BLE001 - the task's own outcome stands; say what was not recorded
            if status == IncomingStatus.DEAD and is_outage(error, transient=True):
                raise StoreDown(error) from error
            logger.error("celery-outbox: could not record that %s[%s] ended %s: %s",
                         delivery.task_name, delivery.message_id, status, error, **log_fields.of_delivery(delivery))

    def park(self, task: Any, delivery: Delivery, outage: BaseException) -> Ended:
        """The delivery's tenant store is down (``outage``): park its message in the default store,
        a ``tenant_unavailable`` dead letter with the whole envelope, in a transaction of its own, so
        the worker can ack it and go on with other tenants' messages; the tenant's recovery sends it
        again unchanged once its store is back (``maintenance.parked``), and the tenant's inbox
        discards any other copy. ``PARKED``; ``STORE_DOWN`` (the message goes back to the broker)
        when the default store cannot take it either."""
        row = dead_letter_row(task, delivery, dead_letter_rows.DeadLetterReason.TENANT_UNAVAILABLE, outage, utcnow(),
                              description=f"tenant {delivery.tenant!r}: its store cannot be reached: {outage}")
        try:
            with using_tenant(None), store_errors():
                store = self.runtime.ready().store
                with store.begin() as conn:
                    store.insert_dead_letters(conn, [row])
        except StoreDown as down:
            logger.error("celery-outbox: cannot park %s[%s] of tenant %r in the default store either: %s",
                         delivery.task_name, delivery.message_id, delivery.tenant, down.reason,
                         **log_fields.of_delivery(delivery))
            return Ended(Claim.STORE_DOWN, outage)
        announce_dead_letters(self.runtime.owner, [row])
        logger.warning("celery-outbox: %s[%s] parked in the default store: tenant %r's store cannot be reached: %s",
                       delivery.task_name, delivery.message_id, delivery.tenant, outage,
                       **log_fields.of_delivery(delivery))
        return Ended(Claim.PARKED, outage)

    def discard(self, delivery: Delivery) -> BaseException | None:
        """Count the duplicate on its inbox row and, for a durable queue, acknowledge the sender's
        outgoing rows of its attempt, in one transaction. Returns the outage when the store cannot
        be reached (the copy goes back to the broker, to be counted when it comes again); on any
        other store error the discard stands uncounted (a copy whose row cannot be counted must
        not circle for ever)."""
        try:
            with store_errors(), tracing.delivery_span(tracing.Step.DISCARD, delivery), \
                    self.runtime.store.begin(durable=False) as conn:
                self.runtime.store.count_duplicate(conn, delivery.message_id, delivery.destination, delivery.send_id)
                self.rows.acknowledge_if_durable(conn, delivery)  # the inbox has this attempt: stop redelivering it
        except StoreDown as down:
            return down.reason
        except Exception as error:  # noqa: BLE001 - not an outage: the discard stands, uncounted
            logger.warning("celery-outbox: could not record a duplicate of %s: %s", delivery.message_id, error,
                           **log_fields.of_delivery(delivery))
        logger.info("celery-outbox: discarded duplicate %s[%s] from queue %r (attempt %s)",
                    delivery.task_name, delivery.message_id, delivery.queue, delivery.attempt,
                    **log_fields.of_delivery(delivery))
        duplicate_discarded.send(sender=self.runtime.owner, message_id=delivery.message_id,
                                 task_name=delivery.task_name, queue=delivery.queue)
        return None
