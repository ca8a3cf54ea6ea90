"""The inbox with real worker processes on PostgreSQL, with Redis and RabbitMQ as brokers."""

from __future__ import annotations

import os
import signal

import pytest
from sqlalchemy import select

from ..brokers import REDIS_RESTORE_SWEEP, copy_options
from ..scenario import Scenario
from ..services import require, wait_until
from ..versions import CELERY


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request):
    return require(request.param)


@pytest.fixture
def scenario(broker_url, postgres_url, table_prefix, tmp_path):
    scenario = Scenario(broker_url, postgres_url, table_prefix, tmp_path)
    yield scenario
    scenario.close()


def states(rows):
    return [e.state for e in rows]


@pytest.mark.parametrize("task", ["pay", "pay_eager"])
def test_same_id_delivered_twice_in_sequence_runs_once(scenario, task):
    scenario.worker()
    send = getattr(scenario.shop, task)
    send.apply_async(("order-1",), **copy_options("order-1"))
    scenario.wait_events("order-1", "postrun", 1)
    send.apply_async(("order-1",), **copy_options("order-1"))
    rows = scenario.wait_events("order-1", "postrun", 2)
    assert states(rows) == ["SUCCESS", "IGNORED"], "a duplicate is IGNORED, not FAILURE"
    assert len(scenario.shop.effects("order-1")) == 1
    assert [e for e in scenario.shop.events("order-1") if e.kind == "failure"] == []
    row = scenario.shop.outbox.store.get_incoming("order-1")
    assert (row.status, row.duplicates) == ("handled", 1)


@pytest.mark.parametrize("task, durable", [("pay", False), ("pay_eager", False), ("pay", True)],
                         ids=["optimistic", "eager", "optimistic-durable-queue"])
def test_same_id_delivered_to_two_workers_at_once_runs_once(scenario, task, durable):
    """Two copies run at once in two workers. Optimistic: the copy's claim waits for the first
    transaction, then the copy is discarded (on a durable queue that claim is the statement that
    also deletes the sender's outgoing rows). Eager: the copy meets the first's running claim,
    whose node is alive, and goes back to the broker (REJECTED, requeued) until that claim is
    handled; then it is discarded. Never two bodies, never a copy acked while the first runs."""
    queues = [scenario.env["TEST_OTHER_QUEUE"]] if durable else None
    scenario.worker(queues=queues)
    scenario.worker(queues=queues)
    send = getattr(scenario.shop, task)
    if durable:
        send = send.signature(queue=queues[0])
    send.apply_async(("order-2", 1.5), **copy_options("order-2"))  # held below the 3 s Redis visibility timeout
    send.apply_async(("order-2", 1.5), **copy_options("order-2"))  # held below the 3 s Redis visibility timeout
    wait_until(lambda: "IGNORED" in states(scenario.shop.events("order-2")), timeout=60,
               message="the copy discarded")
    rows = [e for e in scenario.shop.events("order-2") if e.kind == "postrun"]
    prerun = [e for e in scenario.shop.events("order-2") if e.kind == "prerun"]
    assert len({e.pid for e in prerun}) == 2, "each copy went to its own worker process"
    (success,) = [e for e in rows if e.state == "SUCCESS"]
    assert any(e.at < success.at for e in prerun if e.pid != success.pid), "both copies ran at the same time"
    if task == "pay_eager":
        assert states(rows)[0] == "REJECTED", "eager: the copy goes back to the broker while the first runs"
        assert set(states(rows)) == {"REJECTED", "SUCCESS", "IGNORED"}, states(rows)
        (ignored,) = [e for e in rows if e.state == "IGNORED"]
        assert ignored.at > success.at, "the copy is discarded only once the first attempt is handled"
    else:
        assert states(rows) == ["SUCCESS", "IGNORED"], "optimistic: the copy waits for the first, then is discarded"
    assert len(scenario.shop.effects("order-2")) == 1
    assert len([e for e in scenario.shop.events("order-2") if e.kind == "body"]) == 1
    if durable:
        assert scenario.shop.outbox.store.count_outgoing() == 0, "both copies' sends acknowledged"


def test_a_retry_runs_again(scenario):
    scenario.worker()
    scenario.shop.flaky.apply_async(("order-3",), task_id="order-3")
    rows = scenario.wait_events("order-3", "postrun", 2)
    assert states(rows) == ["RETRY", "SUCCESS"]
    assert [e.attempt for e in scenario.shop.effects("order-3")] == [1], "attempt 0's writes rolled back"


@pytest.mark.parametrize("victim", ["worker", "child"])
@pytest.mark.parametrize("task", ["pay", "pay_eager"])
def test_worker_killed_mid_body_effects_exactly_once(scenario, victim, task):
    """SIGKILL while the body holds uncommitted writes: the message comes back (broker redelivery of
    the same attempt when the whole worker dies; Celery's re-send of a new attempt when only the
    pool child dies) and the effects exist exactly once. For an eager claim, the killed process's
    claim is free as soon as its heartbeat falls silent (its PostgreSQL liveness lock is gone): a copy
    that comes before goes back to the broker (REJECTED), and none is discarded."""
    worker = scenario.worker(pool="prefork", concurrency=1)
    getattr(scenario.shop, task).apply_async(("order-4", 60.0), task_id="order-4")
    (body,) = scenario.wait_events("order-4", "body", 1)
    if victim == "worker":
        worker.kill()
        scenario.worker(pool="prefork", concurrency=1)
    else:
        os.kill(body.pid, signal.SIGKILL)
    wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-4")), timeout=90 + REDIS_RESTORE_SWEEP,
               message="the message run again")
    rows = [e for e in scenario.shop.events("order-4") if e.kind == "postrun"]
    assert set(states(rows)) <= {"REJECTED", "SUCCESS"}, states(rows)
    assert len(scenario.shop.effects("order-4")) == 1
    assert len([e for e in scenario.shop.events("order-4") if e.kind == "body"]) == 2, "the body ran twice"
    incoming = scenario.shop.outbox.store.tables.incoming
    with scenario.shop.outbox.store.begin() as conn:
        rows = conn.execute(select(incoming.c.status).where(incoming.c.message_id == "order-4")).scalars().all()
    assert rows == ["handled"], "the attempt Celery re-sent kept its send's key: no other claim is left running"


@pytest.mark.parametrize("task, durable", [("ship", True), ("pay_eager_handed_back", True),
                                           ("pay_eager_handed_back", False)],
                         ids=["plain-task-durable-queue", "eager-durable-queue", "eager"])
def test_a_lost_attempt_handed_back_to_the_broker_finds_its_claim_released(broker_url, postgres_url, table_prefix,
                                                                           tmp_path, task, durable):
    """Celery hands the attempt of a pool process it saw die back to the broker as it is
    (``reject_on_worker_lost``: an ``acks_late`` plain task, an ``IdempotentTask`` without
    ``retry_on_worker_lost``, every lost attempt before Celery 5.7). The eager claim the dead
    process committed before its body is released by the worker's main process before the message
    goes back: the copy runs at once, and the effects exist once. Without the release the copy
    would meet a running claim and go back to the broker (REJECTED) until the process was
    declared dead: the nodes heartbeat every 10 s here, so not within the 30 s the test waits."""
    scenario = Scenario(broker_url, postgres_url, table_prefix, tmp_path, outbox_node_heartbeat_interval=10)
    try:
        queues = [scenario.env["TEST_OTHER_QUEUE"]] if durable else None
        worker = scenario.worker(pool="prefork", concurrency=1, queues=queues)
        send = getattr(scenario.shop, task)
        send.apply_async(("order-8",), task_id="order-8", **({"queue": queues[0]} if durable else {}))
        wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-8")), timeout=30,
                   message=f"the message run again (log: {worker.log_path})")
        assert states(e for e in scenario.shop.events("order-8") if e.kind == "postrun") == ["SUCCESS"], \
            "the copy met no running claim: it was never sent back"
        assert len([e for e in scenario.shop.events("order-8") if e.kind == "body"]) == 2, "the body ran twice"
        assert len(scenario.shop.effects("order-8")) == 1
        assert "its claim is released for the copy" in worker.log()
        row = scenario.shop.outbox.store.get_incoming("order-8")
        assert (row.status, row.owner) == ("handled", 0)
    finally:
        scenario.close()


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_worker_killed_holding_redis_restore_lock_delays_redelivery_briefly(scenario):
    """Redis: every worker restores a dead worker's unacked messages under kombu's ``unacked_mutex``.
    A worker killed while it holds that lock leaves it held until ``unacked_mutex_expire``; the
    test workers' five seconds (``fast_redelivery``) bound the wait, where kombu's 300 s would
    stop every test's redelivery for five minutes (then the next sweep restores it:
    ``REDIS_RESTORE_SWEEP``)."""
    worker = scenario.worker(pool="prefork", concurrency=1)
    scenario.shop.pay.apply_async(("order-7", 60.0), task_id="order-7")
    scenario.wait_events("order-7", "body", 1)
    with scenario.shop.app.connection_for_write() as connection:
        channel = connection.default_channel
        lock = channel.client.lock(channel.unacked_mutex_key, timeout=channel.unacked_mutex_expire)
        assert lock.acquire(blocking=True, blocking_timeout=10), "the restore lock was taken"
        # never released: its holder is gone, as a worker SIGKILLed mid-sweep
    worker.kill()
    scenario.worker(pool="prefork", concurrency=1)
    wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-7")), timeout=60 + REDIS_RESTORE_SWEEP,
               message="the message run again once the dead holder's lock expired")
    assert len(scenario.shop.effects("order-7")) == 1


def test_id_and_destination_runs_one_id_on_two_queues_twice(broker_url, postgres_url, table_prefix, tmp_path):
    scenario = Scenario(broker_url, postgres_url, table_prefix, tmp_path, identity="id_and_destination")
    try:
        scenario.worker(queues=[scenario.env["TEST_QUEUE"], scenario.env["TEST_OTHER_QUEUE"]])
        for queue in (scenario.env["TEST_QUEUE"], scenario.env["TEST_OTHER_QUEUE"], scenario.env["TEST_QUEUE"]):
            scenario.shop.pay.apply_async(("order-5",), **copy_options("order-5"), queue=queue)
        rows = scenario.wait_events("order-5", "postrun", 3)
        assert sorted(states(rows)) == ["IGNORED", "SUCCESS", "SUCCESS"]
        assert len(scenario.shop.effects("order-5")) == 2
    finally:
        scenario.close()


def publish_raw(app, queue, body, headers, content_type="application/json"):
    with app.connection_for_write() as connection:
        connection.Producer().publish(body, exchange="", routing_key=queue, headers=headers,
                                      content_type=content_type, content_encoding="utf-8",
                                      declare=[app.amqp.queues[queue]])


def test_malformed_messages_are_dead_lettered_and_the_worker_stays_up(scenario):
    durable = scenario.env["TEST_OTHER_QUEUE"]
    worker = scenario.worker(queues=[durable])
    app = scenario.shop.app
    bad = [
        ('[["x"], {}, {}]', {"task": "inbox.pay"}, "malformed", "header 'id'"),
        ('[["x"], {}, {}]', {"task": "inbox.nope", "id": "unknown-1"}, "unknown_task", "not registered"),
        ("{not json", {"task": "inbox.pay", "id": "garbage-1"}, "malformed", "body cannot be decoded"),
        ('[["x"], {}, {}]', {"task": "inbox.pay", "id": "types-1", "retries": "many"}, "malformed", "'retries'"),
        ('[["x"], {}, {}]', {"task": 42, "id": "types-2"}, "malformed", "header 'task'"),
    ]
    for n, (body, headers, _, _) in enumerate(bad):
        publish_raw(app, durable, body, headers)
        scenario.shop.pay.apply_async((f"good-{n}",), task_id=f"good-{n}", queue=durable)
    for n in range(len(bad)):
        scenario.wait_events(f"good-{n}", "postrun", 1)
    store = scenario.shop.outbox.store
    with store.begin() as conn:
        letters = conn.execute(select(store.tables.dead_letters).order_by(store.tables.dead_letters.c.id)).all()
    assert [(letter.reason, letter.queue) for letter in letters] == [(reason, durable) for _, _, reason, _ in bad]
    for letter, (body, _, _, expected) in zip(letters, bad, strict=True):
        assert expected in letter.exception_message
        assert letter.body == body.encode(), "the message is kept as it came"
    assert all(len(scenario.shop.effects(f"good-{n}")) == 1 for n in range(len(bad)))
    assert worker.process.poll() is None, "the worker is still running"


def test_database_down_during_the_claim_is_not_acked(broker_url, postgres_url, table_prefix, tmp_path):
    """The worker's database goes away: the claim fails, the message goes back to the broker, and
    once the database is back the task runs, once."""
    from sqlalchemy.engine import make_url

    from ..services import TcpProxy

    real = make_url(postgres_url)
    proxy = TcpProxy(real.host or "127.0.0.1", real.port or 5432).start()
    proxied_url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    scenario = Scenario(broker_url, proxied_url, table_prefix, tmp_path)
    try:
        scenario.worker()
        scenario.shop.pay.apply_async(("warm-up",), task_id="warm-up")
        scenario.wait_events("warm-up", "postrun", 1)
        proxy.stop()
        scenario.shop.pay.apply_async(("order-6",), task_id="order-6")
        wait_until(lambda: "the message goes back to the broker" in scenario.workers[0].log(), timeout=60,
                   message="the worker to hand the message back")
        proxy.start()
        wait_until(lambda: "SUCCESS" in states(e for e in scenario.shop.events("order-6") if e.kind == "postrun"),
                   timeout=90, message="order-6 to succeed once the database is back")
        assert len(scenario.shop.effects("order-6")) == 1
        assert [e.state for e in scenario.shop.events("order-6") if e.kind == "postrun"].count("SUCCESS") == 1
    finally:
        proxy.start() if proxy._listener is None else None
        scenario.close()
        proxy.stop()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_warm_shutdown_leaves_no_rows_owned_by_the_stopped_node(scenario, pool):
    from sqlalchemy import func, select

    worker = scenario.worker(pool=pool)
    scenario.shop.pay_eager.apply_async(("order-7",), task_id="order-7")
    scenario.wait_events("order-7", "postrun", 1)
    store = scenario.shop.outbox.store
    # the worker's main process is a node; under prefork the pool process that claimed eagerly is one too
    nodes = 2 if pool == "prefork" else 1
    assert len(store.live_nodes()) == nodes, "the worker and the process that claimed eagerly are nodes"
    assert worker.stop() == 0
    assert store.live_nodes() == [], "the stopped node deregistered"
    with store.begin() as conn:
        owned = conn.execute(select(func.count()).select_from(store.tables.incoming)
                             .where(store.tables.incoming.c.owner != 0)).scalar_one()
    assert owned == 0


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery 5.7 added the re-send cap (retry_on_worker_lost); before it "
                    "Celery hands a lost attempt back to the broker every time (docs/inbox.md)")
def test_a_task_that_kills_its_pool_process_past_the_cap_ends_as_a_dead_letter(broker_url, postgres_url,
                                                                               table_prefix, tmp_path):
    """Celery re-sends an attempt whose pool process died (``retry_on_worker_lost``) only while its
    retries are below ``max_retries``; past that it acks the message as failed. The inbox first
    ends it as a dead letter (reason ``worker_lost``): replayable, never a silent ack. (Redis
    gives no unacked message back during the test: each attempt is delivered once.)"""
    scenario = Scenario(broker_url, postgres_url, table_prefix, tmp_path, visibility_timeout=3600)
    try:
        scenario.worker(pool="prefork", concurrency=1)
        scenario.shop.doomed.apply_async(("doomed-1",), task_id="doomed-1")
        store = scenario.shop.outbox.store
        wait_until(lambda: store.count_dead_letters() == 1, timeout=90, message="the worker_lost dead letter")
        (letter,) = store.list_dead_letters(store.dead_letter_filter())
        assert (letter.message_id, letter.reason, letter.task_name) == ("doomed-1", "worker_lost", "inbox.doomed")
        assert letter.retries == 1
        assert store.get_dead_letter(letter.id).body, "the envelope is kept for a replay"
        row = store.get_incoming("doomed-1")
        assert (row.status, row.owner) == ("dead", 0)
        bodies = [e for e in scenario.shop.events("doomed-1") if e.kind == "body"]
        assert len(bodies) == 2, "attempt 0 and its one re-send"
    finally:
        scenario.close()
