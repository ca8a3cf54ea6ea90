"""The relay (``celery_outbox.maintenance.relay``) on SQLite. Through a fake outlet and on a fixed
clock (tests/unit/doubles.py): a committed row nobody published is published and marked sent; a
broker error leaves the rest of the pass for the next one, counting no attempt; a row the broker
refuses counts attempts until it is a ``poison`` dead letter, never holding back the others; a row
past its expiry becomes an ``expired`` dead letter unpublished; a durable scheduled row waits
until its release; a sent row no inbox acknowledged is published again once due, its wait
doubling. On kombu's in-memory transport: the same paths as the broker receives them. Against
PostgreSQL, Redis and real workers: tests/integration/test_durability_workers.py."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from kombu.utils import json as kombu_json
from sqlalchemy import update

from celery_outbox.maintenance.relay import redeliver
from celery_outbox.monitoring.tracing import Step
from celery_outbox.store import as_utc, utcnow
from celery_outbox.vocabulary import REDELIVERY_HEADER, SEND_HEADER

from ...apps.factory import make_shop, outgoing, strand
from ...brokers import nothing_more, receive
from ...conftest import unsent_rows


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_relay_max_attempts=3)
    shop.outbox.ready()
    return shop


def make_due(shop):
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).values(deliver_at=utcnow() - timedelta(seconds=1)))


@pytest.mark.parametrize("timing", ["countdown", "eta"])
def test_a_long_durable_countdown_is_held_in_the_database_with_its_eta(shop, timing):
    """Beyond the release window (``release_ahead``, 15 s by default) the message waits in the
    outgoing table, its eta header intact; once released it reaches the broker with that eta,
    once, so the worker holds it until then as in Celery."""
    options = {"countdown": 60} if timing == "countdown" else {"eta": utcnow() + timedelta(seconds=60)}
    with shop.outbox.transaction():
        result = shop.durable.apply_async(("later",), **options)
    (row,) = outgoing(shop)
    eta = kombu_json.loads(row.headers)["eta"]
    assert as_utc(row.deliver_at) == datetime.fromisoformat(eta), "deliver_at is the eta the sender set"
    assert as_utc(row.deliver_at) == pytest.approx(utcnow() + timedelta(seconds=60), abs=timedelta(seconds=5))
    assert nothing_more(shop.app, shop.durable_queue), "not published at the commit: it is not in the window"
    assert shop.outbox.recover().relay.published == 0, "not published before its window"
    make_due(shop)
    assert shop.outbox.recover().relay.published == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args, message.headers["eta"]) == (result.id, ["later"], eta)
    assert shop.outbox.recover().relay.published == 0
    assert nothing_more(shop.app, shop.durable_queue), "published once"


def test_an_expired_outgoing_row_is_dead_lettered_not_published(shop):
    (expired,) = strand(shop, "too late", expires=utcnow() + timedelta(seconds=30))
    (fresh,) = strand(shop, "fine", expires=utcnow() + timedelta(hours=1))
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).where(table.c.message_id == expired.id)
                     .values(expires_at=utcnow() - timedelta(seconds=1)))
    result = shop.outbox.recover()
    assert (result.relay.published, result.relay.expired) == (1, 1)
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert message.id == fresh.id
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason) == (expired.id, "expired")
    assert [row.message_id for row in outgoing(shop)] == [fresh.id], "only the sent one is left, for its inbox"
    assert unsent_rows(shop.outbox.store) == 0


def test_a_sent_durable_message_is_redelivered_until_an_inbox_acknowledges_it(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_redeliver_after=60)
    shop.outbox.ready()
    result = shop.durable.delay("lost by the broker")
    (row,) = outgoing(shop)
    assert row.sent_at is not None and unsent_rows(shop.outbox.store) == 0
    assert as_utc(row.redeliver_at) == pytest.approx(utcnow() + timedelta(seconds=60), abs=timedelta(seconds=5))
    assert receive(shop.app, shop.durable_queue, 1)[0].id == result.id  # then the broker loses it
    assert shop.outbox.recover().redelivered == 0, "not before redeliver_after"
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).values(redeliver_at=utcnow() - timedelta(seconds=1)))
    assert shop.outbox.recover().redelivered == 1
    (again,) = receive(shop.app, shop.durable_queue, 1)
    assert (again.id, again.args) == (result.id, ["lost by the broker"])
    (row,) = outgoing(shop)
    assert row.redeliveries == 1
    assert again.headers[SEND_HEADER] == row.send_id, "the copy carries the identity of its send"
    assert as_utc(row.redeliver_at) == pytest.approx(utcnow() + timedelta(seconds=120), abs=timedelta(seconds=5)), \
        "the wait doubles"
    assert shop.outbox.recover().redelivered == 0
    with shop.outbox.store.begin() as conn:
        assert shop.outbox.store.acknowledge_outgoing(conn, result.id, None, (0, 0, 0), row.send_id) == 1, \
            "an inbox took it"
    assert outgoing(shop) == []


def test_a_committed_unsent_row_is_published_and_marked_sent(shop, fake_outlet, fixed_clock):
    (sent,) = strand(shop, "parcel")
    assert fake_outlet.asked == [] and unsent_rows(shop.outbox.store) == 1
    result = shop.outbox.relay()
    assert (result.published, result.failed, result.batches, result.broker_error) == (1, 0, 1, None)
    assert fake_outlet.published_ids == [sent.id] and fake_outlet.steps == [Step.RELAY]
    (row,) = outgoing(shop)
    assert as_utc(row.sent_at) == fixed_clock.now
    assert as_utc(row.redeliver_at) == fixed_clock.now + timedelta(seconds=shop.outbox.settings.redeliver_after), \
        "kept, marked sent, until an inbox acknowledges it"
    assert unsent_rows(shop.outbox.store) == 0
    assert shop.outbox.relay().published == 0 and fake_outlet.published_ids == [sent.id], "published once"


def test_a_broker_error_leaves_the_row_for_the_next_pass(shop, fake_outlet):
    """The broker takes the first row and fails at the second: the second waits, unsent and with no
    attempt counted (an outage is not the message's fault), and the next pass publishes it."""
    first, second = strand(shop, "first", "second")
    fake_outlet.fail_broker(after=1)
    result = shop.outbox.relay()
    assert (result.published, result.failed, result.dead_lettered) == (1, 0, 0)
    assert result.broker_error == "OperationalError: [Errno 111] Connection refused"
    assert fake_outlet.published_ids == [first.id]
    (waiting,) = [row for row in outgoing(shop) if row.sent_at is None]
    assert (waiting.message_id, waiting.attempts, waiting.last_error) == (second.id, 0, None)
    fake_outlet.mend_broker()
    assert shop.outbox.relay().published == 1
    assert fake_outlet.published_ids == [first.id, second.id]
    assert unsent_rows(shop.outbox.store) == 0 and shop.outbox.store.count_dead_letters() == 0


def test_a_broker_that_does_not_answer_is_offered_nothing(shop, fake_outlet):
    strand(shop, "waits")
    fake_outlet.fail_broker(answers=False)
    result = shop.outbox.relay()
    assert (result.published, result.batches) == (0, 0)
    assert result.broker_error == "OperationalError: [Errno 111] Connection refused"
    assert fake_outlet.asked == [] and unsent_rows(shop.outbox.store) == 1


def test_a_row_the_broker_refuses_becomes_a_poison_dead_letter_after_its_attempts(shop, fake_outlet):
    """Each pass tries the refused row once and counts it; the row after it is published all the
    same. At ``outbox_relay_max_attempts`` (3 here) it goes to dead letters, reason ``poison``."""
    bad, good = strand(shop, "bad", "good")
    fake_outlet.refuse(bad.id)
    passes = [shop.outbox.relay() for _ in range(shop.outbox.settings.relay_max_attempts)]
    assert [(p.published, p.failed, p.dead_lettered) for p in passes] == [(1, 1, 0), (0, 1, 0), (0, 1, 1)]
    assert fake_outlet.published_ids == [good.id]
    assert [m.message_id for m in fake_outlet.asked] == [bad.id, good.id, bad.id, bad.id]
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason, letter.exception_type) == (bad.id, "poison", "EncodeError")
    assert [row.message_id for row in outgoing(shop)] == [good.id]


def test_a_row_past_its_expiry_becomes_an_expired_dead_letter(shop, fake_outlet, fixed_clock):
    expires = fixed_clock.now + timedelta(seconds=30)
    (late,) = strand(shop, "too late", expires=expires)
    (fresh,) = strand(shop, "fine", expires=fixed_clock.now + timedelta(hours=1))
    fixed_clock.advance(31)
    result = shop.outbox.relay()
    assert (result.published, result.expired, result.dead_lettered) == (1, 1, 1)
    assert [m.message_id for m in fake_outlet.asked] == [fresh.id], "an expired row is never offered to the broker"
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason, as_utc(letter.failed_at)) == (late.id, "expired", fixed_clock.now)
    assert letter.exception_message == f"expired at {expires.isoformat()} before it was published"
    assert [row.message_id for row in outgoing(shop)] == [fresh.id]


def test_a_durable_scheduled_row_waits_until_its_time_on_the_fixed_clock(shop, fake_outlet, fixed_clock):
    """Sent with an eta a minute away, the row waits in the store; the relay releases it, eta kept,
    at ``outbox_release_ahead`` before its eta and not a second earlier, and its redelivery counts
    from its eta."""
    eta = fixed_clock.now + timedelta(minutes=1)
    with shop.outbox.transaction():
        result = shop.durable.apply_async(("later",), eta=eta)
    assert fake_outlet.asked == [], "held at the commit: its eta is beyond the release window"
    release = eta - timedelta(seconds=shop.outbox.settings.release_ahead_seconds)
    fixed_clock.set(release - timedelta(seconds=1))
    assert shop.outbox.relay().published == 0 and fake_outlet.asked == []
    fixed_clock.set(release)
    assert shop.outbox.relay().published == 1
    (message,) = fake_outlet.published
    assert (message.message_id, message.deliver_at) == (result.id, eta)
    assert datetime.fromisoformat(message.headers["eta"]) == eta, "the worker holds it until its eta"
    (row,) = outgoing(shop)
    assert as_utc(row.sent_at) == release
    assert as_utc(row.redeliver_at) == eta + timedelta(seconds=shop.outbox.settings.redeliver_after)


def test_a_sent_row_no_inbox_acknowledged_is_published_again_once_due_its_wait_doubling(
        shop, fake_outlet, fixed_clock):
    sent_at = fixed_clock.now
    with shop.outbox.transaction():
        result = shop.durable.delay("lost by the broker")
    assert fake_outlet.published_ids == [result.id] and fake_outlet.steps == [Step.PUBLISH]
    wait = timedelta(seconds=shop.outbox.settings.redeliver_after)
    fixed_clock.set(sent_at + wait - timedelta(seconds=1))
    assert redeliver(shop.outbox.runtime) == (0, None), "not before outbox_redeliver_after"
    fixed_clock.set(sent_at + wait)
    assert redeliver(shop.outbox.runtime) == (1, None)
    assert fake_outlet.published_ids == [result.id, result.id] and fake_outlet.steps[-1] is Step.REDELIVER
    assert fake_outlet.published[-1].headers[REDELIVERY_HEADER] == 1, "the inbox counts the copy as a redelivery"
    (row,) = outgoing(shop)
    assert row.redeliveries == 1 and as_utc(row.redeliver_at) == fixed_clock.now + 2 * wait
