"""The statements of the ``nodes`` table: worker processes, their heartbeats, declaring them dead.

Transaction boundary: ``register_node``, ``heartbeat`` and ``deregister_node`` each run in a
transaction of their own (``register_node`` given a ``conn`` begins and commits one on it);
``hold_liveness_lock`` and ``ping_liveness`` run on the node's liveness connection, and the
advisory lock they take or check is the session's and outlives that transaction. ``check_nodes``,
``dead_nodes``, ``dead_owners``, ``forget_released_nodes``, ``release_owned``, ``release_claim``
and ``release_claim_of_process`` run inside the caller's transaction (a recover run, an attempt
giving a claim up, a process seen dying) and never commit.
"""

from __future__ import annotations

from datetime import datetime
from typing import Sequence

from sqlalchemy import Connection, Integer, bindparam, delete, func, literal_column, select, update
from sqlalchemy.dialects import postgresql

from ..vocabulary import Attempt
from .base import StoreBase, utcnow
from .schema import UNOWNED, is_running

__all__ = ["LIVENESS_KEEPALIVES", "NodeStatements"]

# The server's TCP keepalives on a node's liveness session (PostgreSQL): the first probe after 30 s
# of silence, then every 10 s, the session ended after 9 unanswered ones (about two minutes)
LIVENESS_KEEPALIVES = {"tcp_keepalives_idle": 30, "tcp_keepalives_interval": 10, "tcp_keepalives_count": 9}


class NodeStatements(StoreBase):
    """The statements of the ``nodes`` table."""

    def register_node(self, name: str, hostname: str, pid: int, now: datetime | None = None,
                      conn: Connection | None = None, lock_key=None) -> int:
        """Insert a node row and return its id.

        With ``conn`` and ``lock_key`` (PostgreSQL), the row is inserted on ``conn``
        and the node's session advisory lock is taken before the commit: no recover
        run can see the node without its liveness lock held.
        """
        at = self._clock(now)
        table = self.tables.nodes
        statement = (
            table.insert().values(name=name, hostname=hostname, pid=pid, started_at=at, heartbeat_at=at)
            .returning(table.c.id)
        )
        if conn is None:
            with self.begin() as own:
                return own.execute(statement).scalar_one()
        with conn.begin():
            self._watch_for_a_vanished_client(conn)
            node_id = conn.execute(statement).scalar_one()
            conn.execute(select(func.pg_advisory_lock(lock_key(node_id))))
        return node_id

    def heartbeat(self, node_id: int, now: datetime | None = None) -> bool:
        """Record a heartbeat, at the database's clock (``database_now``) unless ``now`` is given;
        False when the node is gone or was declared dead."""
        table = self.tables.nodes
        with self.begin() as conn:
            return conn.execute(
                update(table).where(table.c.id == node_id, table.c.dead_at.is_(None))
                .values(heartbeat_at=self._clock(now), stale_checks=0, checked_at=None)
            ).rowcount == 1

    def _watch_for_a_vanished_client(self, conn: Connection) -> None:
        """PostgreSQL: the server probes the liveness session's client (``LIVENESS_KEEPALIVES``), so
        that a host that vanished loses its liveness lock within about two minutes. A process that
        is only paused (SIGSTOP, a cgroup freeze, a body holding the GIL) keeps it: its kernel
        answers the probes."""
        for name, value in LIVENESS_KEEPALIVES.items():
            conn.execute(select(func.set_config(name, str(value), False)))

    def hold_liveness_lock(self, conn: Connection, lock_key: int) -> bool:
        """Take the node's session-level liveness lock on ``conn`` (PostgreSQL), outside any
        transaction; False when another session holds it now."""
        with conn.begin():
            self._watch_for_a_vanished_client(conn)
            return bool(conn.execute(select(func.pg_try_advisory_lock(lock_key))).scalar_one())

    def ping_liveness(self, conn: Connection) -> None:
        """One round trip on the node's liveness connection, outside any transaction: raises
        when the server ended its session (and with it the session's liveness lock)."""
        with conn.begin():
            conn.execute(select(literal_column("1")))

    def deregister_node(self, node_id: int) -> None:
        """Release every inbox claim the node owns and delete it."""
        t = self.tables
        now = utcnow()
        with self.begin() as conn:
            conn.execute(update(t.incoming).where(is_running(t.incoming), t.incoming.c.owner == node_id)
                         .values(owner=UNOWNED, recover_after=now))
            conn.execute(delete(t.nodes).where(t.nodes.c.id == node_id))

    def check_nodes(self, conn: Connection, now: datetime, stale_before: datetime, checks_needed: int,
                    counted_before: datetime, silent_before: datetime | None = None) -> list[int]:
        """One stale check of every live node; returns the ids it declared dead. The instants
        are of the database's clock (``database_now``), as the heartbeats are.

        A node whose heartbeat is older than ``stale_before`` gets one more stale check,
        at most one per check period (a check counted before ``counted_before``), so
        two recover runs at once do not count twice. A node is declared dead when it
        reaches ``checks_needed`` consecutive checks or as soon as it is silent (no heartbeat
        since ``silent_before``), and, on PostgreSQL, only once its process no longer holds its
        liveness lock: a paused process keeps its lock and is never declared dead. A heartbeat
        resets the count. A node whose liveness connection dropped keeps heartbeating and is
        never declared dead for the lock alone.
        """
        table = self.tables.nodes
        conn.execute(
            update(table)
            .where(table.c.dead_at.is_(None), table.c.heartbeat_at < stale_before)
            .where(table.c.checked_at.is_(None) | (table.c.checked_at < counted_before))
            .values(stale_checks=table.c.stale_checks + 1, checked_at=now)
        )
        dead = table.c.stale_checks >= checks_needed
        if self.is_postgres:
            if silent_before is not None:
                dead = dead | (table.c.heartbeat_at < silent_before)
            dead = self._silent_and_unlocked(dead, table.c.id)
        candidates = select(table.c.id).where(table.c.dead_at.is_(None)).where(dead)
        if self.is_postgres:
            candidates = candidates.with_for_update(skip_locked=True)
        ids = list(conn.execute(candidates).scalars())
        if ids:
            conn.execute(update(table).where(self._id_predicate(table.c.id, ids)).values(dead_at=now))
        return ids

    def dead_nodes(self, conn: Connection) -> list[int]:
        """The nodes declared dead and not forgotten yet."""
        table = self.tables.nodes
        return sorted(conn.execute(select(table.c.id).where(table.c.dead_at.is_not(None))).scalars())

    def dead_owners(self, conn: Connection) -> list[int]:
        """Owners whose rows must be released: nodes declared dead, and owner ids with no node
        row at all (orphans). Computed first, so the release runs ``WHERE owner IN (...)``."""
        t = self.tables
        declared = set(self.dead_nodes(conn))
        incoming = t.incoming
        no_node = ~select(t.nodes.c.id).where(t.nodes.c.id == incoming.c.owner).correlate(incoming).exists()
        declared.update(conn.execute(
            select(incoming.c.owner).where(is_running(incoming), incoming.c.owner != UNOWNED).where(no_node).distinct()
        ).scalars())
        return sorted(declared)

    def release_owned(self, conn: Connection, owners: Sequence[int], limit: int, now: datetime) -> int:
        """Release up to ``limit`` inbox claims owned by ``owners``; returns how many.

        Released rows are due for recovery at once (durable queues re-publish them) and
        a redelivered copy may claim them.
        """
        if not owners:
            return 0
        table = self.tables.incoming
        owned = is_running(table) & self._owner_predicate(table.c.owner, owners)
        return self._release_incoming(conn, owned, limit, now)

    def release_claim(self, conn: Connection, message_id: str, destination: str, owner: int,
                      attempt: Attempt, recover_after: datetime, send_id: str = "") -> int:
        """Release ``owner``'s running claim of this attempt (nesting, replays, retries) of the
        message, so that a redelivered copy takes it over; returns how many rows (0: the claim
        was not there, not ours, or already ended). Due for recovery at ``recover_after``: later
        when the broker holds a copy of the message, at once when the envelope is the only one
        left (``OutboxSettings.released_claim_recovery``)."""
        ours = self._running_claim(message_id, destination, attempt, send_id) & (self.tables.incoming.c.owner == owner)
        return self._release_incoming(conn, ours, 1, recover_after)

    def release_claim_of_process(self, conn: Connection, message_id: str, destination: str, hostname: str,
                                 pid: int, attempt: Attempt, recover_after: datetime, send_id: str = "") -> int:
        """``release_claim`` for the nodes of the process ``pid`` on ``hostname`` (a pool process
        its worker saw die), in one statement: whichever of them owns this attempt's running claim
        releases it; returns how many rows. A claim any other node took over stays."""
        nodes = self.tables.nodes
        of_process = select(nodes.c.id).where(nodes.c.hostname == hostname, nodes.c.pid == pid)
        theirs = self._running_claim(message_id, destination, attempt, send_id) \
            & self.tables.incoming.c.owner.in_(of_process)
        return self._release_incoming(conn, theirs, 1, recover_after)

    def _owner_predicate(self, column, owners: Sequence[int]):
        if self.is_postgres:
            return column == func.any(bindparam("owners", list(owners), type_=postgresql.ARRAY(Integer)))
        return column.in_(list(owners))

    def forget_released_nodes(self, conn: Connection) -> int:
        """Delete dead node rows that own nothing any more: no running inbox claim, no outgoing row
        they stored marked sent (``redeliver_rows_of_senders`` hands those to redelivery)."""
        t = self.tables
        owns = (select(t.incoming.c.owner).where(is_running(t.incoming), t.incoming.c.owner == t.nodes.c.id)
                .correlate(t.nodes).exists())
        sends = (select(t.outgoing.c.id).where(t.outgoing.c.sender == t.nodes.c.id, t.outgoing.c.sent_at.is_not(None))
                 .correlate(t.nodes).exists())
        return conn.execute(delete(t.nodes).where(t.nodes.c.dead_at.is_not(None)).where(~owns, ~sends)).rowcount
