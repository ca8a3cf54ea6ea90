"""Replay checks a dead letter as the consumer guard checks a new message and routes it by its
task's current route; on real Redis and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from celery_outbox.maintenance.dead_letters import DeadLetterFilter, replay
from celery_outbox.store import utcnow

from ..apps.factory import make_shop
from ..brokers import nothing_more, receive
from ..conftest import drop_store

BODY = json.dumps([["again"], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]).encode()


def letter(message_id: str, headers, body: bytes = BODY, queue: str = "stale_queue") -> dict:
    return {
        "message_id": message_id, "destination": "", "task_name": "shop.plain", "queue": queue, "reason": "failed",
        "exception_type": "ValueError", "exception_message": "boom", "traceback": None, "exchange": "stale_exchange",
        "routing_key": queue, "body": body, "content_type": "application/json", "content_encoding": "utf-8",
        "headers": json.dumps(headers), "properties": json.dumps({"correlation_id": message_id}),
        "failed_at": utcnow(),
    }


def headers_of(message_id: str, **extra) -> dict:
    return {"lang": "py", "task": "shop.plain", "id": message_id, "retries": 0, "root_id": message_id,
            "parent_id": None, "group": None, **extra}


@pytest.fixture
def shop(redis_url, postgres_url, table_prefix):
    shop = make_shop(redis_url, postgres_url, table_prefix)
    shop.outbox.ready()
    yield shop
    drop_store(shop.outbox.store)


def insert(shop, *letters) -> list[int]:
    store = shop.outbox.store
    with store.begin() as conn:
        store.insert_dead_letters(conn, list(letters))
    return [row.id for row in store.list_dead_letters(store.dead_letter_filter())]


def test_a_replay_goes_where_the_task_is_routed_now_not_where_it_was(shop):
    insert(shop, letter("moved-1", headers_of("moved-1")))
    result = replay(shop.outbox.publisher, DeadLetterFilter())
    assert (result.message_ids, result.refused) == (["moved-1"], [])
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert (message.id, message.args) == ("moved-1", ["again"])
    assert nothing_more(shop.app, "stale_queue"), "the stored route is stale"


def test_a_replay_of_a_task_routed_by_its_declaration_goes_to_the_declared_queue(shop):
    """``@app.task(queue=...)`` (README's payments task) routes a replay as the task's own
    ``apply_async`` routes a send, not to the default queue."""
    declared = f"declared_{shop.plain_queue}"

    @shop.app.task(name="shop.declared", shared=False, queue=declared)
    def declared_task(word):
        return word

    insert(shop, {**letter("declared-1", headers_of("declared-1", task="shop.declared")), "task_name": "shop.declared"})
    result = replay(shop.outbox.publisher, DeadLetterFilter())
    assert (result.message_ids, result.refused) == (["declared-1"], [])
    (message,) = receive(shop.app, declared, 1)
    assert (message.task, message.id, message.args) == ("shop.declared", "declared-1", ["again"])
    assert nothing_more(shop.app, shop.plain_queue) and nothing_more(shop.app, "stale_queue")


def test_a_letter_whose_stored_properties_name_publish_arguments_replays(shop):
    """Properties stored with a letter (by another writer, or an older release) that name what the
    publish passes itself (content type, routing key, headers) neither clash with it nor override it."""
    clashing = json.dumps({"correlation_id": "clash-1", "content_type": "text/plain", "routing_key": "elsewhere",
                           "headers": {"x": 1}, "retry": True})
    insert(shop, {**letter("clash-1", headers_of("clash-1")), "properties": clashing})
    result = replay(shop.outbox.publisher, DeadLetterFilter())
    assert (result.message_ids, result.refused) == (["clash-1"], [])
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert (message.id, message.args) == ("clash-1", ["again"])


def test_a_letter_of_a_task_this_process_does_not_know_replays_along_its_stored_route(shop):
    """An unknown task is no reason to refuse a replay (the replaying process, the CLI say, need not
    register every task); with no route of its task here, the letter goes where it was sent."""
    insert(shop, {**letter("gone-1", headers_of("gone-1", task="shop.gone")), "exchange": ""})
    result = replay(shop.outbox.publisher, DeadLetterFilter())
    assert (result.message_ids, result.refused) == (["gone-1"], [])
    (message,) = receive(shop.app, "stale_queue", 1)
    assert (message.task, message.id, message.args) == ("shop.gone", "gone-1", ["again"])
    assert nothing_more(shop.app, shop.plain_queue)


@pytest.mark.parametrize(
    "headers, body, reason",
    [
        (["not", "a", "mapping"], BODY, "headers are a list, not a mapping"),
        (headers_of(5), BODY, "header 'id' is 5: a task id is required"),
        (headers_of("bad-retries", retries="many"), BODY, "header 'retries' is 'many'"),
        (headers_of("bad-body"), b"{not json", "body cannot be decoded (application/json)"),
    ],
)
def test_a_malformed_dead_letter_is_refused_with_its_reason_and_left_as_it_is(shop, headers, body, reason):
    bad, good = insert(shop, letter("bad", headers, body), letter("good-1", headers_of("good-1")))
    result = replay(shop.outbox.publisher, DeadLetterFilter())
    assert result.message_ids == ["good-1"]
    assert [(letter_id, text[:len(reason)]) for letter_id, text in result.refused] == [(bad, reason)]
    assert shop.outbox.store.get_dead_letter(bad).replay_count == 0, "a refused letter is not counted as replayed"
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert message.id == "good-1"
    assert nothing_more(shop.app, shop.plain_queue) and nothing_more(shop.app, "stale_queue")
