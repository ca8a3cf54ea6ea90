"""How an attempt's claim ended (``Claim``, ``Ended``), and the inbox rows both claim paths write.

``InboxRows`` holds the rows and acknowledgments that the claim path (``inbox``) and the worker's
main process (``main_process``) both write. Transaction boundary: none of its own. Each method
given a ``conn`` runs in the caller's open transaction; the guarantee is the claim rule's
(docs/inbox.md): a new attempt, a released claim or a stale one is claimed, an attempt that ended
is a duplicate, and a running claim whose owner may still finish it is in flight.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import Enum
from typing import Any, NamedTuple

from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError

from ..core.runtime import Runtime
from ..store import UNOWNED
from ..store.outage import is_outage
from ..vocabulary import IncomingStatus
from .delivery import Delivery

__all__ = ["Claim", "Ended", "InboxRows", "StoreDown", "store_errors"]


class Claim(Enum):
    """What became of an attempt's claim: each member is how the worker answers the broker."""

    CLAIMED = "claimed"
    """The attempt holds the delivery: its body runs, and the claim commits with its writes."""
    DUPLICATE = "duplicate"
    """The attempt was already handled or ended: the copy is discarded (acked, counted, IGNORED)."""
    IN_FLIGHT = "in_flight"
    """A running claim of the attempt may still finish: the copy goes back to the broker."""
    NOT_HELD = "not_held"
    """No tracked outgoing row of the sender holds the message, or the attempt takes over its key's
    row (optimistic style, durable queue): the claim rolled back; the envelope is committed first."""
    LOST = "lost"
    """The claim was taken over while the body ran: its writes rolled back, the message goes back."""
    STORE_DOWN = "store_down"
    """The store cannot be reached: the message goes back to the broker, nothing is recorded."""
    PARKED = "parked"
    """The delivery's tenant store cannot be reached: the message is parked in the default store
    (acked), and that tenant's recovery sends it again once the store is back."""


class Ended(NamedTuple):
    """How an attempt ended: its claim, and the body's result (``CLAIMED``) or the outage's error
    (``STORE_DOWN``, ``PARKED``)."""

    claim: Claim
    value: Any = None


class InboxRows:
    """The inbox rows of deliveries, and the acknowledgments of their senders' outgoing rows, by the
    settings of ``runtime``: built here, written in the caller's transaction."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def claim_row(self, delivery: Delivery, status: IncomingStatus, owner: int, now: datetime) -> dict[str, Any]:
        """The inbox row of ``delivery`` in ``status``, owned by ``owner`` as of ``now``."""
        status = IncomingStatus(status)
        row = {
            **delivery.key(), "task_name": delivery.task_name, "queue": delivery.queue, "status": status.value,
            "owner": owner, "retries": delivery.retries, "nesting": delivery.nesting,
            "replays": delivery.replays, "received_at": now, "claimed_at": now,
        }
        if status == IncomingStatus.HANDLED:
            row.update(handled_at=now, keep_until=self.keep_until(now))
        else:
            row.update(keep_until=None)
        return row

    def ended_row(self, delivery: Delivery, status: IncomingStatus, now: datetime) -> dict[str, Any]:
        """The row of an attempt that ended ``status`` (retried, dead, revoked) as of ``now``."""
        row = self.claim_row(delivery, status, UNOWNED, now)
        row.update(keep_until=self.keep_until(now), handled_at=now)
        return row

    def keep_until(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.runtime.settings.keep_after_handling)

    def stale_before(self, now: datetime) -> datetime | None:
        stale = self.runtime.settings.inbox_stale_time
        return None if stale is None else now - timedelta(seconds=stale)

    def claim_in(self, conn: Any, row: dict[str, Any], now: datetime, stored: bool = False) -> bool:
        """``Store.claim_incoming`` in the open transaction ``conn``, by the stale and silent times
        as of ``now``."""
        return self.runtime.store.claim_incoming(conn, row, self.stale_before(now),
                                                 self.runtime.settings.silent_before(now), stored=stored)

    def not_claimed(self, conn: Connection, delivery: Delivery) -> Claim:
        """Why a claim failed, read in ``conn``: ``IN_FLIGHT`` when a running claim of this attempt
        may still finish, else ``DUPLICATE``."""
        in_flight = self.runtime.store.claim_in_flight(conn, delivery.message_id, delivery.destination,
                                                      delivery.attempt, delivery.send_id)
        return Claim.IN_FLIGHT if in_flight else Claim.DUPLICATE

    def record_ended(self, conn: Connection, delivery: Delivery, row: dict[str, Any],
                     dead_letters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """In the open transaction ``conn``: record the ended attempt ``row`` with its
        ``dead_letters``, and acknowledge the sender's rows (a rolled-back claim put them back).
        Returns the dead letters stored: none when the key's row is handled (a copy ran
        meanwhile) or a later attempt's, whose outcome is the message's."""
        store = self.runtime.store
        stored = dead_letters if store.record_outcome(conn, row) else []
        store.insert_dead_letters(conn, stored)
        self.acknowledge_if_durable(conn, delivery)
        return stored

    def acknowledge(self, conn: Any, delivery: Delivery) -> None:
        """Delete the sender's outgoing rows of this attempt and earlier ones (delivery tracking)."""
        self.runtime.store.acknowledge_outgoing(conn, delivery.message_id, self.acknowledged_destination(delivery),
                                               delivery.attempt, delivery.sent_as)

    def acknowledge_if_durable(self, conn: Any, delivery: Delivery) -> None:
        """``acknowledge`` for a delivery from a durable queue; one from a plain queue has no
        sender's rows."""
        if self.runtime.settings.is_durable(delivery.queue):
            self.acknowledge(conn, delivery)

    def acknowledged_destination(self, delivery: Delivery) -> str | None:
        """The destination whose outgoing rows the delivery acknowledges: its queue with message
        identity ``id_and_destination``; None (every destination) with identity ``id``."""
        return self.runtime.settings.destination_of(delivery.queue)


class StoreDown(Exception):
    """The one exception of the claim path: the database cannot be reached, translated where our
    statements run (``store_errors``) and from a body's error (``Inbox._ending``), and turned into
    ``Claim.STORE_DOWN`` once (``Inbox._run_delivery``)."""

    def __init__(self, reason: BaseException):
        super().__init__(str(reason))
        self.reason = reason


class store_errors:
    """Turn "the database cannot be reached" during our own statements into ``StoreDown``."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, (OperationalError, InterfaceError)) or is_outage(exc, transient=True):
            raise StoreDown(exc) from exc
        return False
