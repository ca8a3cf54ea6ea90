"""Dead-letter replay and purge (``celery_outbox.maintenance.dead_letters``) on SQLite and kombu's
in-memory transport: a replay goes through the outbox as a new attempt; a purge deletes only the
old matching letters."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from celery_outbox.maintenance.dead_letters import DeadLetterFilter, purge, replay
from celery_outbox.store import utcnow

from ...apps.factory import make_shop, outgoing, strand
from ...brokers import receive
from ...conftest import unsent_rows


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


def dead_letter_of(shop, *args):
    ids = []
    for arg in args:
        (sent,) = strand(shop, arg)
        (row,) = outgoing(shop)
        store = shop.outbox.store
        with store.begin() as conn:
            store.delete_outgoing(conn, [row.id])
            store.insert_dead_letters(conn, [dict(
                message_id=sent.id, task_name=row.task_name, queue=shop.durable_queue, reason="failed",
                exception_type="ValueError", failed_at=utcnow(), exchange=row.exchange, routing_key=row.routing_key,
                body=row.body, content_type=row.content_type, content_encoding=row.content_encoding,
                headers=row.headers, properties=row.properties)])
        ids.append(sent.id)
    return ids


def test_replay_republishes_through_the_outbox_as_a_new_attempt(shop):
    (task_id,) = dead_letter_of(shop, "again")
    store = shop.outbox.store
    (letter,) = store.list_dead_letters(store.dead_letter_filter())
    progress = []
    replayed = replay(shop.outbox.publisher, DeadLetterFilter(ids=(letter.id,)), progress=progress.append)
    assert replayed.message_ids == [task_id]
    assert progress == [1]
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args, message.headers["celery_outbox_replay"]) == (task_id, ["again"], 1)
    letter = store.get_dead_letter(letter.id)
    assert letter.replay_count == 1 and letter.replayed_at is not None
    assert unsent_rows(shop.outbox.store) == 0, "the outgoing row was published"
    replay(shop.outbox.publisher, DeadLetterFilter(ids=(letter.id,)))
    (second,) = receive(shop.app, shop.durable_queue, 1)
    assert second.headers["celery_outbox_replay"] == 2, "each replay is a later attempt"


def test_purge_deletes_only_the_old_matching_letters(shop):
    dead_letter_of(shop, "a", "b", "c")
    store = shop.outbox.store
    table = store.tables.dead_letters
    first = store.list_dead_letters(store.dead_letter_filter())[0]
    with store.begin() as conn:
        conn.execute(update(table).where(table.c.id == first.id).values(failed_at=utcnow() - timedelta(days=30)))
    counted = []
    old = DeadLetterFilter(failed_before=utcnow() - timedelta(days=7))
    deleted = purge(shop.outbox.runtime, old, progress=counted.append)
    assert (deleted, counted) == (1, [1])
    assert first.id not in [r.id for r in store.list_dead_letters(store.dead_letter_filter())]
    assert store.count_dead_letters() == 2
