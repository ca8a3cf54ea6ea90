"""The store's status report: counts by status and destination, the oldest pending rows, the nodes.

Transaction boundary: ``status`` (``Outbox.status``, the ``status`` command) reads everything in
one transaction of its own and writes nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Collection

from sqlalchemy import Connection, case, func, literal, select

from .base import StoreBase, as_utc, utcnow
from .schema import is_running

__all__ = ["DEFAULT_RECENT", "DEFAULT_STUCK_AFTER", "OTHER_TASKS", "StatusStatements"]

#: Seconds a row may wait (an unsent due outgoing row, a running claim) before the status calls it stuck
DEFAULT_STUCK_AFTER = 3600.0
#: The window, in seconds, of the status's count of recent dead letters
DEFAULT_RECENT = 3600.0
#: Where the status counts the dead letters of task names the app does not register
OTHER_TASKS = "other"


class StatusStatements(StoreBase):
    """The status report of the store."""

    def status(self, now: datetime | None = None, stuck_after: float = DEFAULT_STUCK_AFTER,
               recent: float = DEFAULT_RECENT, timeout: float | None = None,
               known_tasks: Collection[str] | None = None) -> dict[str, Any]:
        """Counts per table by status and destination, the oldest pending rows' age, the rows
        waiting longer than ``stuck_after`` seconds, the dead letters of the last ``recent``
        seconds, the nodes.

        With ``known_tasks`` (the app's registered task names), the dead letters of any other task
        name count under ``OTHER_TASKS``: names come from messages, and a sender of hostile ones
        must not make one row (one metric series) each. With ``timeout`` (seconds), no statement
        waits longer for a lock another transaction holds (a ``VACUUM FULL``, a migration,
        ``LOCK TABLE``), nor runs longer, on PostgreSQL: past it the read raises
        (``is_lock_timeout`` or a cancelled statement); on SQLite, which readers never wait for,
        it changes nothing."""
        given = now
        now = now or utcnow()
        t = self.tables
        stuck_before = now - timedelta(seconds=stuck_after)
        with self.begin(lock_wait=timeout if self.is_postgres else None) as conn:
            if timeout is not None and self.is_postgres:
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {max(1, int(timeout * 1000))}")
            incoming = _grouped_counts(conn, t.incoming.c.status, t.incoming.c.queue, ("status", "queue"))
            outgoing = _grouped_counts(conn, _outgoing_state(t.outgoing, now), t.outgoing.c.destination,
                                       ("status", "destination"))
            task = t.dead_letters.c.task_name
            if known_tasks is not None:
                task = case((task.in_(sorted(known_tasks) or [""]), task), else_=literal(OTHER_TASKS)).label("task")
            dead_letters = _grouped_counts(conn, t.dead_letters.c.reason, task, ("reason", "task"))
            oldest_outgoing = as_utc(conn.execute(
                select(func.min(t.outgoing.c.created_at)).where(t.outgoing.c.sent_at.is_(None))
                .where((t.outgoing.c.deliver_at.is_(None)) | (t.outgoing.c.deliver_at <= now))
            ).scalar())
            duplicates, recoveries = conn.execute(
                select(func.coalesce(func.sum(t.incoming.c.duplicates), 0),
                       func.coalesce(func.sum(t.incoming.c.recoveries), 0))
            ).one()
            oldest_incoming = as_utc(conn.execute(
                select(func.min(t.incoming.c.received_at)).where(is_running(t.incoming))
            ).scalar())
            stuck_outgoing = conn.execute(
                select(func.count()).select_from(t.outgoing).where(t.outgoing.c.sent_at.is_(None))
                .where((t.outgoing.c.deliver_at.is_(None)) | (t.outgoing.c.deliver_at <= stuck_before))
                .where(t.outgoing.c.created_at <= stuck_before)
            ).scalar()
            stuck_incoming = conn.execute(
                select(func.count()).select_from(t.incoming).where(is_running(t.incoming))
                .where(t.incoming.c.received_at <= stuck_before)
            ).scalar()
            recent_dead_letters, newest_dead_letter = conn.execute(
                select(func.coalesce(func.sum(case((t.dead_letters.c.failed_at >= now - timedelta(seconds=recent), 1),
                                                   else_=0)), 0),
                       func.max(t.dead_letters.c.failed_at))
            ).one()
            beats_now = self.database_now(conn) if given is None else now  # the heartbeats' clock
            nodes = [
                {
                    "id": row.id,
                    "name": row.name,
                    "hostname": row.hostname,
                    "pid": row.pid,
                    "heartbeat_age_seconds": _age(beats_now, as_utc(row.heartbeat_at)),
                    "heartbeat_at": _timestamp(row.heartbeat_at),
                    "stale_checks": row.stale_checks,
                }
                for row in conn.execute(select(t.nodes).order_by(t.nodes.c.id))
            ]
        return {
            "store": self.describe(),
            "incoming": incoming,
            "outgoing": outgoing,
            "dead_letters": dead_letters,
            "duplicates_discarded": int(duplicates),
            "messages_recovered": int(recoveries),
            "oldest_pending_outgoing_age_seconds": _age(now, oldest_outgoing),
            "oldest_running_incoming_age_seconds": _age(now, oldest_incoming),
            "stuck": {"after_seconds": stuck_after, "outgoing": int(stuck_outgoing), "incoming": int(stuck_incoming)},
            "recent_dead_letters": {"seconds": recent, "count": int(recent_dead_letters)},
            # Unix seconds (None: there is none), for the metrics' gauges: Prometheus takes ages in PromQL
            "timestamps": {"oldest_pending_outgoing": _timestamp(oldest_outgoing),
                           "oldest_running_incoming": _timestamp(oldest_incoming),
                           "newest_dead_letter": _timestamp(newest_dead_letter)},
            "nodes": nodes,
        }


def _grouped_counts(conn: Connection, first, second, names: tuple[str, str]) -> list[dict[str, Any]]:
    """Row counts grouped by two columns, as dicts keyed by ``names`` and ``count``."""
    rows = conn.execute(select(first, second, func.count()).group_by(first, second).order_by(first, second))
    return [{names[0]: a, names[1]: b, "count": count} for a, b, count in rows]


def _outgoing_state(table, now: datetime):
    """The status of an outgoing row now: ``sent`` (awaiting its inbox's acknowledgment),
    ``scheduled`` (held until its eta) or ``pending`` (due, not sent yet)."""
    return case(
        (table.c.sent_at.is_not(None), "sent"),
        ((table.c.deliver_at.is_not(None)) & (table.c.deliver_at > now), "scheduled"),
        else_="pending",
    ).label("status")


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds(), 3)


def _timestamp(moment: datetime | None) -> float | None:
    return None if moment is None else round(as_utc(moment).timestamp(), 3)
