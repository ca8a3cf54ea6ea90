"""A task id sent again is a new message, as in Celery; a copy of one send is a duplicate. Real
worker processes, PostgreSQL store, Redis broker.

Every ``apply_async`` gets a publish identity (the ``celery_outbox_send`` header) that its retries,
replacements and every redelivered, relayed or recovered copy keep; the inbox keys a delivery by the
task id and that identity. ``outbox_deduplicate_task_ids`` makes the task id alone the key, per task.
The same scenarios with plain Celery: tests/compat."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from celery_outbox.vocabulary import SEND_HEADER

from ..scenario import Scenario
from ..services import require, wait_until


@pytest.fixture
def scenario(postgres_url, table_prefix, tmp_path):
    scenario = Scenario(require("redis"), postgres_url, table_prefix, tmp_path)
    yield scenario
    scenario.close()


def postrun_states(scenario: Scenario, task_id: str) -> list[str]:
    return [e.state for e in scenario.shop.events(task_id) if e.kind == "postrun"]


@pytest.mark.parametrize("durable", [False, True], ids=["plain-queue", "durable-queue"])
@pytest.mark.parametrize("task", ["pay", "pay_eager"])
def test_a_task_id_sent_again_runs_again(scenario, task, durable):
    """``apply_async(task_id=X)`` twice: two messages, two runs, as in plain Celery."""
    queue = scenario.env["TEST_OTHER_QUEUE"] if durable else scenario.env["TEST_QUEUE"]
    scenario.worker(queues=[queue])
    send = getattr(scenario.shop, task)
    send.apply_async(("again-1",), task_id="again-1", queue=queue)
    scenario.wait_events("again-1", "postrun", 1)
    send.apply_async(("again-1",), task_id="again-1", queue=queue)
    scenario.wait_events("again-1", "postrun", 2)
    assert postrun_states(scenario, "again-1") == ["SUCCESS", "SUCCESS"]
    assert len(scenario.shop.effects("again-1")) == 2
    if durable:
        store = scenario.shop.outbox.store
        wait_until(lambda: store.count_outgoing() == 0, message="both sends acknowledged by the inbox")


def test_a_frozen_signature_applied_twice_runs_twice(scenario):
    scenario.worker()
    signature = scenario.shop.pay.s("frozen-1")
    task_id = signature.freeze().id
    signature.apply_async()
    scenario.wait_events(task_id, "postrun", 1)
    signature.apply_async()
    scenario.wait_events(task_id, "postrun", 2)
    assert postrun_states(scenario, task_id) == ["SUCCESS", "SUCCESS"]


def test_two_sends_of_one_task_id_to_a_durable_queue_are_tracked_apart(scenario):
    """Each send has its own outgoing row; the inbox acknowledging one never takes the other's row."""
    durable = scenario.env["TEST_OTHER_QUEUE"]
    shop = scenario.shop
    shop.pay.apply_async(("tracked-1",), task_id="tracked-1", queue=durable)
    shop.pay.apply_async(("tracked-1",), task_id="tracked-1", queue=durable)
    outgoing = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        sends = conn.execute(select(outgoing.c.send_id).where(outgoing.c.message_id == "tracked-1")).scalars().all()
    assert len(sends) == 2 and len(set(sends)) == 2 and all(sends), sends
    scenario.worker(queues=[durable])
    scenario.wait_events("tracked-1", "postrun", 2)
    assert postrun_states(scenario, "tracked-1") == ["SUCCESS", "SUCCESS"]
    wait_until(lambda: shop.outbox.store.count_outgoing() == 0, message="both sends acknowledged")
    incoming = shop.outbox.store.tables.incoming
    with shop.outbox.store.begin() as conn:
        rows = conn.execute(select(incoming.c.send_id, incoming.c.status)
                            .where(incoming.c.message_id == "tracked-1")).all()
    assert sorted(rows) == sorted((send, "handled") for send in sends)


def test_a_copy_of_one_send_runs_once(scenario):
    """The same task id and the same publish identity (what a broker redelivery carries) is a
    duplicate: discarded."""
    scenario.worker()
    copy = {"task_id": "copy-1", "headers": {SEND_HEADER: "one-send"}}
    scenario.shop.pay.apply_async(("copy-1",), **copy)
    scenario.wait_events("copy-1", "postrun", 1)
    scenario.shop.pay.apply_async(("copy-1",), **copy)
    scenario.wait_events("copy-1", "postrun", 2)
    assert postrun_states(scenario, "copy-1") == ["SUCCESS", "IGNORED"]
    assert len(scenario.shop.effects("copy-1")) == 1


@pytest.fixture
def deduplicating(postgres_url, table_prefix, tmp_path):
    scenario = Scenario(require("redis"), postgres_url, table_prefix, tmp_path, outbox_deduplicate_task_ids=True)
    yield scenario
    scenario.close()


def test_with_deduplicate_task_ids_a_task_id_sent_again_is_a_duplicate(deduplicating):
    scenario = deduplicating
    durable = scenario.env["TEST_OTHER_QUEUE"]
    scenario.worker(queues=[durable])
    scenario.shop.pay.apply_async(("dedupe-1",), task_id="dedupe-1", queue=durable)
    scenario.wait_events("dedupe-1", "postrun", 1)
    scenario.shop.pay.apply_async(("dedupe-1",), task_id="dedupe-1", queue=durable)
    scenario.wait_events("dedupe-1", "postrun", 2)
    assert postrun_states(scenario, "dedupe-1") == ["SUCCESS", "IGNORED"]
    assert len(scenario.shop.effects("dedupe-1")) == 1
    wait_until(lambda: scenario.shop.outbox.store.count_outgoing() == 0,
               message="the discarded send's outgoing row acknowledged too")


def test_with_deduplicate_task_ids_a_message_of_another_task_with_the_same_id_still_runs(deduplicating):
    """The task id is a dedupe key per task: another task's message with that id is not a copy."""
    scenario = deduplicating
    scenario.worker()
    scenario.shop.pay.apply_async(("shared-id",), task_id="shared-id")
    scenario.wait_events("shared-id", "postrun", 1)
    scenario.shop.pay_eager.apply_async(("shared-id",), task_id="shared-id")
    scenario.wait_events("shared-id", "postrun", 2)
    assert postrun_states(scenario, "shared-id") == ["SUCCESS", "SUCCESS"]
    assert len(scenario.shop.effects("shared-id")) == 2
