"""Every worker is a node, whatever its pool and its tasks' style: a real worker that runs only
optimistic deliveries registers one when it is ready, heartbeats, passes ``outbox check
--min-nodes 1``, keeps its node (and, on PostgreSQL, its liveness session) while its prefork
pool forks new processes, and deregisters at its warm shutdown."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import uuid

import pytest
from celery import Celery
from sqlalchemy import select

from celery_outbox import Outbox

from ..apps import worker_app
from ..brokers import purge
from ..conftest import drop_store
from ..services import wait_until
from ..workers import ROOT, WorkerProcess
from .test_node_liveness import lock_holder


@pytest.fixture(params=["postgres", "sqlite"])
def store_url(request, postgres_url, tmp_path):
    return postgres_url if request.param == "postgres" else f"sqlite:///{tmp_path / 'outbox.db'}"


@pytest.fixture
def shop(redis_url, store_url, table_prefix, tmp_path):
    suffix = uuid.uuid4().hex[:8]
    built = worker_app.create(redis_url, store_url, table_prefix, f"nodes_{suffix}", f"nodes_durable_{suffix}")
    built.outbox.ready()
    built.metadata.create_all(built.outbox.engine)
    built.env = {"TEST_BROKER_URL": redis_url, "TEST_DATABASE_URL": store_url, "TEST_TABLE_PREFIX": table_prefix,
                 "TEST_QUEUE": f"nodes_{suffix}", "TEST_DURABLE_QUEUE": f"nodes_durable_{suffix}"}
    built.durable_queue = f"nodes_durable_{suffix}"
    yield built
    purge(built.app, built.durable_queue)
    built.metadata.drop_all(built.outbox.engine)
    drop_store(built.outbox.store)
    built.outbox.engine.dispose()


def nodes_of(shop, pid: int) -> list:
    return [node for node in shop.outbox.store.live_nodes() if node.pid == pid and node.dead_at is None]


def check_min_nodes(shop, count: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "outbox", "check",
                           "--min-nodes", str(count), "--max-dead-letters", "1000"],
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **shop.env), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def checked(shop, order_id: str) -> bool:
    with shop.outbox.engine.connect() as conn:
        return conn.execute(select(shop.checks.c.order_id).where(shop.checks.c.order_id == order_id)).first() \
            is not None


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_of_optimistic_deliveries_is_a_node_from_ready_to_shutdown(shop, pool, tmp_path):
    worker = WorkerProcess("tests.apps.worker_app", shop.env, pool=pool, concurrency=2,
                           queues=[shop.durable_queue], log_path=tmp_path / "worker.log")
    worker.command += ["--max-tasks-per-child", "1"]  # prefork: a new pool process forked after each task
    worker.start().wait_ready()
    try:
        (node,) = wait_until(lambda: nodes_of(shop, worker.process.pid), message="the worker's node")
        outcome = check_min_nodes(shop, 1)
        assert outcome.returncode == 0, outcome.stdout + outcome.stderr
        holder = lock_holder(shop.outbox, node.id) if shop.outbox.store.is_postgres else None
        for n in range(3):
            order_id = f"order-{n}"
            shop.app.tasks["orders.check_durable"].delay(order_id)
            # each task in a pool process forked for it (--max-tasks-per-child 1): slow on a loaded host
            wait_until(lambda order_id=order_id: checked(shop, order_id), timeout=60,
                       message=lambda order_id=order_id: f"{order_id} checked; the worker's log ends: "
                                                         f"{worker.log()[-2000:]}")
        beat = node.heartbeat_at
        wait_until(lambda: nodes_of(shop, worker.process.pid)[0].heartbeat_at > beat, message="a later heartbeat")
        assert [n.id for n in nodes_of(shop, worker.process.pid)] == [node.id], "the same node all along"
        if holder is not None:
            assert lock_holder(shop.outbox, node.id) == holder, "the pool's forks left its liveness session alone"
        live = [n for n in shop.outbox.store.live_nodes() if n.dead_at is None]
        assert check_min_nodes(shop, len(live) + 1).returncode == 1, "--min-nodes counts the nodes that live"
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]
    assert [n for n in shop.outbox.store.live_nodes() if n.dead_at is None and n.pid != os.getpid()] == [], \
        "the worker and each of its pool processes deregistered at their shutdown (this process sent, as a node)"
    assert f"node {node.name} registered as {node.id}" in worker.log()
    assert f"node {node.id} deregistered" in worker.log()


def test_a_process_forked_from_a_node_leaves_its_liveness_session_alone(postgres_url, table_prefix):
    """A process forked from a node (a prefork pool process, a web server's worker) inherits the
    node's liveness connection: it lets go of its copy of the socket (the descriptor now names
    ``/dev/null``) and never finalizes the connection, so the parent's session and its lock
    outlive whatever the child does with its garbage and its exit."""
    app = Celery("forked_node", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=postgres_url, outbox_table_prefix=table_prefix,
                    outbox_node_heartbeat_interval=0.1)
    outbox = Outbox(app).ready()
    try:
        node_id = outbox.node.id
        holder = wait_until(lambda: lock_holder(outbox, node_id), message="the node holding its lock")
        fd = outbox.node._liveness_connection.connection.dbapi_connection.pgconn.socket
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code, never return into pytest
            code = 1
            try:
                gc.collect()
                forgotten = outbox.node._liveness_connection is None and outbox.node._thread is None
                code = 0 if forgotten and os.readlink(f"/proc/self/fd/{fd}") == os.devnull else 2
            except BaseException:  # noqa: BLE001 - said on stderr, the exit code fails the test
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child forgot the node and let go of its socket"
        assert lock_holder(outbox, node_id) == holder, "the parent's liveness session holds its lock still"
        def heartbeat_at():
            return next(n.heartbeat_at for n in outbox.store.live_nodes() if n.id == node_id)
        beat = heartbeat_at()
        wait_until(lambda: heartbeat_at() > beat, message="the parent's next heartbeat")
        assert outbox.node.id == node_id
    finally:
        outbox.node.deregister()
        drop_store(outbox.store)
        outbox.engine.dispose()
