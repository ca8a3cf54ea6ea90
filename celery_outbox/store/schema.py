"""The message store's tables, in SQLAlchemy Core, one ``MetaData`` per table prefix.

No transaction: definitions only (``migration`` creates them). The keys carry the guarantees:
every copy of one send meets the same inbox row (``message_id``, ``destination``, ``send_id``), an
eager claim's ``owner`` names its node (``UNOWNED`` when none), and every predicate a poller or a
cleaner runs has its index, partial where it looks for few rows. Tables, keys and indexes are
described in docs/store.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    literal_column,
    tuple_,
)

__all__ = ["SCHEMA_VERSION", "SEND_ID_SIZE", "Tables", "build_tables", "UNOWNED", "text_problem"]

# 2: the outgoing table's redelivery and scheduling indexes are partial; 3: so are the inbox's
# indexes of claims (owner, claimed_at, recover_after): they hold running rows only; 4: the
# publish identity (``send_id``), in the inbox's primary key and on outgoing rows; 5: the sender
# node on outgoing rows; 6: the eta of a scheduled message on its record of sends (``deliver_at``)
SCHEMA_VERSION = 6
#: the size of a publish identity (a UUID's 32 hex digits, with room to spare)
SEND_ID_SIZE = 64
UNOWNED = 0

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL wants BIGINT for 10^8 rows.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


def _timestamp(name: str, **kwargs) -> Column:
    return Column(name, DateTime(timezone=True), **kwargs)


def _partial_index(name: str, column: Column, where) -> Index:
    """An index of ``column`` over the rows matching ``where`` only (PostgreSQL and SQLite)."""
    return Index(name, column, postgresql_where=where, sqlite_where=where)


def is_running(incoming: Table):
    """``status = 'running'``: the predicate of the inbox's partial indexes, written as a constant.
    A query states it in these very words to reach them: a prepared statement's generic plan (and
    SQLite's planner) can use a partial index only when the query states its predicate literally,
    not as a parameter."""
    return incoming.c.status == literal_column("'running'")


def acknowledged_sends(outgoing: Table, message_id: Any, send_id: Any, attempt: Sequence[Any],
                       destination: Any = None) -> list:
    """The outgoing rows an inbox's row of ``attempt`` (nesting, replays, retries) acknowledges:
    that send's rows up to that attempt, of ``destination`` only when it is not None. Each value
    may be a Python value or a bind parameter; the acknowledgment and the claim that acknowledges
    in its own statement both state it so."""
    predicate = [outgoing.c.message_id == message_id, outgoing.c.send_id == send_id,
                 tuple_(outgoing.c.nesting, outgoing.c.replays, outgoing.c.retries) <= tuple_(*attempt)]
    if destination is not None:
        predicate.append(outgoing.c.destination == destination)
    return predicate


#: the inbox's primary key, as column names
_INCOMING_KEY = ("message_id", "destination", "send_id")


def _incoming_key(table: Table) -> tuple[Any, ...]:
    """The inbox's primary key columns."""
    return tuple(table.c[name] for name in _INCOMING_KEY)


def _envelope_columns() -> list[Column]:
    """The fully built message: everything needed to publish it again, byte for byte."""
    return [
        Column("exchange", String(255), nullable=False, server_default=""),
        Column("routing_key", String(255), nullable=False, server_default=""),
        Column("body", LargeBinary, nullable=True),
        Column("content_type", String(128), nullable=True),
        Column("content_encoding", String(64), nullable=True),
        Column("headers", Text, nullable=True),
        Column("properties", Text, nullable=True),
    ]


@dataclass(frozen=True)
class Tables:
    metadata: MetaData
    incoming: Table
    outgoing: Table
    dead_letters: Table
    nodes: Table
    schema: Table
    sent: Table

    def all(self) -> tuple[Table, ...]:
        return (self.incoming, self.outgoing, self.dead_letters, self.nodes, self.schema, self.sent)


def text_problem(column: Column, value: Any) -> str | None:
    """Why ``column`` cannot hold the string ``value`` on every supported database, or None: longer
    than the column's length, a NUL character (PostgreSQL text and JSON refuse it), a character
    UTF-8 cannot encode (a lone surrogate)."""
    if not isinstance(value, str) or not isinstance(column.type, (String, Text)):
        return None
    length = column.type.length
    if length is not None and len(value) > length:
        return f"it is {len(value)} characters long and the column holds at most {length}"
    if "\x00" in value:
        return "it holds a NUL character, which PostgreSQL cannot store in text"
    if value.isascii():  # nearly every value: UTF-8 encodes it, no need to try
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "it holds a character UTF-8 cannot encode (a lone surrogate)"
    return None


def build_tables(prefix: str = "celery_outbox_", metadata: MetaData | None = None) -> Tables:
    """Define the tables under ``prefix`` in ``metadata`` (a new one when not given)."""
    md = metadata if metadata is not None else MetaData()
    p = prefix

    incoming = Table(
        f"{p}incoming", md,
        Column("message_id", String(255), primary_key=True),
        Column("destination", String(255), primary_key=True),
        Column("send_id", String(SEND_ID_SIZE), primary_key=True, server_default=""),
        Column("task_name", String(255), nullable=False, server_default=""),
        Column("queue", String(255), nullable=False, server_default=""),
        Column("status", String(16), nullable=False),  # an IncomingStatus value
        Column("owner", Integer, nullable=False, server_default=str(UNOWNED)),
        Column("retries", Integer, nullable=False, server_default="0"),
        Column("nesting", Integer, nullable=False, server_default="0"),
        Column("replays", Integer, nullable=False, server_default="0"),  # dead-letter replays of the message
        Column("duplicates", Integer, nullable=False, server_default="0"),
        Column("recoveries", Integer, nullable=False, server_default="0"),
        *_envelope_columns(),
        _timestamp("received_at", nullable=False),
        _timestamp("claimed_at", nullable=True),
        _timestamp("handled_at", nullable=True),
        _timestamp("keep_until", nullable=True),  # never NULL once the attempt ended (not running)
        # durable queues: when recovery may re-publish the stored envelope of an unowned running row
        _timestamp("recover_after", nullable=True),
        Index(f"ix_{p}incoming_keep_until", "keep_until"),  # cleanup: ended rows by expiry
    )
    # The pollers of claims (dead and orphan owners, stale claims, envelopes due for recovery) look
    # for running rows only; a handled row, nearly every row of the table, has no entry in these
    # partial indexes: a claim inserts into the primary key and ``keep_until`` only. A query reaches
    # them by stating ``is_running`` as its predicate. An owner other than ``UNOWNED`` is only ever
    # on a running row: every end of a claim sets it back.
    _partial_index(f"ix_{p}incoming_running_owner", incoming.c.owner, is_running(incoming))
    _partial_index(f"ix_{p}incoming_running_claimed", incoming.c.claimed_at, is_running(incoming))
    _partial_index(f"ix_{p}incoming_running_recover_after", incoming.c.recover_after, is_running(incoming))

    outgoing = Table(
        f"{p}outgoing", md,
        Column("id", _BigId, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("task_name", String(255), nullable=False, server_default=""),
        Column("destination", String(255), nullable=False),
        Column("send_id", String(SEND_ID_SIZE), nullable=False, server_default=""),  # the publish identity
        # the attempt the message carries, so an inbox acknowledges only attempts it has
        Column("nesting", Integer, nullable=False, server_default="0"),
        Column("replays", Integer, nullable=False, server_default="0"),
        Column("retries", Integer, nullable=False, server_default="0"),
        *_envelope_columns(),
        Column("attempts", Integer, nullable=False, server_default="0"),
        Column("last_error", Text, nullable=True),
        _timestamp("created_at", nullable=False),
        _timestamp("deliver_at", nullable=True),  # held until due: durable scheduling
        _timestamp("expires_at", nullable=True),
        # delivery tracking: a sent row stays until the consuming inbox has the message
        _timestamp("sent_at", nullable=True),  # first publish; NULL while pending
        _timestamp("redeliver_at", nullable=True),  # publish again if still unacknowledged by then
        Column("redeliveries", Integer, nullable=False, server_default="0"),
        # the node that stored the row marked sent and publishes it after the commit; NULL once
        # a relay or redelivery has it: when recovery declares that node dead, its rows are due
        Column("sender", Integer, nullable=True),
        Index(f"ix_{p}outgoing_sent", "sent_at", "id"),  # the relay: unsent rows first, by id
        Index(f"ix_{p}outgoing_message", "message_id"),
    )
    # Partial indexes: each holds only the rows its poller looks for, so an INSERT adds no entry to
    # them. (The relay's index stays whole: the statement taking given ids for a publish looks them
    # up through it, and a prepared statement's generic plan for a partial index of unsent rows can
    # scan the whole table while the statistics lag behind a growing backlog.)
    _partial_index(f"ix_{p}outgoing_redelivery", outgoing.c.redeliver_at,  # delivery tracking
                   outgoing.c.redeliver_at.is_not(None))
    _partial_index(f"ix_{p}outgoing_scheduled", outgoing.c.deliver_at, outgoing.c.deliver_at.is_not(None))

    dead_letters = Table(
        f"{p}dead_letters", md,
        Column("id", _BigId, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("destination", String(255), nullable=False, server_default=""),
        Column("task_name", String(255), nullable=False, server_default=""),
        Column("queue", String(255), nullable=False, server_default=""),
        Column("reason", String(32), nullable=False),  # a DeadLetterReason
        Column("exception_type", String(255), nullable=True),
        Column("exception_message", Text, nullable=True),
        Column("traceback", Text, nullable=True),
        Column("retries", Integer, nullable=False, server_default="0"),
        Column("nesting", Integer, nullable=False, server_default="0"),
        Column("replays", Integer, nullable=False, server_default="0"),  # replays of the attempt that failed
        *_envelope_columns(),
        _timestamp("failed_at", nullable=False),
        Column("replay_count", Integer, nullable=False, server_default="0"),  # times this letter was replayed
        _timestamp("replayed_at", nullable=True),
        Index(f"ix_{p}dead_letters_failed_at", "failed_at"),
        Index(f"ix_{p}dead_letters_task", "task_name"),
        Index(f"ix_{p}dead_letters_message", "message_id"),
    )

    sent = Table(
        f"{p}sent", md,  # written only with an archive configured: the delivery audit's record of sends
        Column("id", _BigId, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("destination", String(255), nullable=False),
        Column("task_name", String(255), nullable=False, server_default=""),
        _timestamp("created_at", nullable=False),
        _timestamp("sent_at", nullable=False),
        _timestamp("deliver_at", nullable=True),  # the eta of a message sent with countdown/eta
    )

    nodes = Table(
        f"{p}nodes", md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("name", String(255), nullable=False, unique=True),
        Column("hostname", String(255), nullable=False, server_default=""),
        Column("pid", Integer, nullable=False, server_default="0"),
        _timestamp("started_at", nullable=False),
        _timestamp("heartbeat_at", nullable=False),
        Column("stale_checks", Integer, nullable=False, server_default="0"),  # consecutive stale checks
        _timestamp("checked_at", nullable=True),  # last stale check that counted
        _timestamp("dead_at", nullable=True),  # declared dead: its rows are being released
        Index(f"ix_{p}nodes_heartbeat", "heartbeat_at"),
        sqlite_autoincrement=True,  # a node id is never reused: owner columns must not change meaning
    )

    schema = Table(
        f"{p}schema", md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("version", Integer, nullable=False),
        _timestamp("migrated_at", nullable=False),
    )

    return Tables(md, incoming, outgoing, dead_letters, nodes, schema, sent)
