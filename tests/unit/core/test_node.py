"""A worker's node (``Node.serve_as_worker``) on the embedded store: registered while the worker
runs, registered again after recovery declared it dead, and gone at its shutdown."""

from __future__ import annotations

import os
from datetime import timedelta

from celery import Celery

from celery_outbox import Outbox

from ...services import wait_until


def live_nodes_of_this_process(outbox: Outbox) -> list:
    return [n for n in outbox.store.live_nodes() if n.pid == os.getpid() and n.dead_at is None]


def declare_every_node_dead(outbox: Outbox) -> list[int]:
    """A recovery pass whose stale checks have run out for every node (the database was out of
    reach of this process for longer than ``outbox_node_stale_after``)."""
    store = outbox.store
    with store.begin() as conn:
        later = store.database_now(conn) + timedelta(hours=1)
        return store.check_nodes(conn, later, stale_before=later, checks_needed=1, counted_before=later)


def test_a_worker_node_declared_dead_while_it_runs_registers_again_and_deregisters_at_shutdown(tmp_path):
    app = Celery("serving_node", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'outbox.db'}", outbox_node_heartbeat_interval=0.05)
    outbox = Outbox(app).ready()
    try:
        outbox.node.serve_as_worker()
        (first,) = wait_until(lambda: live_nodes_of_this_process(outbox), message="the worker's node")
        assert declare_every_node_dead(outbox) == [first.id]
        (second,) = wait_until(lambda: [n for n in live_nodes_of_this_process(outbox) if n.id != first.id],
                               message="the worker's node registered again")
        assert outbox.node.id == second.id
        outbox.node.stop_serving()
        assert live_nodes_of_this_process(outbox) == [], "deregistered at the worker's shutdown"
        assert not outbox.node.registered()
    finally:
        outbox.engine.dispose()


def test_a_node_that_is_not_a_workers_waits_for_its_next_claim_once_declared_dead(tmp_path):
    """A web process's node (registered by its first eager claim or durable send) is not kept:
    once declared dead it registers again only when it needs an owner id."""
    app = Celery("lazy_node", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'outbox.db'}", outbox_node_heartbeat_interval=0.05)
    outbox = Outbox(app).ready()
    try:
        first = outbox.node.id
        assert declare_every_node_dead(outbox) == [first]
        wait_until(lambda: not outbox.node.registered(), message="the heartbeat seeing the node declared dead")
        assert live_nodes_of_this_process(outbox) == []
        assert outbox.node.id not in (None, first), "the next claim registers a new node"
    finally:
        outbox.node.deregister()
        outbox.engine.dispose()
