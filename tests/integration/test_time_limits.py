"""A task past its hard time limit, with real prefork workers, beat, PostgreSQL and Redis.

Celery fails the task for good (``FAILURE(TimeLimitExceeded)``, its errbacks) and the pool kills
its process. On a durable queue the attempt left an envelope (an eager claim committed before the
body, or a sender's tracked row that the optimistic attempt's rollback put back): unrecorded,
recovery or delivery tracking would publish it again, and the task would run, time out and run
again for good. The worker's main process ends the attempt as ``dead`` with a dead letter, as a
failure does: the body runs once, and no recover pass publishes it again.

With ``acks_late`` and ``acks_on_timeout`` off, Celery hands the message back to the broker
instead (Celery 5.7): the claim the killed process left is released once the pool has killed it,
so that the copy runs at once rather than after recovery."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from celery_outbox.consumer.celery_internals import HANDS_BACK_AT_TIME_LIMIT

from ..apps.inbox_app import TIME_LIMIT
from ..scenario import Scenario
from ..services import require, wait_until


def recover_passes(worker) -> int:
    """Recover runs the worker finished (beat sends one every second here)."""
    return sum(1 for line in worker.log().splitlines() if "Task celery_outbox.recover[" in line and "succeeded" in line)


@pytest.mark.parametrize("task", ["overrun", "overrun_optimistic", "overrun_eager"],
                         ids=["plain-task", "optimistic", "eager"])
def test_a_task_past_its_hard_time_limit_runs_once_and_ends_as_a_dead_letter(postgres_url, table_prefix,
                                                                            tmp_path, task):
    scenario = Scenario(require("redis"), postgres_url, table_prefix, tmp_path, outbox_node_stale_after=1,
                        outbox_recover_interval=1, outbox_redeliver_after=1)
    try:
        durable = scenario.env["TEST_OTHER_QUEUE"]
        worker = scenario.worker(pool="prefork", concurrency=1, queues=[durable, scenario.env["TEST_QUEUE"]])
        scenario.beat()
        getattr(scenario.shop, task).apply_async(("late-1",), task_id="late-1", queue=durable)
        store = scenario.shop.outbox.store
        wait_until(lambda: store.count_dead_letters() == 1, timeout=30,
                   message=f"the dead letter of the attempt past its time limit (log: {worker.log_path})")
        (letter,) = store.list_dead_letters(store.dead_letter_filter())
        assert (letter.message_id, letter.reason, letter.task_name) == ("late-1", "failed", f"inbox.{task}")
        assert letter.exception_type == "TimeLimitExceeded"
        assert str(TIME_LIMIT) in letter.exception_message
        assert store.get_dead_letter(letter.id).body, "the envelope is kept for a replay"
        row = store.get_incoming("late-1")
        assert (row.status, row.owner) == ("dead", 0)
        assert store.count_outgoing() == 0, "the sender's row is acknowledged: delivery tracking stops"
        # recovery and delivery tracking each had their chance (every pass waits a second or less)
        passes = recover_passes(worker)
        wait_until(lambda: recover_passes(worker) >= passes + 5, timeout=30, message="five more recover passes")
        assert len([e for e in scenario.shop.events("late-1") if e.kind == "body"]) == 1, "the body ran once"
        assert scenario.shop.effects("late-1") == [], "the killed attempt's writes rolled back"
        incoming = store.tables.incoming
        with store.begin() as conn:
            statuses = conn.execute(select(incoming.c.status).where(incoming.c.message_id == "late-1")).scalars()
            assert list(statuses) == ["dead"]
    finally:
        scenario.close()


@pytest.mark.skipif(not HANDS_BACK_AT_TIME_LIMIT, reason="before Celery 5.7 the message stays unacknowledged")
@pytest.mark.parametrize("task", ["overrun_once", "overrun_once_eager"], ids=["plain-task", "eager"])
def test_a_task_handed_back_at_its_hard_time_limit_runs_again_at_once(postgres_url, table_prefix, tmp_path, task):
    """The copy Celery hands back finds the killed process's eager claim released: it runs at
    once, and its effects exist once. The first body is deaf to the pool's SIGTERM (as one stuck in
    C code), so its process never deregisters its node: only the SIGKILL ends it. Without the
    release the copy would meet a running claim and go back to the broker (REJECTED) until
    recovery declared the process dead: no beat runs here, and the nodes heartbeat every 10 s, so
    not within the 30 s the test waits."""
    scenario = Scenario(require("redis"), postgres_url, table_prefix, tmp_path, outbox_node_heartbeat_interval=10)
    try:
        durable = scenario.env["TEST_OTHER_QUEUE"]
        worker = scenario.worker(pool="prefork", concurrency=1, queues=[durable])
        getattr(scenario.shop, task).apply_async(("late-2",), task_id="late-2", queue=durable)
        wait_until(lambda: "SUCCESS" in [e.state for e in scenario.shop.events("late-2") if e.kind == "postrun"],
                   timeout=30, message=f"the copy run (log: {worker.log_path})")
        events = scenario.shop.events("late-2")
        assert [e.state for e in events if e.kind == "postrun"] == ["SUCCESS"], "the copy met no running claim"
        assert len([e for e in events if e.kind == "body"]) == 2, "the body ran twice: killed, then the copy"
        assert len(scenario.shop.effects("late-2")) == 1
        assert "passed its hard time limit; the pool killed its process" in worker.log()
        row = scenario.shop.outbox.store.get_incoming("late-2")
        assert (row.status, row.owner) == ("handled", 0)
        assert scenario.shop.outbox.store.count_dead_letters() == 0
    finally:
        scenario.close()
