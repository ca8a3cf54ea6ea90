"""Publish after commit: fast checks on SQLite and kombu's in-memory transport.

The same behaviour is checked against PostgreSQL, Redis and RabbitMQ in
tests/integration/test_outbox_publishing.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import pytest
from celery import chain, chord, group
from kombu.messaging import Producer
from sqlalchemy import text, update

from celery_outbox.errors import StoreUnavailable
from celery_outbox.signals import message_published, publish_failed
from celery_outbox.store import as_utc, utcnow

from ...apps.factory import make_shop, outgoing
from ...brokers import nothing_more, receive, receive_until_marker
from ...conftest import outgoing_rows, unsent_rows


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop






def test_commit_publishes_once_after_the_commit(shop):
    with shop.outbox.transaction():
        result = shop.plain.delay(1)
        assert nothing_more(shop.app, shop.plain_queue), "nothing may reach the broker before the commit"
    assert result.id and isinstance(result.id, str)
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert (message.id, message.args) == (result.id, [1])
    assert nothing_more(shop.app, shop.plain_queue)


def test_rollback_publishes_nothing(shop):
    with pytest.raises(RuntimeError):
        with shop.outbox.transaction():
            shop.plain.delay(1)
            shop.durable.delay(2)
            raise RuntimeError("the caller's transaction fails")
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0


def test_messages_are_published_in_call_order(shop):
    with shop.outbox.transaction():
        ids = [shop.plain.apply_async((n,), queue=shop.plain_queue).id for n in range(20)]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 20)] == ids


def test_durable_row_is_stored_marked_sent_in_the_transaction_and_published_after_it(shop):
    rows_at_publish = []

    def on_published(sender, message, relayed, **_):
        rows_at_publish.append(outgoing_rows(shop.outbox.store))

    message_published.connect(on_published)
    try:
        with shop.outbox.transaction() as session:
            result = shop.durable.delay(5)
            session.flush()
        assert unsent_rows(shop.outbox.store) == 0
    finally:
        message_published.disconnect(on_published)
    assert rows_at_publish == [(1, 0)], "the row exists, marked sent, while the message is published"
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args, message.task) == (result.id, [5], "shop.durable")


def test_durable_rows_are_inserted_marked_sent_with_one_statement_and_none_after_the_commit(shop):
    from ...integration.test_store_contract import StatementLog

    log = StatementLog(shop.outbox.engine)
    try:
        with shop.outbox.transaction():
            for n in range(25):
                shop.durable.delay(n)
    finally:
        log.close()
    assert len([s for s in log.of("INSERT") if "outgoing" in s]) == 1
    assert [s for s in log.of("UPDATE") if "outgoing" in s] == [], "stored marked sent: no statement after the commit"
    assert [m.args for m in receive(shop.app, shop.durable_queue, 25)] == [[n] for n in range(25)]


def test_nested_blocks_join_the_outer_one(shop):
    with shop.outbox.transaction() as outer:
        with shop.outbox.transaction() as inner:
            assert inner is outer
            shop.plain.delay("inner")
        assert nothing_more(shop.app, shop.plain_queue), "the inner block does not commit"
        shop.plain.delay("outer")
    assert [m.args for m in receive(shop.app, shop.plain_queue, 2)] == [["inner"], ["outer"]]


def test_a_rolled_back_savepoint_discards_only_its_messages(shop):
    with shop.outbox.transaction() as session:
        shop.plain.delay("before")
        with pytest.raises(ValueError):
            with session.begin_nested():
                shop.plain.delay("inside")
                shop.durable.delay("inside")
                raise ValueError
        with session.begin_nested():
            shop.plain.delay("kept savepoint")
        shop.plain.delay("after")
    assert [m.args for m in receive(shop.app, shop.plain_queue, 3)] == [["before"], ["kept savepoint"], ["after"]]
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)


def test_joining_a_session_the_caller_owns_publishes_at_its_commit(shop):
    from sqlalchemy.orm import Session

    with Session(shop.outbox.engine) as session:
        session.execute(text("SELECT 1"))
        with shop.outbox.transaction(session):
            shop.plain.delay("joined")
        assert nothing_more(shop.app, shop.plain_queue), "the block ended but the session has not committed"
        session.commit()
        assert [m.args for m in receive(shop.app, shop.plain_queue, 1)] == [["joined"]]
        with shop.outbox.transaction(session):
            shop.plain.delay("rolled back")
        session.rollback()
    assert nothing_more(shop.app, shop.plain_queue)


def test_begin_is_a_unit_of_work_on_a_core_connection(shop, monkeypatch):
    from sqlalchemy.engine import Connection

    def no_session(*args, **kwargs):
        raise AssertionError("outbox.begin() made an ORM Session")

    monkeypatch.setattr(shop.outbox.runtime, "new_session", no_session)
    with shop.outbox.begin() as conn:
        assert isinstance(conn, Connection) and conn.in_transaction()
        conn.execute(text("CREATE TABLE IF NOT EXISTS begin_orders (n INTEGER)"))
        conn.execute(text("INSERT INTO begin_orders VALUES (1)"))
        durable = shop.durable.delay("durable")
        plain = shop.plain.delay("plain")
        assert nothing_more(shop.app, shop.plain_queue), "nothing may reach the broker before the commit"
    with shop.outbox.engine.connect() as reader:
        assert reader.execute(text("SELECT n FROM begin_orders")).scalars().all() == [1], "the block committed"
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable.id]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [plain.id]
    assert unsent_rows(shop.outbox.store) == 0


def test_begin_rolls_back_on_an_exception_and_publishes_nothing(shop):
    with shop.outbox.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS begin_orders (n INTEGER)"))
    with pytest.raises(RuntimeError):
        with shop.outbox.begin() as conn:
            conn.execute(text("INSERT INTO begin_orders VALUES (1)"))
            shop.plain.delay(1)
            shop.durable.delay(2)
            raise RuntimeError("the caller's transaction fails")
    with shop.outbox.engine.connect() as reader:
        assert reader.execute(text("SELECT count(*) FROM begin_orders")).scalar() == 0
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0


def test_begin_inside_an_open_unit_of_work_joins_it(shop):
    with shop.outbox.transaction() as session:
        with shop.outbox.begin() as conn:
            assert conn is session.connection()
            shop.plain.delay("inner")
        assert nothing_more(shop.app, shop.plain_queue), "the inner block does not commit"
        with shop.outbox.begin() as outer:
            with shop.outbox.begin() as inner:
                assert inner is outer
        shop.plain.delay("outer")
    assert [m.args for m in receive(shop.app, shop.plain_queue, 2)] == [["inner"], ["outer"]]
    with shop.outbox.begin() as conn:
        with shop.outbox.transaction() as session:
            assert session.connection() is conn
            shop.plain.delay("in a Session on the block's connection")
        assert nothing_more(shop.app, shop.plain_queue), "the Session's block does not commit"
    assert [m.args for m in receive(shop.app, shop.plain_queue, 1)] == [["in a Session on the block's connection"]]


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_begin_refuses_a_transaction_ended_inside_its_block(shop, end):
    from celery_outbox.errors import OutboxError

    with pytest.raises(OutboxError, match="ended inside its block"):
        with shop.outbox.begin() as conn:
            shop.durable.delay(1)
            shop.plain.delay(2)
            getattr(conn, end)()
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0, "no row was stored for the messages dropped"


def test_canvas_is_caught_and_published_after_commit(shop):
    add = shop.plain
    with shop.outbox.transaction():
        chain(add.si(1), add.si(2)).apply_async()
        group(add.si(3), add.si(4)).apply_async()
        assert nothing_more(shop.app, shop.plain_queue)
    received = receive(shop.app, shop.plain_queue, 3)
    assert [m.args for m in received] == [[1], [3], [4]]
    assert received[0].headers.get("id")


def test_chord_header_is_caught(shop, tmp_path):
    shop.app.conf.result_backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    with shop.outbox.transaction():
        chord([shop.plain.si(1), shop.plain.si(2)])(shop.plain.s())
        assert nothing_more(shop.app, shop.plain_queue)
    received = receive(shop.app, shop.plain_queue, 3)
    assert sorted(m.args[0] for m in received if m.task == "shop.plain") == [1, 2]
    assert [m.task for m in received if m.task != "shop.plain"] == ["celery.chord_unlock"]


def test_outside_a_unit_of_work_plain_queues_behave_as_plain_celery(shop):
    result = shop.plain.delay(7)
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert message.id == result.id


def test_store_and_forward_outside_a_unit_of_work(shop):
    result = shop.durable.delay(8)
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert message.id == result.id
    assert unsent_rows(shop.outbox.store) == 0


def _failing_publish(monkeypatch):
    real_publish = Producer.publish

    def publish(self, body, *args, **kwargs):
        if kwargs.get("routing_key", "").startswith("durable_"):
            raise ConnectionRefusedError("broker is down")
        return real_publish(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", publish)


def test_a_plain_publish_that_fails_after_the_commit_is_reported_and_the_next_goes_out(shop, monkeypatch, caplog):
    """A unit of work with plain messages only (nothing stored): the broker refuses the first
    message's publish; it is reported lost, by the log and ``publish_failed``, and the second
    one is still published, with its ``message_published``."""
    failed, published = [], []

    def on_failed(sender, message, exception, **_):
        failed.append((message.message_id, type(exception)))

    def on_published(sender, message, relayed, **_):
        published.append((message.message_id, relayed))

    real_publish = Producer.publish

    def publish(self, body, *args, **kwargs):
        if kwargs["headers"]["argsrepr"] == "(1,)":
            raise ConnectionRefusedError("broker is down")
        return real_publish(self, body, *args, **kwargs)

    publish_failed.connect(on_failed)
    message_published.connect(on_published)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(Producer, "publish", publish)
            with shop.outbox.transaction():
                lost = shop.plain.apply_async((1,), retry=False)
                sent = shop.plain.apply_async((2,), retry=False)
    finally:
        publish_failed.disconnect(on_failed)
        message_published.disconnect(on_published)
    assert failed == [(lost.id, ConnectionRefusedError)]
    assert published == [(sent.id, False)]
    assert f"publish of {shop.plain.name}[{lost.id}]" in caplog.text and "the message is lost" in caplog.text
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert (message.id, message.args) == (sent.id, [2])
    assert nothing_more(shop.app, shop.plain_queue)


def test_failed_publish_after_commit_keeps_the_row_and_the_relay_sends_it(shop, monkeypatch):
    failures = []

    def on_failed(sender, message, exception, **_):
        failures.append((message.message_id, type(exception)))

    publish_failed.connect(on_failed)
    try:
        with monkeypatch.context() as patch:
            _failing_publish(patch)
            with shop.outbox.transaction():
                result = shop.durable.delay(9)
            assert unsent_rows(shop.outbox.store) == 1, "the row stays for the relay"
            assert failures == [(result.id, ConnectionRefusedError)]
        relayed = shop.outbox.relay()
    finally:
        publish_failed.disconnect(on_failed)
    assert relayed.published == 1 and relayed.broker_error is None
    assert unsent_rows(shop.outbox.store) == 0
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (result.id, [9])


def test_a_failed_publish_whose_row_cannot_be_given_back_waits_for_its_redelivery(shop, monkeypatch, caplog):
    """The broker refuses the publish after the commit, and the store refuses to unmark the row:
    the commit stands, the row stays marked sent (the relay leaves it), and redelivery publishes
    it once due."""
    store = shop.outbox.store

    def store_down(*args, **kwargs):
        raise StoreUnavailable("cannot use the message store: the test took it down")

    with monkeypatch.context() as patch:
        _failing_publish(patch)
        patch.setattr(type(store), "unmark_sent", store_down)
        with shop.outbox.transaction():
            result = shop.durable.delay(9)
    assert "could not give 1 unpublished messages back to the relay" in caplog.text
    assert outgoing_rows(store) == (1, 0), "stored marked sent, and still so"
    assert shop.outbox.relay().published == 0, "the relay leaves a row marked sent"
    assert shop.outbox.recover().redelivered == 0, "not due yet"
    table = store.tables.outgoing
    with store.begin() as conn:  # its redelivery falls due
        conn.execute(update(table).values(redeliver_at=utcnow() - timedelta(seconds=1)))
    assert shop.outbox.recover().redelivered == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (result.id, [9])


def test_a_scheduled_message_come_due_since_its_store_goes_out_with_one_stored_marked_sent(shop, monkeypatch):
    """One unit of work sends a message with no eta (stored marked sent) and one whose eta was
    beyond the release line when it was stored (stored unsent, to wait) but is before it by the
    time of the publish: the publisher takes the second and publishes both, at once, in call
    order; neither is left to the relay or to redelivery."""
    from celery_outbox.producer import publishing

    ahead = timedelta(seconds=shop.outbox.settings.release_ahead_seconds)
    stored_at = utcnow()
    clock = iter([stored_at, stored_at + 2 * ahead + timedelta(minutes=2)])
    monkeypatch.setattr(publishing, "utcnow", lambda: next(clock))
    with shop.outbox.transaction():
        now = shop.durable.delay(1)
        later = shop.durable.apply_async((2,), eta=stored_at + ahead + timedelta(minutes=1))
    assert next(clock, None) is None, "the store and the publish each read the clock once"
    assert outgoing_rows(shop.outbox.store) == (2, 0), "both published, both awaiting their inbox"
    assert [(m.id, m.args) for m in receive(shop.app, shop.durable_queue, 2)] == [(now.id, [1]), (later.id, [2])]


def test_a_poison_row_goes_to_dead_letters_and_does_not_block_the_others(sqlite_url, table_prefix, monkeypatch):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_relay_max_attempts=2)
    real_publish = Producer.publish

    def publish(self, body, *args, **kwargs):
        if kwargs.get("headers", {}).get("argsrepr") == "('poison',)":
            raise ValueError("this message cannot be encoded by the broker")
        return real_publish(self, body, *args, **kwargs)

    with monkeypatch.context() as patch:
        _failing_publish(patch)
        with shop.outbox.transaction():
            shop.durable.delay("poison")
            good = shop.durable.delay("good")
    monkeypatch.setattr(Producer, "publish", publish)
    first = shop.outbox.relay()
    assert (first.published, first.failed, first.dead_lettered) == (1, 1, 0)
    second = shop.outbox.relay()
    assert (second.published, second.failed, second.dead_lettered) == (0, 1, 1)
    assert unsent_rows(shop.outbox.store) == 0
    assert shop.outbox.store.count_dead_letters() == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert message.id == good.id


def test_retry_inside_a_rolled_back_unit_of_work_is_still_published(shop):
    from celery.contrib.testing.worker import start_worker

    app = shop.app
    effects_queue = f"effects_{uuid.uuid4().hex[:8]}"
    attempts = []

    @app.task(name="shop.flaky", bind=True, shared=False, max_retries=3)
    def flaky(self):
        attempts.append(self.request.retries)
        with shop.outbox.transaction():
            shop.plain.apply_async((f"effect of attempt {self.request.retries}",), queue=effects_queue)
            if self.request.retries == 0:
                raise self.retry(countdown=0)
        return "done"

    app.conf.result_backend = "cache+memory://"
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = flaky.delay()
        assert result.get(timeout=10) == "done"
    assert attempts == [0, 1]
    assert [m.args for m in receive_until_marker(app, effects_queue, "end")] == [["effect of attempt 1"]]


def test_replace_inside_a_unit_of_work_is_published(shop):
    from celery.contrib.testing.worker import start_worker

    app = shop.app
    effects_queue = f"effects_{uuid.uuid4().hex[:8]}"

    @app.task(name="shop.replaced", bind=True, shared=False)
    def replaced(self):
        with shop.outbox.transaction():
            raise self.replace(shop.plain.si("replacement").set(queue=effects_queue))

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = replaced.delay()
        (message,) = receive(app, effects_queue, 1)
    assert message.args == ["replacement"]
    assert (message.id, message.headers["replaced_task_nesting"]) == (result.id, 1)


def test_a_plain_tasks_body_runs_on_the_request_the_worker_pushed(shop):
    """With the outbox every task is an ``InboxTask``, whose class has a ``__call__`` of its own; the
    body still runs on the request Celery's tracer pushed, as a plain task's body does without the
    outbox. (``Task.__call__`` would push a second request; before Celery 5.5 one of the arguments
    alone, with no id, so that a ``retry`` or ``replace`` inside a unit of work was not known as the
    running task's and went with the rolled-back unit.)"""
    from celery.contrib.testing.worker import start_worker

    app = shop.app
    seen = []

    @app.task(name="shop.seen_plain", bind=True, shared=False)
    def seen_plain(self, note):
        seen.append((self.request.id, self.request.args, self.request.retries, len(self.request_stack.stack),
                     app.current_task is self))

    app.conf.result_backend = "cache+memory://"
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        seen_plain.apply_async(("queued",), task_id="plain-seen-1").get(timeout=10)
    seen_plain("direct")
    assert seen == [("plain-seen-1", ["queued"], 0, 1, True), (None, ("direct",), 0, 1, True)]


def test_beat_runs_the_relay_under_a_documented_name(shop):
    entry = shop.app.conf.beat_schedule["celery_outbox.recover"]
    assert entry["task"] == "celery_outbox.recover"
    assert entry["schedule"] == shop.outbox.settings.recover_interval
    assert entry["options"]["expires"] == shop.outbox.settings.recover_interval
    with pytest.MonkeyPatch.context() as patch:
        _failing_publish(patch)
        shop.durable.delay("stranded")
    assert unsent_rows(shop.outbox.store) == 1
    outcome = shop.app.tasks["celery_outbox.recover"].apply().get()
    assert outcome["published"] == 1
    assert [m.args for m in receive(shop.app, shop.durable_queue, 1)] == [["stranded"]]


def test_eager_mode_runs_tasks_at_once_inside_the_transaction(shop):
    shop.app.conf.task_always_eager = True
    with shop.outbox.transaction():
        result = shop.plain.delay(3)
        assert result.get() == 3, "task_always_eager runs the task at the call, as plain Celery does"
    assert nothing_more(shop.app, shop.plain_queue)
    assert unsent_rows(shop.outbox.store) == 0


def test_stored_headers_are_kombu_json_and_come_back_whole():
    from datetime import datetime, timezone
    from decimal import Decimal

    from kombu.utils import json as kombu_json

    from celery_outbox.message.envelope import json_text

    headers = {"eta": datetime(2026, 11, 22, 12, 30, tzinfo=timezone.utc), "id": uuid.uuid4(),
               "price": Decimal("9.99"), "raw": b"\xff\x00", "text": "caf\u00e9", "none": None, "n": [1, 2.5]}
    assert json_text(headers) == kombu_json.dumps(headers)
    assert kombu_json.loads(json_text(headers)) == headers


def _sent_events(monkeypatch) -> list[tuple[str, str, object]]:
    """Each ``task-sent`` event the publisher sends: (type, task id, the producer it went with)."""
    from celery_outbox.message.sent_events import SentEvent

    sent: list[tuple[str, str, object]] = []
    real_send = SentEvent.send

    def send(self, producer, retry=None):
        sent.append((self.type, self.fields["uuid"], producer))
        return real_send(self, producer, retry)

    monkeypatch.setattr(SentEvent, "send", send)
    return sent


def test_a_held_messages_task_sent_event_goes_with_the_producer_of_the_units_publishes(sqlite_url, table_prefix,
                                                                                       monkeypatch):
    """A unit of work sends one durable message to wait (its eta far off) and one due now, with
    ``task_send_sent_event``: both events go out after the commit, the held one's first, with the
    producer that publishes the due message: one producer for the unit's publishes."""
    from celery_outbox.producer import broker

    shop = make_shop("memory://", sqlite_url, table_prefix, task_send_sent_event=True)
    shop.outbox.ready()
    acquired = []
    real_kept = broker.kept_pooled_producer

    def kept(app):
        acquired.append(app)
        return real_kept(app)

    monkeypatch.setattr(broker, "kept_pooled_producer", kept)
    sent = _sent_events(monkeypatch)
    with shop.outbox.transaction():
        held = shop.durable.apply_async((1,), eta=utcnow() + timedelta(hours=1))
        due = shop.durable.delay(2)
    assert [(kind, task_id) for kind, task_id, _ in sent] == [("task-sent", held.id), ("task-sent", due.id)]
    assert len(acquired) == 1 and sent[0][2] is sent[1][2], "one producer for the events and the publish"
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert message.id == due.id
    assert outgoing_rows(shop.outbox.store) == (2, 1), "the held message's row waits, unsent"


def test_a_held_messages_task_sent_event_goes_out_when_the_store_fails_before_the_publish(sqlite_url, table_prefix,
                                                                                          monkeypatch, caplog):
    """Delivery tracking off: the due row is taken for its publish in a transaction after the
    commit. When that transaction cannot begin (the store went away), the row stays for the relay,
    as logged, and the held message's ``task-sent`` event still goes out: Celery sent it with the
    send."""
    from celery_outbox.store import Store

    shop = make_shop("memory://", sqlite_url, table_prefix, task_send_sent_event=True, outbox_redeliver_after=None)
    shop.outbox.ready()
    sent = _sent_events(monkeypatch)

    def store_gone(*args, **kwargs):
        raise StoreUnavailable("the store went away")

    with shop.outbox.transaction():
        held = shop.durable.apply_async((1,), eta=utcnow() + timedelta(hours=1))
        shop.durable.delay(2)
        monkeypatch.setattr(Store, "take_outgoing_to_delete", store_gone)
    assert [(kind, task_id) for kind, task_id, _ in sent] == [("task-sent", held.id)]
    assert "could not finish publishing committed messages (the relay will)" in caplog.text
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 2, "both rows wait for the relay"


def test_a_short_durable_countdown_is_published_at_the_commit_with_its_eta(shop):
    """Inside the release window the message goes out with the commit, eta kept; its redelivery
    counts from its eta, so it is not published again while the worker holds it."""
    with shop.outbox.transaction():
        result = shop.durable.apply_async(("soon",), countdown=10)
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (result.id, ["soon"])
    (row,) = outgoing(shop)
    eta = datetime.fromisoformat(message.headers["eta"])
    assert as_utc(row.deliver_at) == eta and row.sent_at is not None
    assert as_utc(row.redeliver_at) == eta + timedelta(seconds=shop.outbox.settings.redeliver_after)


def test_a_durable_countdown_outside_a_unit_of_work_is_held_too(shop):
    shop.durable.apply_async(("later",), countdown=60)
    assert len(outgoing(shop)) == 1
    assert nothing_more(shop.app, shop.durable_queue)


def test_a_countdown_to_a_plain_queue_keeps_celerys_broker_eta(shop):
    with shop.outbox.transaction():
        shop.plain.apply_async(("later",), countdown=60)
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert message.headers["eta"] is not None
    assert outgoing(shop) == []


def test_without_delivery_tracking_sent_rows_are_deleted(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_redeliver_after=None)
    shop.outbox.ready()
    result = shop.durable.delay(1)
    assert outgoing(shop) == []
    assert receive(shop.app, shop.durable_queue, 1)[0].id == result.id
    assert shop.outbox.recover().redelivered == 0
