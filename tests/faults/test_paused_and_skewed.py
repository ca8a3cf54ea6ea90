"""A live node is never taken for dead, on real PostgreSQL and Redis: a consuming worker paused
(SIGSTOP of its whole process group) for longer than the nodes' stale window while eager bodies
run in it, and one whose clock runs two minutes behind beat's (libfaketime). The paused worker's
database sessions, and with them its liveness locks, live on; the skewed one's heartbeats are
read on the database's clock. Recovery declares no node dead, takes no running claim over, and no
eager body starts twice."""

from __future__ import annotations

import pytest

from ..services import require
from .harness import FAST_MAINTENANCE, FaultRun, assert_invariants, play

# How long the worker stays stopped: many times the drill's stale window (two stale checks of
# 1.5 s, and a node silent after 1.5 s), and past Redis's visibility timeout of the run (3 s)
PAUSE_SECONDS = 4 * FAST_MAINTENANCE["outbox_node_stale_after"] * FAST_MAINTENANCE["outbox_node_stale_checks"] / 2


@pytest.fixture
def services():
    return require("redis"), require("postgres")


def test_a_worker_paused_past_the_stale_window_keeps_its_claims_and_runs_each_body_once(
        services, tmp_path, record_property):
    run = FaultRun("consumer paused 6 s x2", tmp_path, *services, body_seconds=0.05, plain_receipts=True)
    for share in (0.25, 0.6):
        run.at_progress(share, lambda: run.pause_consumer_in_flight(PAUSE_SECONDS))
    outcome = play(run, record_property)
    assert outcome.kills == 2
    assert outcome.nodes_declared_dead == 0, f"{outcome.line()}: a paused node was declared dead"
    assert outcome.bodies_run_twice == 0, f"{outcome.line()}: an eager body ran twice"
    assert_invariants(outcome)


def test_a_worker_whose_clock_runs_two_minutes_behind_is_never_declared_dead(services, tmp_path, record_property):
    """Checks twice as often as the heartbeats (each heartbeat resets a node's count of stale
    checks): by its own clock's heartbeats the worker would be stale at every check."""
    run = FaultRun("consumer clock -120 s", tmp_path, *services, body_seconds=0.05, plain_receipts=True,
                   consumer_clock=-120.0, outbox_node_heartbeat_interval=1.0, outbox_recover_interval=0.5)
    outcome = play(run, record_property)
    assert outcome.nodes_declared_dead == 0, f"{outcome.line()}: a node with a skewed clock was declared dead"
    assert outcome.bodies_run_twice == 0, f"{outcome.line()}: an eager body ran twice"
    assert_invariants(outcome)
