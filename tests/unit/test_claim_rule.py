"""The claim rule with an in-process worker, on SQLite and on a real PostgreSQL: a claim never
outlives the attempt that holds the message, and a store outage anywhere sends the message back.

Real worker processes, real connection faults: tests/faults/test_connection_faults.py.
"""

from __future__ import annotations

import threading

import pytest
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Reject
from sqlalchemy import insert, text

from celery_outbox import IdempotentTask

from ..brokers import copy_options
from ..services import wait_until
from .consumer.test_inbox import Harness


@pytest.fixture
def harness(database_url, table_prefix):
    harness = Harness(database_url, table_prefix, outbox_node_heartbeat_interval=0.2)
    yield harness
    harness.close()
    from ..conftest import drop_store

    harness.metadata.drop_all(harness.outbox.engine)
    drop_store(harness.outbox.store)
    harness.outbox.engine.dispose()


def threaded_worker(harness: Harness, concurrency: int = 2):
    return start_worker(harness.app, pool="threads", concurrency=concurrency, perform_ping_check=False,
                        shutdown_timeout=10, queues=[harness.queue])


def dead_letters(harness: Harness) -> int:
    return harness.outbox.store.count_dead_letters()


def test_a_copy_meeting_a_running_eager_claim_goes_back_until_the_claim_is_handled(harness):
    """The copy arrives while the first attempt's body runs (its node alive): it is not acked as a
    duplicate but handed back to the broker (REJECTED, requeued) until the first is handled;
    then it is discarded (IGNORED). The body runs once."""
    release = threading.Event()

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.slow_eager", shared=False)
    def slow_eager(self):
        harness.runs.append((self.request.id, self.request.retries))
        assert release.wait(30)
        self.connection.execute(insert(harness.effects).values(note="slow"))

    slow_eager.idempotency = "eager"
    with threaded_worker(harness):
        slow_eager.apply_async(**copy_options("slow-1"))
        wait_until(lambda: harness.runs, message="the first body running")
        slow_eager.apply_async(**copy_options("slow-1"))
        harness.wait_for_states("slow-1", 1, timeout=30)
        assert harness.states["slow-1"] == ["REJECTED"], "the copy went back to the broker, not acked"
        release.set()
        wait_until(lambda: {"SUCCESS", "IGNORED"} <= set(harness.states.get("slow-1", [])), timeout=30,
                   message="the first attempt done and the copy discarded")
    # the copy goes back as long as the claim runs, and is discarded once it is handled (the duplicate
    # count below says so); the two worker threads record their states in either order
    states = harness.states["slow-1"]
    assert set(states) == {"REJECTED", "SUCCESS", "IGNORED"}, states
    assert (states.count("SUCCESS"), states.count("IGNORED")) == (1, 1), states
    assert harness.runs == [("slow-1", 0)], "the body ran once"
    assert harness.effect_count() == 1
    assert harness.outbox.store.get_incoming("slow-1").duplicates == 1


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_reject_requeue_in_the_body_sends_the_message_back_and_it_runs_again(harness, style):
    """``Reject(requeue=True)`` (Celery's idiom for acks_late tasks) rolls the attempt back and
    releases its claim: the requeued message runs, not discarded as a duplicate."""

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.reject_once", shared=False)
    def reject_once(self):
        harness.runs.append((self.request.id, self.request.retries))
        self.connection.execute(insert(harness.effects).values(note=str(len(harness.runs))))
        if len(harness.runs) == 1:
            raise Reject("not yet", requeue=True)

    reject_once.idempotency = style
    with harness.worker():
        reject_once.apply_async(task_id="reject-1")
        assert harness.wait_for_states("reject-1", 2) == ["REJECTED", "SUCCESS"]
    assert len(harness.runs) == 2
    assert harness.effect_count() == 1, "the rejected attempt's write rolled back"
    row = harness.outbox.store.get_incoming("reject-1")
    assert (row.status, row.owner, row.duplicates) == ("handled", 0, 0)
    assert dead_letters(harness) == 0


def test_reject_without_requeue_ends_an_eager_claim(harness):
    """``Reject(requeue=False)``: the broker drops (or dead-letters) the message, as in plain Celery;
    the claim ends as ``dead`` instead of staying ``running`` for recovery to bring back."""

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.reject_for_good", shared=False)
    def reject_for_good(self):
        raise Reject("never", requeue=False)

    reject_for_good.idempotency = "eager"
    with harness.worker():
        reject_for_good.apply_async(task_id="reject-2")
        assert harness.wait_for_states("reject-2", 1) == ["REJECTED"]
    row = harness.outbox.store.get_incoming("reject-2")
    assert (row.status, row.owner) == ("dead", 0)
    assert row.keep_until is not None


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_connection_dropped_inside_the_body_sends_the_message_back(harness, style):
    """The body's own connection (``self.connection``) is cut by the server: the task does not
    fail and nothing is dead-lettered; the message goes back and the next attempt commits once."""
    if not harness.outbox.store.is_postgres:
        pytest.skip("cutting a session from the server is PostgreSQL's (pg_terminate_backend)")

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.cut", shared=False)
    def cut(self):
        harness.runs.append((self.request.id, self.request.retries))
        self.connection.execute(insert(harness.effects).values(note=str(len(harness.runs))))
        if len(harness.runs) == 1:
            self.connection.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    cut.idempotency = style
    with harness.worker():
        cut.apply_async(task_id="cut-1")
        assert harness.wait_for_states("cut-1", 2, timeout=30) == ["REJECTED", "SUCCESS"]
    assert harness.failures == []
    assert harness.effect_count() == 1
    assert dead_letters(harness) == 0
    assert harness.outbox.store.get_incoming("cut-1").status == "handled"


def test_an_eager_claim_the_attempt_cannot_release_is_released_by_its_node(harness, monkeypatch):
    """The eager finish meets an outage and so does the release of its claim (the database is
    unreachable): the claim stays running under this live node, so the requeued copy goes back
    to the broker; the node's heartbeat thread releases the claim once the store answers, and
    the copy runs. Nothing is acked away; the effect is written once."""
    from sqlalchemy.exc import OperationalError

    store = harness.outbox.store
    finish, release = store.finish_incoming, store.release_claim
    failed = {"finish": 0, "release": 0}

    def down(what):
        failed[what] += 1
        raise OperationalError("UPDATE ...", {}, Exception("connection refused"))

    def finish_down_once(*args, **kwargs):
        return down("finish") if not failed["finish"] else finish(*args, **kwargs)

    def release_down_once(*args, **kwargs):
        return down("release") if not failed["release"] else release(*args, **kwargs)

    monkeypatch.setattr(store, "finish_incoming", finish_down_once)
    monkeypatch.setattr(store, "release_claim", release_down_once)

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.unreleased", shared=False)
    def unreleased(self):
        harness.runs.append((self.request.id, self.request.retries))
        self.connection.execute(insert(harness.effects).values(note=str(len(harness.runs))))

    unreleased.idempotency = "eager"
    with harness.worker():
        unreleased.apply_async(task_id="unreleased-1")
        wait_until(lambda: "SUCCESS" in harness.states.get("unreleased-1", []), timeout=30,
                   message="the copy run after the node released the claim")
    assert failed == {"finish": 1, "release": 1}
    states = harness.states["unreleased-1"]
    assert "IGNORED" not in states and states[-1] == "SUCCESS", states
    assert len(harness.runs) == 2, "the copy ran once the claim was released"
    assert harness.effect_count() == 1
    row = store.get_incoming("unreleased-1")
    assert (row.status, row.owner, row.duplicates) == ("handled", 0, 0)


def test_an_engine_pool_that_cannot_hand_out_a_connection_is_an_outage(database_url, table_prefix):
    """More busy tasks than the engine's pool holds (a threads pool, a pool the user sized): a task
    that cannot get a connection in time goes back to the broker; none fails, none is lost."""
    from ..conftest import drop_store

    liveness = 1 if database_url.startswith("postgresql") else 0
    harness = Harness(database_url, table_prefix, outbox_engine_options={
        "pool_size": 1 + liveness, "max_overflow": 0, "pool_timeout": 0.2})
    try:
        @harness.app.task(base=IdempotentTask, bind=True, name="shop.busy", shared=False)
        def busy(self, n):
            self.connection.execute(insert(harness.effects).values(note=str(n)))
            threading.Event().wait(0.3)  # holds its connection while the others ask for one

        with threaded_worker(harness, concurrency=4):
            for n in range(8):
                busy.apply_async((n,), task_id=f"busy-{n}")
            wait_until(lambda: all("SUCCESS" in harness.states.get(f"busy-{n}", []) for n in range(8)),
                       timeout=90, message="every task succeeded")
        assert "REJECTED" in [s for n in range(8) for s in harness.states[f"busy-{n}"]], "no task met the limit"
        assert harness.failures == []
        assert harness.effect_count() == 8
        assert harness.outbox.store.count_dead_letters() == 0
    finally:
        harness.close()
        harness.metadata.drop_all(harness.outbox.engine)
        drop_store(harness.outbox.store)
        harness.outbox.engine.dispose()


@pytest.mark.parametrize("durable", [False, True], ids=["plain-queue", "durable-queue"])
@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_an_attempt_takes_one_pooled_connection_at_a_time(database_url, table_prefix, style, durable):
    """With a pool of one connection (beside the node's liveness one) and no overflow, every way
    an attempt ends works, in each style, from a plain and from a durable queue: a failure is
    dead-lettered, a retry takes its claim over and commits with the message its body sent (published
    once), and a copy is discarded. An attempt that held its connection while it asked the pool for
    a second (to record how it ended, to store the retry surviving its rollback, to claim a key that
    exists, to read why it could not) waited on the pool, timed out and counted as an outage: its
    message went back to the broker, again and again."""
    from sqlalchemy import func, select

    from ..conftest import drop_store

    liveness = 1 if database_url.startswith("postgresql") else 0
    queue, sink = f"q_{table_prefix}", f"sink_{table_prefix}"
    harness = Harness(database_url, table_prefix, queue=queue, outbox_durable_queues=[sink] + [queue] * durable,
                      outbox_engine_options={"pool_size": 1 + liveness, "max_overflow": 0, "pool_timeout": 0.5})
    try:
        @harness.app.task(base=IdempotentTask, bind=True, name="shop.one_connection", shared=False)
        def one_connection(self, outcome):
            self.connection.execute(insert(harness.effects).values(note=f"{outcome}-{self.request.retries}"))
            harness.app.send_task("shop.sink", (outcome, self.request.retries), queue=sink)
            if outcome == "fails":
                raise ValueError("the body fails")
            if not self.request.retries:
                raise self.retry(countdown=0)

        one_connection.idempotency = style
        with harness.worker():
            one_connection.apply_async(("fails",), **copy_options("fails-1"))
            one_connection.apply_async(("retries",), **copy_options("retries-1"))
            assert harness.wait_for_state("fails-1", "FAILURE", timeout=30) == ["FAILURE"]
            assert harness.wait_for_states("retries-1", 2, timeout=30) == ["RETRY", "SUCCESS"]
            one_connection.apply_async(("retries",), **copy_options("retries-1"))  # the broker delivering it again
            assert harness.wait_for_states("retries-1", 3, timeout=30)[-1] == "IGNORED"
        assert dead_letters(harness) == 1
        assert harness.outbox.store.get_incoming("fails-1").status == "dead"
        assert harness.outbox.store.get_incoming("retries-1").status == "handled"
        with harness.outbox.engine.begin() as conn:
            notes = conn.execute(text(f"SELECT note FROM {table_prefix}effects")).scalars().all()
            outgoing = harness.outbox.store.tables.outgoing
            to_sink = conn.execute(select(func.count(), func.count(outgoing.c.sent_at))
                                   .where(outgoing.c.destination == sink)).one()
        assert notes == ["retries-1"], "the failure and the first attempt rolled back; the retry committed"
        assert tuple(to_sink) == (1, 1), "the retry's message to the sink stored and published; no other"
    finally:
        harness.close()
        harness.metadata.drop_all(harness.outbox.engine)
        drop_store(harness.outbox.store)
        harness.outbox.engine.dispose()
