"""``Store``: the tables of one table prefix on one engine, and every statement run on them.

``Store`` is composed of one class per table family, each in a module of its own: ``migration``
(creating and upgrading the tables), ``outgoing`` (the outbox and the records of its sends),
``incoming`` (the inbox's claims, their release, recovery and expiry), ``dead_letters``, ``nodes``
(worker processes and their liveness), ``status`` (the status report) and ``inspection`` (reads
for the command line and the tests). They all build on ``base.StoreBase`` (the engine, ``begin``,
the errors the store tells apart); the inbox also on ``pipeline.OneMessage``, the one module that
touches psycopg's internals. Each module says the transaction boundary of its statements: a method
that takes a ``conn`` runs inside the caller's transaction and never commits unless its module says
so; methods without one open their own short transaction.
"""

from __future__ import annotations

from .dead_letters import DeadLetterStatements
from .incoming import IncomingStatements
from .incoming_upkeep import IncomingUpkeepStatements
from .inspection import Inspection
from .migration import SchemaStatements
from .nodes import NodeStatements
from .outgoing import OutgoingStatements
from .status import StatusStatements

__all__ = ["Store"]


class Store(SchemaStatements, OutgoingStatements, IncomingStatements, IncomingUpkeepStatements, DeadLetterStatements,
            NodeStatements, StatusStatements, Inspection):
    """The tables of one table prefix on one engine, and every statement run on them."""
