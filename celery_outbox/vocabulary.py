"""The closed sets of values celery-outbox writes and reads, and the headers it adds to messages.

No transaction. Inbox statuses, dead-letter reasons, the kinds of archived rows, the headers, the
attempt of a delivery: every layer names these values from here. The bottom of the import graph:
it imports nothing of the package.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

__all__ = ["REDELIVERY_HEADER", "REPLAY_HEADER", "REQUEUE_BACKOFF", "SEND_HEADER", "ArchiveKind", "Attempt",
           "ClaimRelease", "DeadLetterReason", "IdempotencyStyle", "IncomingStatus", "MessageIdentity",
           "RedeliveryReason"]


class IncomingStatus(str, Enum):
    """How far an attempt of a delivered message got (the inbox's ``status`` column). Every status
    but ``running`` is an ended attempt: it has ``handled_at`` and ``keep_until``, and cleanup
    deletes it once ``keep_until`` passes. Write ``.value`` into statements."""

    RUNNING = "running"  #: claimed, its body running (or its claim released: recovery re-publishes it)
    HANDLED = "handled"  #: the body's transaction committed
    RETRIED = "retried"  #: ended in a retry; the next attempt (retries + 1) may claim the message
    DEAD = "dead"  #: failed for good (with a dead letter, unless rejected); a replay may claim it
    REVOKED = "revoked"  #: the worker discarded it unrun (revoked or expired), as Celery does; never runs


class IdempotencyStyle(str, Enum):
    """When an inbox claim commits (``outbox_idempotency_style``, ``IdempotentTask.idempotency``)."""

    OPTIMISTIC = "optimistic"  #: with the body's own writes, in one transaction
    EAGER = "eager"  #: in a transaction of its own, before the body (side effects outside the database)


class MessageIdentity(str, Enum):
    """What makes an incoming message a duplicate (``outbox_message_identity``)."""

    ID = "id"  #: its task id
    ID_AND_DESTINATION = "id_and_destination"  #: its task id and its queue (one message, several queues)


class DeadLetterReason(str, Enum):
    """Why a message ended in dead letters (the ``reason`` column)."""

    FAILED = "failed"  #: the task raised, and will not be retried
    EXPIRED = "expired"  #: a durable message expired before it was published
    MALFORMED = "malformed"  #: the message cannot be run as is: its envelope, headers, id or body
    UNKNOWN_TASK = "unknown_task"  #: no task of that name is registered in the worker
    UNKNOWN_TENANT = "unknown_tenant"  #: it names a tenant ``outbox_tenants`` does not know (default store)
    #: parked in the default store: its tenant's store could not be reached; that tenant's recovery
    #: sends it again, unchanged, once the store is back
    TENANT_UNAVAILABLE = "tenant_unavailable"
    POISON = "poison"  #: the relay failed to publish it too many times
    WORKER_LOST = "worker_lost"  #: the worker running it was lost too many times


class RedeliveryReason(str, Enum):
    """Why the outbox published a sent message again."""

    UNACKNOWLEDGED = "unacknowledged"  #: no inbox acknowledged it in time (delivery tracking)
    WORKER_LOST = "worker_lost"  #: its stored envelope was running on a worker that was lost (recovery)


class ClaimRelease(str, Enum):
    """Why recovery released an inbox claim, for another worker to take over."""

    DEAD_NODE = "dead_node"  #: the node that held it was declared dead (or has no node row)
    STALE = "stale"  #: it was older than ``outbox_inbox_stale_time``


class ArchiveKind(str, Enum):
    """What the rows cleanup hands an archiver are: the table it moves them from, the folder of the
    archive they are written to, and one of the delivery audit's three inputs. ``str()`` and
    formatting give the value, so that an archiver may take a kind for the plain string: a kind
    names its folder and its table as it is."""

    INCOMING = "incoming"  #: ended inbox rows (handled, retried, dead, revoked)
    DEAD_LETTERS = "dead_letters"  #: dead letters past ``outbox_dead_letter_retention``
    SENT = "sent"  #: the record of each durable message's first publish

    def __str__(self) -> str:
        return self.value


class Attempt(NamedTuple):
    """One attempt of a delivered message, ordered as compared: a ``replace`` (``nesting``) outranks
    a dead-letter replay (``replays``), which outranks a Celery retry (``retries``)."""

    nesting: int
    replays: int
    retries: int

    def __str__(self) -> str:
        """``nesting.replays.retries``: how log lines name the attempt."""
        return f"{self.nesting}.{self.replays}.{self.retries}"


#: The header that carries a message's publish identity: one per ``apply_async`` (or ``send_task``),
#: kept by the retries and replacements of the task it sends and by every copy the broker, the relay,
#: redelivery or recovery delivers. The inbox keys a delivery by it with the task id, so a task id sent
#: again is a new message (as in Celery) while a copy of a send is a duplicate.
SEND_HEADER = "celery_outbox_send"

#: The header a dead-letter replay carries: the replay number, part of the attempt.
REPLAY_HEADER = "celery_outbox_replay"

#: The header of a message delivery tracking published again: how many times (not part of the attempt).
REDELIVERY_HEADER = "celery_outbox_redelivery"

#: Seconds to wait before handing a message back to the broker when the database is down, or a copy
#: meets its own running attempt, so a worker does not spin on a message it cannot claim.
REQUEUE_BACKOFF = 1.0

#: Seconds a bookkeeping statement made on the way of other work waits for a row another transaction
#: holds, such as the open transaction of an optimistic attempt running its body: in the worker's
#: main process (a revoked or expired copy's record, a lost process's dead letter, the guard's dead
#: letters) and in a sender (giving back rows whose publish failed). On SQLite, where every
#: transaction takes the one write lock as it begins, the wait is for that lock. Past it the statement
#: gives up and its caller goes on, instead of stalling for the whole of that attempt's body.
BUSY_ROW_WAIT = 1.0


def header_count(value: Any) -> int:
    """A counter header (retries, nesting, replay number) as a whole number; 0 when absent or garbage."""
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        return 0


def attempt_of(headers: Any) -> Attempt:
    """The attempt a task message's headers carry (garbage counts as 0)."""
    headers = headers if isinstance(headers, dict) else {}
    return Attempt(header_count(headers.get("replaced_task_nesting")), header_count(headers.get(REPLAY_HEADER)),
                   header_count(headers.get("retries")))
