"""The store's connections and commits on a real PostgreSQL.

* A pooled connection that sat idle is pinged on checkout and replaced when the server
  dropped it; a connection in steady use is handed out without a ping.
* Bookkeeping transactions (``store.begin(durable=False)``) commit without waiting for
  the WAL flush; every other transaction waits for it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from celery_outbox.store import Store, build_engine
from celery_outbox.store import engine as engine_module


@pytest.fixture
def engine(postgres_url):
    engine = build_engine(postgres_url)
    yield engine
    engine.dispose()


def backend_pid(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT pg_backend_pid()")).scalar_one()


def terminate(postgres_url: str, pid: int, wait: bool = False) -> None:
    """End server process ``pid``; with ``wait``, return once it has ended (``pg_terminate_backend``'s
    timeout, 10 s)."""
    other = build_engine(postgres_url)
    try:
        with other.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid, :timeout)"),
                                {"pid": pid, "timeout": 10000 if wait else 0}).scalar_one()
    finally:
        other.dispose()


def count_pings(engine) -> list[int]:
    pings: list[int] = []
    real = engine.dialect.do_ping
    engine.dialect.do_ping = lambda dbapi_connection: pings.append(1) or real(dbapi_connection)
    return pings


def test_an_idle_connection_the_server_dropped_is_replaced_on_checkout(engine, postgres_url, monkeypatch):
    monkeypatch.setattr(engine_module, "PING_AFTER_IDLE", 0.0)
    pings = count_pings(engine)
    dropped = backend_pid(engine)
    terminate(postgres_url, dropped)
    assert backend_pid(engine) != dropped, "the dropped connection was replaced, the caller saw no error"
    assert pings, "the idle connection was pinged"


def test_a_ping_whose_error_hides_the_lost_connection_still_replaces_it(engine, postgres_url, monkeypatch):
    """On a connection just cut, SQLAlchemy's psycopg ping fails its query, then fails again
    restoring autocommit, with a ProgrammingError, before libpq marks the connection bad: the
    error it was raised while handling tells the connection is gone, and the checkout replaces
    it without an error for the caller."""
    import psycopg

    monkeypatch.setattr(engine_module, "PING_AFTER_IDLE", 0.0)
    dropped = backend_pid(engine)
    real = engine.dialect.do_ping

    def ping_as_on_a_connection_just_cut(dbapi_connection):
        engine.dialect.do_ping = real
        try:
            raise psycopg.OperationalError("connection socket closed")
        finally:
            raise psycopg.ProgrammingError("can't change 'autocommit' now: connection in transaction status ACTIVE")

    engine.dialect.do_ping = ping_as_on_a_connection_just_cut
    terminate(postgres_url, dropped)
    assert backend_pid(engine) != dropped, "the dropped connection was replaced, the caller saw no error"
    assert engine.dialect.do_ping is real, "the checkout pinged"


def test_a_connection_in_steady_use_is_not_pinged(engine, monkeypatch):
    monkeypatch.setattr(engine_module, "PING_AFTER_IDLE", 3600.0)
    pings = count_pings(engine)
    first = backend_pid(engine)
    assert [backend_pid(engine) for _ in range(20)] == [first] * 20, "one pooled connection reused"
    assert pings == []


def test_an_explicit_pool_pre_ping_is_kept(postgres_url):
    engine = build_engine(postgres_url, {"pool_pre_ping": True})
    try:
        assert engine.pool._pre_ping, "SQLAlchemy pings every checkout, as asked"
        assert not engine.pool.dispatch.checkout, "and the idle ping is not added on top"
    finally:
        engine.dispose()


def tcp_options(conn) -> dict[str, int]:
    """The keepalive and user-timeout options of the socket under a pooled connection, as the
    kernel has them."""
    fd = conn.connection.driver_connection.pgconn.socket
    with socket.socket(fileno=os.dup(fd)) as sock:
        return {"keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def test_connections_get_the_librarys_timeouts_and_keepalives(postgres_url):
    """Over TCP, every connection gives up connecting after 5 s, probes the server when idle for
    30 s, and fails when what it sent goes unacknowledged for 30 s (``POSTGRES_CONNECT_ARGS``):
    read off the connection's socket."""
    engine = build_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.connection.driver_connection.info.get_parameters()["connect_timeout"] == "5"
            assert tcp_options(conn) == {"keepalive": 1, "idle": 30, "interval": 10, "count": 3,
                                         "user_timeout_ms": 30_000}
    finally:
        engine.dispose()


def test_given_connect_args_and_the_urls_query_override_the_librarys_options(postgres_url):
    """``outbox_engine_options = {"connect_args": {...}}`` adds to the library's options or overrides
    them, and so does the URL's query: what the user wrote wins."""
    engine = build_engine(postgres_url, {"connect_args": {"prepare_threshold": None, "connect_timeout": 2}})
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver.prepare_threshold is None
            assert driver.info.get_parameters()["connect_timeout"] == "2"
            assert tcp_options(conn)["idle"] == 30
    finally:
        engine.dispose()
    engine = build_engine(make_url(postgres_url).update_query_dict({"keepalives_idle": "45",
                                                                   "tcp_user_timeout": "9000"})
                          .render_as_string(hide_password=False))
    try:
        with engine.connect() as conn:
            options = tcp_options(conn)
            assert (options["idle"], options["user_timeout_ms"], options["interval"]) == (45, 9_000, 10)
    finally:
        engine.dispose()


def synchronous_commit(store: Store, durable: bool) -> str:
    with store.begin(durable=durable) as conn:
        return conn.execute(text("SHOW synchronous_commit")).scalar_one()


def test_bookkeeping_commits_do_not_wait_for_the_wal_flush(engine):
    store = Store(engine, "unused_")
    assert synchronous_commit(store, durable=False) == "off"
    assert synchronous_commit(store, durable=True) == "on"
    assert synchronous_commit(store, durable=True) == "on", "SET LOCAL ended with its transaction"


def test_cleanup_batches_do_not_wait_for_the_wal_flush(postgres_url, table_prefix):
    """A cleanup batch whose commit a crash loses is simply deleted again by the next pass; its
    commit does not wait for the WAL flush, nor hold up the flushes of the inbox's claims."""
    from celery import Celery
    from sqlalchemy import event

    from celery_outbox import Outbox
    from celery_outbox.store import utcnow

    from ..conftest import drop_store
    from .test_store_contract import incoming_row

    outbox = Outbox(Celery("cleanup-commits", broker="memory://", set_as_current=False),
                    database_url=postgres_url, table_prefix=table_prefix, cleanup_batch_size=10)
    store = outbox.ready().store
    past = utcnow() - timedelta(days=1)
    with store.begin() as conn:
        conn.execute(store.tables.incoming.insert(), [
            incoming_row(f"m{n}", status="handled", handled_at=past, keep_until=past) for n in range(25)])
    log: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *rest: log.append(statement))
    event.listen(store.engine, "commit", lambda conn: log.append("COMMIT"))
    try:
        assert outbox.cleanup().incoming_deleted == 25
    finally:
        drop_store(store)
        store.engine.dispose()
    transactions = " ".join(log).split("COMMIT")
    deleting = [t for t in transactions if f"DELETE FROM {store.tables.incoming.name}" in t]
    assert len(deleting) == 3, "three batches of at most 10"
    assert all("synchronous_commit TO OFF" in t for t in deleting), deleting
