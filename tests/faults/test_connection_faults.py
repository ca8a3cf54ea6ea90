"""Connection faults under load: nothing lost, nothing done twice, nothing left pending.

The shop of tests/apps/fault_app.py runs with real producer, worker (prefork, threads, gevent, solo),
maintenance and beat processes (see ``harness``) on real PostgreSQL and Redis, its payment
queue durable, its payments in both idempotency styles (optimistic, and eager every third),
while the database's connections fail:

* every kind of connection (a task's, a node's liveness one, the relay's, the producer's)
  terminated at random moments (``pg_terminate_backend``), with prefork, threads, gevent and
  solo consumers, and with plain Celery tasks on the durable queue;
* the database refusing every connection for 10 s (a proxy that cuts and refuses), then back;
* a failover that moves the database's address: every open connection silent for good (its
  packets dropped, no reset ever comes), new ones served;
* the server ending idle sessions (``idle_session_timeout``), as poolers and cloud databases do:
  every pooled connection and every liveness connection is cut between two uses;
* bodies that raise ``Reject(requeue=True)`` and pool processes lost mid-body
  (``retry_on_worker_lost``), in each style.

A PostgreSQL restart mid-run (the failover case) is in test_service_restarts.py. Each prints the
drills' one line (messages, faults, lost, duplicate effects, discarded, seconds); the invariants
are those of ``harness.assert_invariants``.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import pytest

from ..conftest import SUMMARY_LINE
from ..services import PacketDrop, TcpProxy, require, require_packet_filter
from ..throwaway import ThrowawayPostgres
from ..versions import KOMBU
from .chaos import KINDS, ConnectionKiller
from .harness import FaultRun, assert_invariants, play

#: the threads pool on Redis before kombu 5.7: its event loop is not woken when a task's thread
#: ends, so the worker takes its next message at its next timer, seconds later (plain Celery
#: alike): the drill's 300 messages outlast its settle time
THREADS_ON_REDIS = pytest.param("threads", False, id="threads", marks=pytest.mark.skipif(
    KOMBU < (5, 7), reason="kombu before 5.7 wakes no event loop when a thread ends: a message per timer tick"))

OUTAGE_SECONDS = 10.0


@pytest.fixture
def redis_url():
    return require("redis")


@pytest.mark.parametrize("pool, plain_receipts", [("prefork", False), THREADS_ON_REDIS, ("gevent", False),
                                                   ("solo", False), ("prefork", True)],
                         ids=["prefork", "threads", "gevent", "solo", "plain receipts"])
def test_connections_terminated_at_random(redis_url, tmp_path, record_property, pool, plain_receipts):
    """From a tenth of the orders paid to nine tenths (about 6 s), one session of the next kind in
    turn is terminated every 0.05 to 0.25 s. Every kind is hit; claims, bodies, finishes, releases and
    heartbeats that lose their connection send the message back or try again, never ack it away.
    With plain receipts, the receipts are plain Celery tasks on the durable queue (at least once,
    their effect written when absent): none is lost."""
    database_url = require("postgres")
    kind = f"{pool}, plain receipts" if plain_receipts else pool
    # gevent's pool runs Celery's synchronous loop, which waits out a 2 s drain between batches that
    # one prefetched message each would make: give it a batch worth its concurrency
    prefetch = {"worker_prefetch_multiplier": 8} if pool == "gevent" else {}
    run = FaultRun(f"connections terminated at random ({kind})", tmp_path, redis_url, database_url,
                   orders=150, pace=0.05, body_seconds=0.02, pool=pool, plain_receipts=plain_receipts, **prefetch)
    killer = ConnectionKiller(database_url, {role: run.application_name(role)
                                             for role in ("consumer", "maintenance", "producer")}, run.count_fault,
                              interval=(0.05, 0.25))
    run.at_progress(0.1, killer.start).at_progress(0.9, killer.stop)
    try:
        outcome = play(run, record_property)
    finally:
        killer.stop()
    record_property(SUMMARY_LINE, f"  terminated by kind: {dict(killer.killed)}")
    assert set(killer.killed) >= {"task", "liveness", "producer"}, f"kinds never hit: {killer.killed}"
    assert outcome.kills >= 20, outcome.line()
    assert_invariants(outcome)
    assert set(KINDS) >= set(killer.killed)


def test_database_refusing_connections_for_ten_seconds(redis_url, tmp_path, record_property):
    """Every process reaches PostgreSQL through a proxy that, at 40% of the orders paid, cuts every
    connection and refuses new ones for 10 s. Claims go back to the broker, the producer tries its
    order again, the nodes keep their claims (their heartbeats resume) or lose them to recovery,
    and every effect still commits once."""
    database_url = require("postgres")
    target = urlsplit(database_url.replace("+psycopg", ""))
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    proxied = database_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
    run = FaultRun("database refusing connections for 10 s", tmp_path, redis_url, proxied, orders=120,
                   body_seconds=0.02)
    outage_over = threading.Event()

    def outage() -> None:
        proxy.stop()
        run.count_fault()
        threading.Timer(OUTAGE_SECONDS, lambda: (proxy.start(), outage_over.set())).start()

    run.at_progress(0.4, outage)
    run.settles_when("the database answering again", outage_over.is_set)
    try:
        outcome = play(run, record_property)
    finally:
        proxy.stop()
    assert outage_over.is_set()
    assert_invariants(outcome)


def test_database_address_moving_silences_every_open_connection(redis_url, tmp_path, record_property):
    """Every process reaches PostgreSQL through a proxy. At 40% of the orders paid, the database's
    address moves, as a failover behind a DNS name or a virtual IP does: every connection open then
    goes silent for good (packets dropped both ways: no data, no reset), its server session ended,
    while new connections reach the database. A statement waiting on a silent connection, and a
    pooled or liveness connection pinged, fail within the library's TCP timeouts
    (``POSTGRES_CONNECT_ARGS``) as a dropped connection does: claims go back to the broker, nodes
    take their liveness again, and every effect still commits once."""
    require_packet_filter()
    database_url = require("postgres")
    target = urlsplit(database_url.replace("+psycopg", ""))
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    proxied = database_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
    run = FaultRun("database address moved: open connections silent", tmp_path, redis_url, proxied, orders=120,
                   body_seconds=0.02)
    drop, silenced = PacketDrop(), []

    def failover() -> None:
        silenced.append(proxy.go_silent(drop))
        run.count_fault()

    run.at_progress(0.4, failover)
    try:
        outcome = play(run, record_property)
    finally:
        drop.remove()
        proxy.stop()
    assert silenced and silenced[0] > 0, "connections were open at the failover"
    assert_invariants(outcome)


def test_server_ending_idle_sessions(redis_url, tmp_path, record_property):
    """``idle_session_timeout = 300ms``: every connection idle for longer is ended by the server,
    the liveness connections between two heartbeats among them. Pooled connections are pinged
    and replaced, liveness connections taken again; no node is declared dead for it."""
    with ThrowawayPostgres(idle_session_timeout="300ms") as postgres:
        run = FaultRun("idle_session_timeout 300ms", tmp_path, redis_url, postgres.url, orders=120)
        ended = "terminating connection due to idle-session timeout"
        outcome = play(run, record_property, more_faults=lambda: postgres.count_log(ended))
        assert postgres.count_log(ended) > 0, f"{outcome.line()}: the server ended no idle session"
        assert_invariants(outcome)


@pytest.mark.parametrize("pool, plain_receipts", [("prefork", False), THREADS_ON_REDIS, ("gevent", False),
                                                   ("prefork", True)],
                         ids=["prefork", "threads", "gevent", "plain receipts"])
def test_reject_requeue_and_lost_pool_processes(redis_url, tmp_path, record_property, pool, plain_receipts):
    """The first delivery of every 7th payment raises ``Reject(requeue=True)`` and of another 7th
    kills its own pool process (threads and gevent, whose tasks share the worker's process: only
    the rejects), in both styles: each comes back and commits once. With plain receipts, their
    first deliveries do the same: acked on receipt, they come back from their stored envelopes
    (a rejected claim is released; a lost process's claim is released when its node is dead)."""
    database_url = require("postgres")
    tricks = "reject,worker_lost" if pool == "prefork" else "reject"
    prefetch = {"worker_prefetch_multiplier": 8} if pool == "gevent" else {}
    kind = f"{pool}, plain receipts" if plain_receipts else pool
    run = FaultRun(f"Reject(requeue=True) and lost pool processes ({kind})", tmp_path, redis_url, database_url,
                   orders=105, pool=pool, tricks=tricks, plain_receipts=plain_receipts, **prefetch)
    outcome = play(run, record_property)
    played = run.played
    least = (15 if pool == "prefork" else 10) * (2 if plain_receipts else 1)
    assert played >= least, f"{outcome.line()}: {played} tricks played"
    assert_invariants(outcome)
