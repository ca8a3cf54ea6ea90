"""Kill the system at every boundary and prove nothing is lost or done twice.

Each scenario runs the shop of tests/apps/fault_app.py with real producer, worker and
beat processes on real PostgreSQL and Redis while a crash point fires (or the worker is
SIGKILLed), lets it settle, and checks the invariants (see ``harness``): nothing lost,
effects exactly once, every redelivered copy discarded and counted, nothing pending.
Each prints one line: messages, kills, lost, duplicate effects, discarded, seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from celery_outbox.core.crashpoints import EXIT_CODE
from celery_outbox.store import utcnow

from ..apps.factory import make_shop
from ..brokers import nothing_more, purge, receive
from ..conftest import SUMMARY_LINE, drop_store
from ..services import free_port, require
from .harness import FaultRun, Outcome, assert_invariants, play


@pytest.fixture
def services():
    return require("redis"), require("postgres")


# Each count makes the processes that reach the point die several times over a run without
# stopping its progress (a prefork child that dies is replaced only after a few seconds).
CRASHPOINTS = {
    "after_claim:15": "the consuming pool processes, inbox row written, body not run",
    "before_commit:25": "the producer and the consuming pool processes, body done, not committed",
    "after_commit:25": "the producer and the consuming pool processes, committed, nothing published",
    "after_publish:20": "the producer and the consuming pool processes (the receipts they send)",
}


@pytest.mark.parametrize("crashpoint", list(CRASHPOINTS))
def test_crash_point_in_the_flow(services, tmp_path, record_property, crashpoint):
    outcome = play(FaultRun(crashpoint, tmp_path, *services, crashpoint=crashpoint), record_property)
    assert outcome.kills > 0, f"{outcome.line()}: the crash point never fired"
    assert_invariants(outcome)


def test_crash_during_relay(services, tmp_path, record_property):
    """The producer cannot reach the broker: every payment waits in the outgoing table for the relay
    in beat's recover task, whose process dies in the middle of a batch every 25 publishes."""
    run = FaultRun("during_relay:25", tmp_path, *services, crashpoint="during_relay:25",
                   producer_broker_url=f"redis://127.0.0.1:{free_port()}/0", outbox_relay_batch_size=10)
    outcome = play(run, record_property)
    assert outcome.kills > 0, f"{outcome.line()}: the crash point never fired"
    assert_invariants(outcome)


def test_crash_during_recover(services, tmp_path, record_property):
    """The consuming worker is SIGKILLed three times while two eager bodies run in it (the receipts
    are plain tasks, eager on the durable queue), and Redis would give its unacked messages back
    only after an hour: recovery re-publishes the stranded envelopes, and dies at every second one
    it publishes."""
    run = FaultRun("during_recover:2", tmp_path, *services, crashpoint="during_recover:2", visibility_timeout=3600,
                   body_seconds=0.05, plain_receipts=True)
    for share in (0.2, 0.45, 0.7):
        run.at_progress(share, run.kill_consumer_in_flight)
    outcome = play(run, record_property)
    # the point fires only after a re-publish: recovery found the stranded envelopes (its marks die
    # with it, so ``recovered`` may well stay 0)
    assert outcome.kills > 3, f"{outcome.line()}: the crash point never fired"
    assert_invariants(outcome)


def test_crash_during_cleanup(services, tmp_path, record_property):
    """Cleanup deletes 3000 expired inbox rows in batches of 100 and dies after every fourth batch,
    before its commit, while orders flow: every expired row goes, no live row does."""
    run = FaultRun("during_cleanup:4", tmp_path, *services, crashpoint="during_cleanup:4",
                   outbox_cleanup_batch_size=100)
    store = run.shop.outbox.store
    now = utcnow()
    with store.begin() as conn:
        conn.execute(insert(store.tables.incoming), [
            {"message_id": f"expired-{n}", "destination": "", "status": "handled", "received_at": now,
             "handled_at": now, "keep_until": now} for n in range(3000)])
    # an inbox row per message (a payment and a receipt per order), none of the expired ones
    run.settles_when("every expired inbox row deleted and every live one kept",
                     lambda: store.count_incoming() == 2 * run.orders)
    outcome = play(run, record_property)
    assert outcome.kills > 0, f"{outcome.line()}: the crash point never fired"
    assert_invariants(outcome)


def test_worker_sigkilled_repeatedly(services, tmp_path, record_property):
    """SIGKILL the consuming worker four times while orders flow, each time while two eager bodies run
    in it (the receipts are plain tasks, eager on the durable queue) beside optimistic ones; Redis
    gives nothing back for an hour, so recovery (the eager attempts' envelopes) and delivery
    tracking (the optimistic attempts' rolled-back claims, the prefetched messages) bring every
    message back."""
    run = FaultRun("worker SIGKILLed x4", tmp_path, *services, visibility_timeout=3600, body_seconds=0.05,
                   plain_receipts=True)
    for share in (0.15, 0.35, 0.55, 0.75):
        run.at_progress(share, run.kill_consumer_in_flight)
    outcome = play(run, record_property)
    assert outcome.kills == 4
    assert outcome.recovered > 0, f"{outcome.line()}: the kills stranded nothing"
    assert_invariants(outcome)


SENDERS = 3


def test_senders_killed_after_their_commit_have_their_messages_sent_within_about_30_seconds(
        services, table_prefix, record_property):
    """Three writer processes commit a durable message each and die at ``after_commit``, nothing
    published, with every setting at its default (delivery tracking would wait ten minutes).
    Recovery runs every ``outbox_recover_interval``, as beat runs it: it declares each writer's
    node dead once its heartbeat falls silent and its liveness lock is free, and makes the rows
    it stored due for redelivery at once. The line gives the longest delay from a writer's death
    to the broker having its message; the bound is the silence window, two recover intervals
    and a few seconds for the processes."""
    redis_url, postgres_url = services
    root = Path(__file__).parents[2]
    shop = make_shop(redis_url, postgres_url, table_prefix)
    shop.outbox.ready()
    settings = shop.outbox.settings
    bound = 3 * settings.node_heartbeat_interval + 2 * settings.recover_interval + 5
    outcome = Outcome(f"{SENDERS} senders killed after their commit, default settings")
    started = time.monotonic()
    stop, passes = threading.Event(), []
    try:
        env = dict(os.environ, PYTHONPATH=str(root), CELERY_OUTBOX_CRASHPOINT="after_commit")
        writers = [subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.apps.crashing_writer import main; main(*sys.argv[1:])",
             redis_url, postgres_url, table_prefix, shop.durable_queue, "default"],
            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(SENDERS)]
        died: dict[str, float] = {}
        for writer in writers:
            out, err = writer.communicate(timeout=60)
            died[out.strip().splitlines()[-1]] = time.monotonic()
            assert writer.returncode == EXIT_CODE, err
        outcome.kills = outcome.messages = len(died)

        def beat() -> None:  # what beat runs, at its interval
            while not stop.is_set():
                passes.append(shop.outbox.recover())
                stop.wait(settings.recover_interval)

        recovering = threading.Thread(target=beat, name="recover-every-interval", daemon=True)
        recovering.start()
        arrived: dict[str, float] = {}
        for message in receive(shop.app, shop.durable_queue, SENDERS, timeout=bound + 30):
            arrived.setdefault(message.id, time.monotonic())
        assert nothing_more(shop.app, shop.durable_queue), "each message was published once"
        outcome.lost = len(set(died) - set(arrived))
        outcome.recovered = sum(result.sends_of_dead_nodes for result in passes)
        outcome.nodes_declared_dead = sum(len(result.nodes_declared_dead) for result in passes)
        outcome.longest_delay = max(arrived[message_id] - died[message_id] for message_id in arrived)
        outcome.seconds = time.monotonic() - started
    finally:
        stop.set()
        record_property(SUMMARY_LINE, outcome.line())
        purge(shop.app, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()
    line = outcome.line()
    assert outcome.lost == 0, line
    assert outcome.nodes_declared_dead == SENDERS and outcome.recovered == SENDERS, line
    assert all(result.redelivered <= SENDERS for result in passes) and sum(r.redelivered for r in passes) == SENDERS
    assert outcome.longest_delay <= bound, f"{line}: longer than {bound:.0f} s"
