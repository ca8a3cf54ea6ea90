"""Hostile input on a real worker (Redis and PostgreSQL): envelopes kombu cannot read, NUL bytes,
ids the store cannot hold. Each bad message ends as one dead letter with its reason, the worker
stays up, the good messages around it run once, and nothing is handed back to the broker."""

from __future__ import annotations

import base64
import json
import uuid
from collections import Counter

import pytest

from ..integration.test_inbox_workers import publish_raw
from ..scenario import Scenario
from ..services import wait_until
from .test_malformed_messages import dead_letter_reasons

GOOD_BODY = '[["x"], {}, {}]'
HANDED_BACK = "handing it back to the broker"


def started(broker: str, tmp_path_factory) -> Scenario:
    from ..conftest import unique_prefix
    from ..services import require

    scenario = Scenario(require(broker), require("postgres"), unique_prefix(), tmp_path_factory.mktemp("hostile"))
    scenario.worker(queues=[scenario.env["TEST_QUEUE"], scenario.env["TEST_OTHER_QUEUE"]])
    return scenario


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    scenario = started("redis", tmp_path_factory)
    yield scenario
    scenario.close()


@pytest.fixture(scope="module")
def rabbitmq_scenario(tmp_path_factory):
    scenario = started("rabbitmq", tmp_path_factory)
    yield scenario
    scenario.close()


def push_envelope(redis_url: str, queue: str, headers, properties=None, body=GOOD_BODY) -> None:
    """Put a message on a Redis queue as kombu would, with the envelope's parts as given."""
    import redis

    envelope = {"body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8",
                "content-type": "application/json", "headers": headers,
                "properties": {"body_encoding": "base64", "delivery_tag": str(uuid.uuid4()), "priority": 0,
                               "delivery_info": {"exchange": "", "routing_key": queue}, **(properties or {})}}
    client = redis.Redis.from_url(redis_url)
    try:
        client.lpush(queue, json.dumps(envelope))
    finally:
        client.close()


def run_between(scenario, bad, send_bad, good_per_bad=1) -> list[str]:
    """Send each bad message followed by good ones; wait until every good one ran; their ids."""
    shop, good_ids = scenario.shop, []
    for item in bad:
        send_bad(item)
        for _ in range(good_per_bad):
            good_ids.append(f"good-{uuid.uuid4().hex[:8]}")
            shop.pay.apply_async((good_ids[-1],), task_id=good_ids[-1], queue=scenario.env["TEST_OTHER_QUEUE"])
    for good_id in good_ids:
        scenario.wait_events(good_id, "postrun", 1)
    return good_ids


def assert_dead_lettered_once(scenario, before: Counter, expected: Counter, good_ids: list[str]) -> None:
    store = scenario.shop.outbox.store
    wait_until(lambda: dead_letter_reasons(store) - before == expected, timeout=30,
               message=f"dead letters {expected} (logs in {scenario.tmp_path})")
    assert all(len(scenario.shop.effects(good_id)) == 1 for good_id in good_ids), "each good message ran once"
    worker = scenario.workers[0]
    assert worker.process.poll() is None, "the worker is still running"
    assert HANDED_BACK not in worker.log(), "no message went back to the broker"


def test_envelopes_kombu_cannot_read_are_dead_lettered_and_the_worker_lives(scenario):
    redis_url, store = scenario.env["TEST_BROKER_URL"], scenario.shop.outbox.store
    good_headers = {"task": "inbox.pay", "id": "envelope-x"}
    bad = [
        ({"headers": ["a", "list"]}, "envelope 'headers' is ['a', 'list']"),
        ({"headers": "inbox.pay"}, "envelope 'headers' is 'inbox.pay'"),
        ({"headers": 42}, "envelope 'headers' is 42"),
        ({"headers": good_headers, "properties": {"delivery_info": ["not", "a", "mapping"]}}, "'delivery_info'"),
        ({"headers": good_headers, "properties": {"delivery_tag": None}}, "no delivery tag"),
        ({"headers": good_headers, "properties": {"body_encoding": 7}}, "'body_encoding' is 7"),
    ]
    before = dead_letter_reasons(store)
    queues = [scenario.env["TEST_QUEUE"], scenario.env["TEST_OTHER_QUEUE"]]
    sent = iter(range(len(bad)))
    good_ids = run_between(scenario, bad, lambda item: push_envelope(redis_url, queues[next(sent) % 2], **item[0]))
    assert_dead_lettered_once(scenario, before, Counter({"malformed": len(bad)}), good_ids)
    log = scenario.workers[0].log()
    assert all(words in log for _, words in bad), "each dead letter names what was wrong with the envelope"


def test_nul_bytes_and_ids_the_store_cannot_hold_are_dead_lettered_and_good_ones_run(scenario):
    nul_bytes_and_long_ids_among_good_messages(scenario)


def test_nul_bytes_and_ids_the_store_cannot_hold_on_rabbitmq(rabbitmq_scenario):
    nul_bytes_and_long_ids_among_good_messages(rabbitmq_scenario)


def nul_bytes_and_long_ids_among_good_messages(scenario) -> None:
    shop, store = scenario.shop, scenario.shop.outbox.store
    durable, plain = scenario.env["TEST_OTHER_QUEUE"], scenario.env["TEST_QUEUE"]
    bad = [  # (queue, headers, content type, reason)
        (durable, {"task": "inbox.pay\x00evil", "id": "nul-task"}, "application/json", "unknown_task"),
        (durable, {"task": "inbox.pay", "id": "nul\x00id"}, "application/json", "malformed"),
        (durable, {"task": "inbox.pay", "id": "nul\x00id-2", "retries": "\x00"}, "application/json", "malformed"),
        (durable, {"task": "inbox.pay", "id": "nul-type"}, "application/json\x00", "malformed"),
        (durable, {"task": "inbox.pay", "id": "x" * 300}, "application/json", "malformed"),
        (plain, {"task": "inbox.pay", "id": "y" * 300}, "application/json", "malformed"),  # an IdempotentTask
        # the outbox's own counters, out of any range it writes
        (plain, {"task": "inbox.pay", "id": "huge-replay", "celery_outbox_replay": 2**40}, "application/json",
         "malformed"),
    ]
    if scenario.env["TEST_BROKER_URL"].startswith("redis"):  # JSON allows Infinity; RabbitMQ drops such a frame
        bad.append((durable, {"task": "inbox.pay", "id": "infinite-redelivery",
                              "celery_outbox_redelivery": float("inf")}, "application/json", "malformed"))
    before = dead_letter_reasons(store)
    good_ids = run_between(scenario, bad, lambda item: publish_raw(shop.app, item[0], GOOD_BODY, item[1], item[2]),
                           good_per_bad=5)
    assert len(good_ids) == 5 * len(bad)
    assert_dead_lettered_once(scenario, before, Counter(reason for *_, reason in bad), good_ids)
    letters = store.list_dead_letters(store.dead_letter_filter())
    assert {"inbox.pay\\x00evil", "nul\\x00id"} <= {letter.task_name for letter in letters} | {
        letter.message_id for letter in letters}, "the NUL bytes are stored escaped"
    assert any("is 300 characters, the store holds at most 255" in (letter.exception_message or "")
               for letter in letters)
