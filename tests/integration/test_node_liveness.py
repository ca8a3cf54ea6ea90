"""A node's liveness connection cut by the server while the node lives, on a real PostgreSQL."""

from __future__ import annotations

from celery import Celery
from sqlalchemy import text

from celery_outbox import Outbox
from celery_outbox.core.node import node_lock_key
from celery_outbox.maintenance.recover import detect_dead_nodes

from ..conftest import drop_store
from ..services import wait_until


def lock_holder(outbox: Outbox, node_id: int) -> int | None:
    """The backend pid holding the node's liveness lock, or None."""
    key = node_lock_key(node_id, outbox.store.prefix)
    with outbox.engine.connect() as conn:
        return conn.execute(text(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = :high AND objid = :low AND objsubid = 1"), {"high": key >> 32, "low": key & 0xFFFFFFFF}
        ).scalar()


def terminate(outbox: Outbox, pid: int) -> None:
    with outbox.engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar() is True


def test_a_cut_liveness_connection_is_taken_again_and_the_node_never_declared_dead(postgres_url, table_prefix):
    """The server ends the liveness connection (a failover, ``idle_session_timeout``, a pooler):
    the node's heartbeat goes on, recovery does not declare it dead, and its heartbeat thread
    connects again and takes its lock again, twice in a row."""
    app = Celery("liveness", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=postgres_url, outbox_table_prefix=table_prefix,
                    outbox_node_heartbeat_interval=0.1, outbox_node_stale_after=0.5,
                    outbox_node_stale_checks=1, outbox_recover_interval=0.1)
    outbox = Outbox(app).ready()
    try:
        node_id = outbox.node.id
        holder = wait_until(lambda: lock_holder(outbox, node_id), message="the node holding its lock")
        for _ in range(2):
            terminate(outbox, holder)
            new_holder = wait_until(lambda old=holder: (pid := lock_holder(outbox, node_id)) not in (None, old) and pid,
                                    timeout=10, message="the node holding its lock again on a new connection")
            assert detect_dead_nodes(outbox.runtime) == []
            holder = new_holder
        assert outbox.node.id == node_id, "the node kept its id: never declared dead"
        assert [n.id for n in outbox.store.live_nodes() if n.dead_at is None] == [node_id]
    finally:
        outbox.node.deregister()
        drop_store(outbox.store)
        outbox.engine.dispose()


def test_a_node_whose_process_is_gone_is_declared_dead_once_silent(postgres_url, table_prefix):
    """A node that stops heartbeating and whose lock is gone (its process killed) is declared
    dead without waiting for the stale checks."""
    app = Celery("liveness_dead", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=postgres_url, outbox_table_prefix=table_prefix,
                    outbox_node_heartbeat_interval=0.1, outbox_node_stale_after=60, outbox_node_stale_checks=10)
    outbox = Outbox(app).ready()
    try:
        node_id = outbox.node.id
        wait_until(lambda: lock_holder(outbox, node_id), message="the node holding its lock")
        outbox.node._stop.set()  # the heartbeat thread ends, as it does with its process
        outbox.node._drop_liveness()
        dead = wait_until(lambda: detect_dead_nodes(outbox.runtime), timeout=10, message="the node declared dead")
        assert dead == [node_id]
    finally:
        drop_store(outbox.store)
        outbox.engine.dispose()


def test_the_server_probes_the_liveness_session_so_a_vanished_host_loses_its_lock(postgres_url, table_prefix):
    """The server's own TCP keepalives on the liveness session (``LIVENESS_KEEPALIVES``): a host that
    vanished, whose kernel answers no probe, loses its session and its lock within about two minutes,
    where the operating system's default would wait two hours. A paused process's kernel answers."""
    from celery_outbox.store.nodes import LIVENESS_KEEPALIVES

    app = Celery("liveness_probes", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=postgres_url, outbox_table_prefix=table_prefix)
    outbox = Outbox(app).ready()
    try:
        node_id = outbox.node.id
        wait_until(lambda: lock_holder(outbox, node_id), message="the node holding its lock")
        liveness = outbox.node._liveness_connection
        with liveness.begin():
            settings = {name: int(liveness.execute(text(f"SHOW {name}")).scalar_one())
                        for name in LIVENESS_KEEPALIVES}
        assert settings == LIVENESS_KEEPALIVES
        idle, interval, count = (LIVENESS_KEEPALIVES[name] for name in
                                 ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"))
        assert idle + interval * count <= 150, "a vanished host loses its lock within two and a half minutes"
    finally:
        outbox.node.deregister()
        drop_store(outbox.store)
        outbox.engine.dispose()
