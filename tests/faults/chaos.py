"""Connection faults for the drills: PostgreSQL sessions of one kind terminated at random moments.

A ``ConnectionKiller`` runs in a thread of the test process. At random intervals it picks the
next kind of connection in turn and ends one session of that kind with
``pg_terminate_backend``, as a failover, a server-side timeout or a pooler recycling a
connection would. The kinds are told apart by the ``application_name`` each process of the run
connects with (``FaultRun.application_name``) and, for the liveness connections, by the
advisory lock they hold:

* ``task``: a consuming worker's connections other than its liveness one (claims, bodies,
  finishes, records);
* ``liveness``: a node's liveness connection (it holds the node's advisory lock);
* ``relay``: the maintenance worker's (relay, recover, cleanup);
* ``producer``: the producer's units of work.

The interval is drawn from a seeded generator, so a failing run can be replayed.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Callable

import psycopg

KINDS = ("task", "liveness", "relay", "producer")


class ConnectionKiller:
    def __init__(self, admin_url: str, application_names: dict[str, str], on_fault: Callable[[], None],
                 seed: int = 28, interval: tuple[float, float] = (0.1, 0.5), kinds: tuple[str, ...] = KINDS):
        """``application_names``: role (consumer, maintenance, producer) -> application_name;
        ``on_fault`` is called after each session terminated; ``kinds``: the kinds of session
        terminated in turn."""
        self.kinds = kinds
        self.on_fault = on_fault
        self.admin_url = admin_url.replace("postgresql+psycopg://", "postgresql://")
        self.names = application_names
        self.random = random.Random(seed)
        self.interval = interval
        self.killed: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="connection-killer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def total(self) -> int:
        return sum(self.killed.values())

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.random.uniform(*self.interval)):
            kind = self.kinds[turn % len(self.kinds)]
            turn += 1
            try:
                if self._terminate_one(kind):
                    self.killed[kind] += 1
                    self.on_fault()
            except psycopg.Error as exc:  # the server itself is away: the drill goes on
                self.errors.append(f"{kind}: {exc}")

    def _candidates(self, conn: psycopg.Connection, kind: str) -> list[int]:
        holds_lock = ("EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' "
                      "AND l.granted)")
        role = {"task": "consumer", "liveness": "consumer", "relay": "maintenance", "producer": "producer"}[kind]
        lock_clause = holds_lock if kind == "liveness" else f"NOT {holds_lock}"
        rows = conn.execute(
            f"SELECT a.pid FROM pg_stat_activity a WHERE a.application_name = %s AND a.pid <> pg_backend_pid() "
            f"AND {lock_clause}", (self.names[role],)).fetchall()
        return [pid for (pid,) in rows]

    def _terminate_one(self, kind: str) -> bool:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=2) as conn:
            pids = self._candidates(conn, kind)
            if not pids:
                return False
            pid = self.random.choice(pids)
            return bool(conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0])
