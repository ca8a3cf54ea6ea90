"""``Store``: the tables of one table prefix on one engine, and every statement run on them.

``Store`` is composed of one class per table family, each in a module of its own: ``migration``,
``outgoing`` (the outbox and the records of its sends), ``incoming`` (the inbox's claims),
``incoming_upkeep`` (what recovery and cleanup run on the inbox), ``dead_letters``, ``nodes``,
``status`` and ``inspection``. They build on ``base.StoreBase`` (the engine, ``begin``, the
errors); ``incoming`` and ``outgoing`` also on ``one_message.OneMessage``, which with ``pipeline``
is the only code that touches psycopg's internals. Transaction boundary: a method that takes a
``conn`` runs inside the caller's transaction and never commits unless its module says so; a
method without one opens its own short transaction.
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
