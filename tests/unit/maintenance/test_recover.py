"""Recovery (``celery_outbox.maintenance.recover``) on SQLite: a stranded envelope is re-published
and backs off, or is dead-lettered once recovered too often (on kombu's in-memory transport); a
dead node's claim is released and its envelope re-published once the node is declared dead on a
fixed clock, and an envelope waits for a broker that does not answer (through a fake outlet:
tests/unit/doubles.py). The same claims against PostgreSQL, Redis and real workers:
tests/integration/test_durability_workers.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_outbox.monitoring.tracing import Step
from celery_outbox.store import as_utc, utcnow

from ...apps.factory import make_shop, outgoing, strand
from ...brokers import nothing_more, receive


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_relay_max_attempts=3)
    shop.outbox.ready()
    return shop


def envelope_row(shop, message_id, **extra):
    """An inbox row as a worker of a durable queue leaves it when it dies mid-task."""
    strand(shop, message_id)
    (task_id,) = lost_envelopes(shop, **extra)
    return task_id


def lost_envelopes(shop, **extra) -> list[str]:
    """Every outgoing row turned into the inbox row a worker of its durable queue leaves when it
    dies mid-task (the sender's row gone, the envelope running, unowned, due for recovery); their
    message ids."""
    rows = outgoing(shop)
    with shop.outbox.store.begin() as conn:
        shop.outbox.store.delete_outgoing(conn, [row.id for row in rows])
    now = utcnow()
    for row in rows:
        values = dict(message_id=row.message_id, destination="", task_name=row.task_name, queue=shop.durable_queue,
                      status="running", owner=0, received_at=now, recover_after=now - timedelta(seconds=1),
                      exchange=row.exchange, routing_key=row.routing_key, body=row.body,
                      content_type=row.content_type, content_encoding=row.content_encoding, headers=row.headers,
                      properties=row.properties)
        values.update(extra)
        with shop.outbox.store.begin() as conn:
            shop.outbox.store.insert_incoming(conn, values)
    return [row.message_id for row in rows]


def test_a_stranded_envelope_is_republished_then_backs_off(shop):
    task_id = envelope_row(shop, "stranded")
    first = shop.outbox.recover()
    assert first.envelopes_republished == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (task_id, ["stranded"])
    row = shop.outbox.store.get_incoming(task_id)
    assert row.recoveries == 1 and as_utc(row.recover_after) > utcnow(), "backed off"
    assert shop.outbox.recover().envelopes_republished == 0
    assert nothing_more(shop.app, shop.durable_queue)


def test_an_envelope_recovered_too_often_is_dead_lettered(shop):
    task_id = envelope_row(shop, "kills its worker", recoveries=3)
    result = shop.outbox.recover()
    assert (result.envelopes_republished, result.envelopes_dead_lettered) == (0, 1)
    assert shop.outbox.store.get_incoming(task_id).status == "dead"
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason) == (task_id, "worker_lost")
    assert nothing_more(shop.app, shop.durable_queue)


def test_a_dead_nodes_claim_is_released_and_its_envelope_republished_once_it_is_declared_dead(
        shop, fake_outlet, fixed_clock):
    """A worker's node stops heartbeating while its claim runs. A node found stale is not dead yet:
    its claim stays its own and nothing is published. At the ``outbox_node_stale_checks``-th
    recover pass that finds it stale (each counted at least half a recover interval after the
    last), recovery declares it dead, releases the claim, re-publishes the stored envelope through
    the outlet and forgets the node, in that one pass; the envelope's next recovery backs off
    ``outbox_node_stale_after``."""
    settings, store = shop.outbox.settings, shop.outbox.store
    node = store.register_node("celery@lost:4242", "lost", 4242)  # its heartbeat: now, on the fixed clock
    strand(shop, "interrupted")
    (task_id,) = lost_envelopes(shop, owner=node, recover_after=None)  # its claim, running
    fixed_clock.advance(settings.node_stale_after)
    for _ in range(settings.node_stale_checks - 1):
        fixed_clock.advance(settings.recover_interval)
        stale = shop.outbox.recover()
        assert (stale.nodes_declared_dead, stale.claims_released, stale.envelopes_republished) == ([], 0, 0)
    assert fake_outlet.asked == [], "nothing re-published while the node is only stale"
    assert store.get_incoming(task_id).owner == node

    fixed_clock.advance(settings.recover_interval)
    result = shop.outbox.recover()

    assert result.nodes_declared_dead == [node]
    assert (result.claims_released, result.envelopes_republished, result.broker_error) == (1, 1, None)
    assert fake_outlet.published_ids == [task_id] and fake_outlet.steps == [Step.RECOVER]
    row = store.get_incoming(task_id)
    assert (row.status, row.owner, row.recoveries) == ("running", 0, 1)
    assert as_utc(row.recover_after) == fixed_clock.now + timedelta(seconds=settings.node_stale_after), "backed off"
    with store.begin() as conn:
        assert store.dead_nodes(conn) == [], "a dead node that owns nothing any more is forgotten"


def test_a_stranded_envelope_waits_for_a_broker_that_does_not_answer(shop, fake_outlet, fixed_clock):
    """With the broker not answering, recovery publishes nothing and counts no recovery: the
    envelope stays due and goes out at the first pass after the broker is back."""
    task_id = envelope_row(shop, "stranded")
    fake_outlet.fail_broker(answers=False)
    result = shop.outbox.recover()
    assert result.envelopes_republished == 0
    assert result.relay.broker_error == "OperationalError: [Errno 111] Connection refused"
    assert fake_outlet.asked == []
    assert shop.outbox.store.get_incoming(task_id).recoveries == 0
    fake_outlet.mend_broker()
    fixed_clock.advance(shop.outbox.settings.recover_interval)
    assert shop.outbox.recover().envelopes_republished == 1
    assert fake_outlet.published_ids == [task_id]
