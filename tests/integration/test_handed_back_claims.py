"""A claim released for a message Celery hands back to the broker, on a durable queue.

An eager claim's attempt that ends with its message back in the broker (``Reject(requeue=True)``,
a store outage's send-back, a lost pool process, a hard time limit) releases its claim, so that
the copy takes it over. The broker holds that copy: recovery must not publish the stored envelope
again while it waits in the queue (a second copy, discarded as a duplicate), only once it has
waited as long as delivery tracking waits for a sent message, the net for a copy the broker
lost. A message Celery acked on receipt is handed back by nothing: its envelope, the only copy
left, is published again at once.

The same holds for the envelope an optimistic attempt commits before its body (the message of a
sender without delivery tracking): its claim rolls back, and the envelope waits as long.

Each test's first body stops its worker consuming the durable queue before it rejects, so the
copy waits in the queue while the test runs the recover pass beat would run (``Outbox.recover``).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import Celery

from celery_outbox.store import as_utc, utcnow

from ..brokers import waiting
from ..scenario import Scenario
from ..services import require, wait_until


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request):
    return require(request.param)


def states(events):
    return [e.state for e in events if e.kind == "postrun"]


def _send_without_the_outbox(broker_url: str, task: str, queue: str) -> None:
    """Send as a Celery app without the outbox does: no outgoing row holds the message."""
    sender = Celery("plain_sender", broker=broker_url, set_as_current=False)
    try:
        sender.send_task(task, ("order-1",), task_id="order-1", queue=queue)
    finally:
        sender.close()


def _handed_back(broker_url, postgres_url, table_prefix, tmp_path, task, copies=1, plain_sender=False, **conf):
    """A worker of the durable queue, and ``task``'s first delivery run there, its claim released
    and ``copies`` of its message back in the queue; the worker no longer consumes the queue.
    Returns the scenario, the worker and the queue."""
    scenario = Scenario(broker_url, postgres_url, table_prefix, tmp_path, **conf)
    durable = scenario.env["TEST_OTHER_QUEUE"]
    worker = scenario.worker(pool="prefork", concurrency=1, queues=[durable])
    send = getattr(scenario.shop, task)
    if plain_sender:
        _send_without_the_outbox(broker_url, send.name, durable)
    else:
        send.apply_async(("order-1",), task_id="order-1", queue=durable)
    store = scenario.shop.outbox.store
    wait_until(lambda: (row := store.get_incoming("order-1")) is not None and (row.status, row.owner) == ("running", 0),
               timeout=30, message=f"the first delivery's claim released (log: {worker.log_path})")
    wait_until(lambda: waiting(scenario.shop.app, durable) == copies, timeout=30,
               message=f"{copies} copy in the queue (log: {worker.log_path})")
    return scenario, worker, durable


def _consume_again(scenario, worker, durable) -> None:
    replies = scenario.shop.app.control.add_consumer(durable, destination=[worker.hostname], reply=True, timeout=10)
    assert replies, f"the worker {worker.hostname} answered add_consumer"


@pytest.mark.parametrize("task, first_end, plain_sender", [
    ("hand_back", ["REJECTED"], False), ("hand_back_eager", ["REJECTED"], False), ("lose_process", [], False),
    ("hand_back_optimistic", ["REJECTED"], True),
], ids=["plain-task", "eager", "lost-process", "optimistic-envelope"])
def test_recovery_leaves_alone_a_copy_the_broker_holds(broker_url, postgres_url, table_prefix, tmp_path, task,
                                                       first_end, plain_sender):
    """``Reject(requeue=True)`` of an ``acks_late`` task, or its pool process lost (Celery hands
    the message back as it is): while the copy waits in the queue, a recover pass publishes
    nothing, and the envelope is not due before ``outbox_redeliver_after`` (its node's stale time,
    30 s here, passes first); the copy then runs once, and nothing is discarded."""
    scenario, worker, durable = _handed_back(broker_url, postgres_url, table_prefix, tmp_path, task,
                                             plain_sender=plain_sender)
    try:
        store = scenario.shop.outbox.store
        released = store.get_incoming("order-1")
        stale_after = timedelta(seconds=scenario.shop.outbox.settings.node_stale_after)
        assert as_utc(released.recover_after) > utcnow() + stale_after, \
            "released for a copy the broker holds: due after redeliver_after"
        recovered = scenario.shop.outbox.recover()
        assert recovered.envelopes_republished == 0, "recovery published a second copy of a message in the queue"
        assert waiting(scenario.shop.app, durable) == 1
        _consume_again(scenario, worker, durable)
        wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-1")), timeout=30,
                   message=f"the copy run (log: {worker.log_path})")
        assert states(scenario.shop.events("order-1")) == [*first_end, "SUCCESS"], "one copy, run once"
        assert len(scenario.shop.effects("order-1")) == 1
        row = store.get_incoming("order-1")
        assert (row.status, row.duplicates, row.recoveries) == ("handled", 0, 0)
    finally:
        scenario.close()


def test_a_copy_the_broker_lost_is_published_again_after_redeliver_after(broker_url, postgres_url, table_prefix,
                                                                          tmp_path):
    """The copy a ``Reject(requeue=True)`` handed back is lost (purged, as a broker that loses it):
    once ``outbox_redeliver_after`` has passed, recovery publishes the envelope, and it runs once."""
    scenario, worker, durable = _handed_back(broker_url, postgres_url, table_prefix, tmp_path, "hand_back_eager",
                                             outbox_redeliver_after=2)
    try:
        with scenario.shop.app.connection_for_write() as connection:
            purged = scenario.shop.app.amqp.queues[durable].bind(connection.default_channel).purge()
        assert purged == 1, "the queue held the copy"
        wait_until(lambda: scenario.shop.outbox.recover().envelopes_republished == 1, timeout=30,
                   message="recovery publishing the envelope once it is due")
        _consume_again(scenario, worker, durable)
        wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-1")), timeout=30,
                   message=f"the envelope run (log: {worker.log_path})")
        assert states(scenario.shop.events("order-1")) == ["REJECTED", "SUCCESS"]
        assert len(scenario.shop.effects("order-1")) == 1
        row = scenario.shop.outbox.store.get_incoming("order-1")
        assert (row.status, row.duplicates, row.recoveries) == ("handled", 0, 1)
    finally:
        scenario.close()


def test_a_message_acked_on_receipt_is_published_again_at_once(broker_url, postgres_url, table_prefix, tmp_path):
    """``Reject(requeue=True)`` of a task acked on receipt hands nothing back: the first recover
    pass publishes the envelope, the message's only copy, and it runs once."""
    scenario, worker, durable = _handed_back(broker_url, postgres_url, table_prefix, tmp_path, "hand_back_acked",
                                             copies=0)
    try:
        recovered = scenario.shop.outbox.recover()
        assert recovered.envelopes_republished == 1, "the envelope, the only copy, published again at once"
        _consume_again(scenario, worker, durable)
        wait_until(lambda: "SUCCESS" in states(scenario.shop.events("order-1")), timeout=30,
                   message=f"the envelope run (log: {worker.log_path})")
        assert states(scenario.shop.events("order-1")) == ["REJECTED", "SUCCESS"]
        assert len(scenario.shop.effects("order-1")) == 1
    finally:
        scenario.close()
