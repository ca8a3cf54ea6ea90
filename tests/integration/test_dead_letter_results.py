"""A dead letter tells its caller what plain Celery would: the result backend holds the state
Celery stores for the same message, so ``AsyncResult.get()`` raises instead of waiting forever.

Real worker processes (one plain Celery worker and one with the outbox, for the whole module),
Redis as broker and result backend, PostgreSQL as the store. Each behaviour runs the same
scenario with plain Celery and with the outbox and asserts the same outcome, or the documented
difference (a poison message: plain Celery raises the publish error to the sender at once).
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from celery import chain, chord
from celery.exceptions import NotRegistered, TaskRevokedError, WorkerLostError
from celery.result import AsyncResult
from kombu.messaging import Producer
from sqlalchemy import func, select, update

from celery_outbox.store import utcnow

from ..apps import results_app
from ..apps.factory import make_shop, strand, stranded
from ..apps.factory import outgoing as outgoing_of
from ..brokers import purge
from ..conftest import drop_store, unique_prefix, unsent_rows
from ..services import free_port, require, wait_until
from ..unit.maintenance.test_recover import envelope_row, lost_envelopes
from ..versions import CELERY
from ..workers import WorkerProcess
from .test_inbox_workers import publish_raw

TIMEOUT = 30


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A plain Celery worker and an outbox worker (a plain and a durable queue), started once."""
    redis_url, postgres_url = require("redis"), require("postgres")
    suffix, prefix = uuid.uuid4().hex[:8], unique_prefix()
    queues = SimpleNamespace(plain=f"results_plain_{suffix}", outbox=f"results_{suffix}",
                             durable=f"results_durable_{suffix}")
    plain = results_app.create(redis_url, redis_url, queues.plain, queues.durable)
    outboxed = results_app.create(redis_url, redis_url, queues.outbox, queues.durable, postgres_url, prefix)
    outboxed.outbox.ready()
    env = {"TEST_BROKER_URL": redis_url, "TEST_RESULT_BACKEND": redis_url, "TEST_DURABLE_QUEUE": queues.durable}
    logs = tmp_path_factory.mktemp("results")
    workers = [
        WorkerProcess("tests.apps.results_app", {**env, "TEST_QUEUE": queues.plain}, concurrency=1,
                      queues=[queues.plain], log_path=logs / "plain.log").start(),
        WorkerProcess("tests.apps.results_app", {**env, "TEST_QUEUE": queues.outbox, "TEST_DATABASE_URL": postgres_url,
                                                 "TEST_TABLE_PREFIX": prefix},
                      concurrency=1, queues=[queues.outbox, queues.durable], log_path=logs / "outbox.log").start(),
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        yield SimpleNamespace(plain=plain, outboxed=outboxed, queues=queues, redis_url=redis_url,
                              postgres_url=postgres_url, outbox_worker=workers[1])
    finally:
        for worker in workers:
            worker.stop(cold=True)
        purge(plain.app, queues.plain)
        purge(outboxed.app, queues.outbox, queues.durable)
        drop_store(outboxed.outbox.store)
        outboxed.outbox.engine.dispose()


def dead_letters(outbox, message_id):
    store = outbox.store
    return [letter for letter in store.list_dead_letters(store.dead_letter_filter()) if letter.message_id == message_id]


# -- an unknown task -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "outbox", "outbox_durable_queue"])
def test_an_unknown_task_fails_with_not_registered(world, mode):
    """Plain Celery rejects a message for a task its worker does not know and stores
    FAILURE(NotRegistered); the outbox dead-letters it and then stores the same FAILURE, and
    both send the ``task_unknown`` signal: the caller's ``get()`` raises NotRegistered."""
    shop = world.plain if mode == "plain" else world.outboxed
    queue = {"plain": world.queues.plain, "outbox": world.queues.outbox,
             "outbox_durable_queue": world.queues.durable}[mode]
    result = shop.app.send_task("results.nowhere", args=(1,), queue=queue)
    with pytest.raises(NotRegistered) as raised:
        result.get(timeout=TIMEOUT)
    assert "results.nowhere" in str(raised.value)
    assert result.state == "FAILURE"
    signalled = wait_until(lambda: shop.app.backend.client.get(results_app.unknown_signal_key(result.id)),
                           timeout=TIMEOUT, message="the task_unknown signal")
    assert signalled == b"results.nowhere"
    if mode != "plain":
        (letter,) = dead_letters(shop.outbox, result.id)
        assert (letter.reason, letter.task_name, letter.queue) == ("unknown_task", "results.nowhere", queue)
    if mode == "outbox_durable_queue":
        assert outgoing_rows(shop.outbox, result.id) == 0, \
            "the dead letter acknowledged the sender's row: delivery tracking does not publish it again"


def outgoing_rows(outbox, message_id):
    outgoing = outbox.store.tables.outgoing
    with outbox.store.begin() as conn:
        return conn.execute(select(func.count()).select_from(outgoing)
                            .where(outgoing.c.message_id == message_id)).scalar_one()


class EventCapture:
    """Task events from the broker, received in a thread, from when ``start`` returns: it sends
    marker events until one comes back, so the subscription is proven live, not assumed."""

    def __init__(self, app):
        self.app, self.events = app, []
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self.receiver.capture, kwargs={"wakeup": False}, daemon=True)

    def start(self) -> "EventCapture":
        self.thread.start()
        marker = uuid.uuid4().hex
        with self.app.connection_for_write() as connection:
            dispatcher = self.app.events.Dispatcher(connection, enabled=True)

            def marker_came_back():
                dispatcher.send("test-marker", marker=marker)
                return any(event.get("marker") == marker for event in self.events)

            wait_until(marker_came_back, timeout=TIMEOUT, interval=0.2, message="the event subscription")
        return self

    def wait_for(self, kind, task_id):
        return wait_until(lambda: [e for e in self.events if e["type"] == kind and e.get("uuid") == task_id],
                          timeout=TIMEOUT, message=f"the {kind} event of {task_id}")

    def stop(self):
        self.receiver.should_stop = True
        self.thread.join(timeout=10)
        self.connection.release()


@pytest.mark.parametrize("mode", ["plain", "outbox"])
def test_an_unknown_task_sends_the_task_failed_event(world, mode):
    """Celery's worker (with task events on) sends ``task-failed`` with the exception
    ``NotRegistered('<name>')`` for a message of an unknown task; so does the outbox's guard."""
    shop = world.plain if mode == "plain" else world.outboxed
    queue = world.queues.plain if mode == "plain" else world.queues.outbox
    capture = EventCapture(shop.app).start()
    try:
        result = shop.app.send_task("results.nowhere", queue=queue)
        (event,) = capture.wait_for("task-failed", result.id)
    finally:
        capture.stop()
    assert event["exception"] == "NotRegistered('results.nowhere')"


def test_an_unknown_task_with_an_odd_header_is_still_not_registered(world):
    """Celery looks the task name up before reading the other headers: an unknown task with a
    header of the wrong type still fails with NotRegistered, in both; the outbox dead-letters it
    as ``unknown_task``."""
    outcomes = []
    for shop, queue in ((world.plain, world.queues.plain), (world.outboxed, world.queues.outbox)):
        result = shop.app.send_task("results.nowhere", queue=queue, headers={"group_index": "first"})
        with pytest.raises(NotRegistered):
            result.get(timeout=TIMEOUT)
        outcomes.append(result.state)
    assert outcomes == ["FAILURE", "FAILURE"]
    (letter,) = dead_letters(world.outboxed.outbox, result.id)
    assert letter.reason == "unknown_task"


def test_a_message_whose_body_cannot_be_decoded_stores_no_result(world):
    """Celery acks a message whose body cannot be decoded (``on_decode_error``) and stores no
    result; the outbox dead-letters it (``malformed``, on a durable queue) and stores none
    either: PENDING in both. (One message at a time, in order: once the message sent after it
    has its result, the bad one was handled.)"""
    states = []
    for shop, queue in ((world.plain, world.queues.plain), (world.outboxed, world.queues.durable)):
        bad_id = f"undecodable-{uuid.uuid4().hex}"
        publish_raw(shop.app, queue, "\x00{not json", {"task": "results.add", "id": bad_id})
        assert shop.add.apply_async((2, 2), queue=queue).get(timeout=TIMEOUT) == 4
        states.append(AsyncResult(bad_id, app=shop.app).state)
    assert states == ["PENDING", "PENDING"]
    (letter,) = dead_letters(world.outboxed.outbox, bad_id)
    assert letter.reason == "malformed"


# -- the worker running it was lost ----------------------------------------------------------------


@pytest.fixture
def shop(world):
    """An outbox app on the module's Redis and PostgreSQL, a fresh store, no worker: the test
    drives the maintenance functions itself."""
    shop = make_shop(world.redis_url, world.postgres_url, unique_prefix(), result_backend=world.redis_url,
                     outbox_relay_max_attempts=2)
    shop.outbox.ready()
    yield shop
    purge(shop.app, shop.plain_queue, shop.durable_queue)
    drop_store(shop.outbox.store)
    shop.outbox.engine.dispose()


def test_a_lost_worker_fails_with_worker_lost_error(world, shop):
    """Plain Celery: the pool process running the task dies and the task is not re-sent
    (``retry_on_worker_lost`` off): FAILURE(WorkerLostError). The outbox: recovery re-published
    the stranded envelope up to ``outbox_relay_max_attempts`` times and gives up: the dead
    letter (``worker_lost``) commits, then the same FAILURE(WorkerLostError)."""
    plain = world.plain.lose_worker.apply_async(queue=world.queues.plain)
    with pytest.raises(WorkerLostError):
        plain.get(timeout=TIMEOUT)

    task_id = envelope_row(shop, "lost", recoveries=2)
    result = shop.outbox.recover()
    assert (result.envelopes_republished, result.envelopes_dead_lettered) == (0, 1)
    outboxed = AsyncResult(task_id, app=shop.app)
    with pytest.raises(WorkerLostError):
        outboxed.get(timeout=TIMEOUT)
    assert (plain.state, outboxed.state) == ("FAILURE", "FAILURE")
    (letter,) = dead_letters(shop.outbox, task_id)
    assert letter.reason == "worker_lost"


def errback_ran(world, task_id):
    return wait_until(lambda: world.plain.app.backend.client.get(results_app.errback_key(task_id)),
                      timeout=TIMEOUT, message=f"the errback of {task_id}")


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery 5.7 added the re-send cap (retry_on_worker_lost); before it "
                    "Celery hands a lost attempt back to the broker every time (docs/inbox.md)")
def test_a_lost_attempt_of_a_message_a_copy_handled_does_not_fail_it(world):
    """The pool process running an attempt dies past the re-send cap after a copy of its message
    was handled (here the body plays the copy: it marks its inbox row handled, its result not
    stored yet). The copy's outcome is the message's: no dead letter, the delivery is acked, no
    FAILURE(WorkerLostError) is stored over the copy's result and the errback does not run."""
    errback = world.outboxed.record_error.s().set(queue=world.queues.outbox)
    lost = world.outboxed.lost_after_a_copy.apply_async(queue=world.queues.outbox, link_error=errback)
    wait_until(lambda: f"[{lost.id}] lost its worker process 1 times" in world.outbox_worker.log(), timeout=TIMEOUT,
               message="the worker's main process ending the lost attempt")
    # the worker runs one task at a time from one queue: an errback sent on the failure would run before this
    assert world.outboxed.add.apply_async((1, 2), queue=world.queues.outbox).get(timeout=TIMEOUT) == 3
    assert lost.state == "PENDING", "nothing stored over the copy's result"
    assert world.outboxed.app.backend.client.get(results_app.errback_key(lost.id)) is None, "no errback ran"
    assert dead_letters(world.outboxed.outbox, lost.id) == []
    assert world.outboxed.outbox.store.get_incoming(lost.id).status == "handled"
    unacked = world.outboxed.app.backend.client.hvals("unacked")
    assert not any(lost.id.encode() in message for message in unacked), "the delivery is acked"


def test_a_lost_worker_calls_its_errbacks_and_fails_the_rest_of_its_chain(world, shop):
    """Plain Celery: the worker running the first task of a chain is lost: its ``link_error``
    errback runs (an older one, sent as a task with the failed task's id) and the chain's next
    task is marked failed with the same WorkerLostError, so waiting on the chain raises. The
    outbox: recovery gives up on the stranded envelope, and the same happens, from the chain and
    errback its body carries."""
    lose = world.plain.lose_worker.si().set(queue=world.queues.plain,
                                            link_error=world.plain.record_error.s().set(queue=world.queues.plain))
    plain = chain(lose, world.plain.add.si(1, 2).set(queue=world.queues.plain)).apply_async()
    with pytest.raises(WorkerLostError):
        plain.get(timeout=TIMEOUT)
    assert errback_ran(world, plain.parent.id) == b"ran"

    errback = shop.app.signature("results.record_error", queue=world.queues.outbox)  # the outbox worker runs it
    outboxed = stranded(shop, lambda: chain(shop.durable.si("lost").set(link_error=errback),
                                                     shop.plain.si(3)).apply_async())
    assert lost_envelopes(shop, recoveries=2) == [outboxed.parent.id]
    assert shop.outbox.recover().envelopes_dead_lettered == 1
    with pytest.raises(WorkerLostError):
        outboxed.get(timeout=TIMEOUT)
    assert (plain.state, plain.parent.state, outboxed.state, outboxed.parent.state) == ("FAILURE",) * 4
    assert errback_ran(world, outboxed.parent.id) == b"ran"


def test_a_lost_worker_fails_its_chord(world, shop):
    """Plain Celery: the workers running a chord's header tasks are lost: the chord's body is
    marked failed with their WorkerLostError, so waiting on the chord raises it. The outbox:
    recovery gives up on the header's stranded envelopes, and the chord fails the same way, from
    the chord their bodies carry."""
    lose = world.plain.lose_worker.si().set(queue=world.queues.plain)
    plain = chord([lose, lose.clone()], world.plain.total.s().set(queue=world.queues.plain)).apply_async()
    with pytest.raises(WorkerLostError) as plain_raised:
        plain.get(timeout=TIMEOUT)

    body = shop.app.signature("results.total", queue=world.queues.outbox)
    outboxed = stranded(shop, lambda: chord([shop.durable.si("a"), shop.durable.si("b")], body).apply_async())
    assert len(lost_envelopes(shop, recoveries=2)) == 2
    assert shop.outbox.recover().envelopes_dead_lettered == 2
    with pytest.raises(WorkerLostError) as outboxed_raised:
        outboxed.get(timeout=TIMEOUT)
    assert type(plain_raised.value) is type(outboxed_raised.value)


# -- the relay's dead letters ----------------------------------------------------------------------


def expire_outgoing(shop, message_id):
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).where(table.c.message_id == message_id)
                     .values(expires_at=utcnow() - timedelta(seconds=1)))


def test_a_message_that_expired_before_it_was_published_is_revoked_expired(world, shop):
    """Plain Celery's worker receives an expired message, does not run it and stores
    REVOKED("expired"). The outbox relay finds the durable message expired before it was
    published: the dead letter (``expired``) commits, then the same REVOKED("expired")."""
    plain = world.plain.add.apply_async((1, 2), queue=world.queues.plain, expires=utcnow() - timedelta(seconds=1))
    with pytest.raises(TaskRevokedError):
        plain.get(timeout=TIMEOUT)

    (outboxed,) = strand(shop, 5, expires=utcnow() + timedelta(seconds=30))
    expire_outgoing(shop, outboxed.id)
    assert shop.outbox.recover().relay.expired == 1
    with pytest.raises(TaskRevokedError):
        outboxed.get(timeout=TIMEOUT)
    assert (plain.state, outboxed.state) == ("REVOKED", "REVOKED")
    assert str(plain.result) == str(outboxed.result) == "expired"
    (letter,) = dead_letters(shop.outbox, outboxed.id)
    assert letter.reason == "expired"


def test_messages_that_expired_before_they_were_published_fail_their_chord(world, shop):
    """Plain Celery's worker receives a chord's header tasks expired, revokes them, and the chord
    fails with their TaskRevokedError. The outbox relay finds them expired before they were
    published, and the chord they carry fails the same way."""
    past = utcnow() - timedelta(seconds=1)
    header = [world.plain.add.si(1, n).set(queue=world.queues.plain, expires=past) for n in (1, 2)]
    plain = chord(header, world.plain.total.s().set(queue=world.queues.plain)).apply_async()
    with pytest.raises(TaskRevokedError) as plain_raised:
        plain.get(timeout=TIMEOUT)

    body = shop.app.signature("results.total", queue=world.queues.outbox)
    soon = utcnow() + timedelta(seconds=30)
    outboxed = stranded(shop, lambda: chord([shop.durable.si(n).set(expires=soon) for n in (1, 2)],
                                                     body).apply_async())
    for row in outgoing_of(shop):
        expire_outgoing(shop, row.message_id)
    assert shop.outbox.recover().relay.expired == 2
    with pytest.raises(TaskRevokedError) as outboxed_raised:
        outboxed.get(timeout=TIMEOUT)
    assert str(plain_raised.value) == str(outboxed_raised.value) == "expired"


def test_an_expired_message_that_ignores_its_result_stores_none(world, shop):
    """Celery stores no REVOKED for a message sent with ``ignore_result=True`` (its request's
    ``store_errors`` is false); the outbox neither: the state stays PENDING in both. Before Celery
    5.6 ``store_errors`` reads the task's ``ignore_result`` alone: both store REVOKED. (The plain
    worker runs one message at a time in order: once the message sent after it has its result,
    the expired one was handled.)"""
    past = utcnow() - timedelta(seconds=1)
    plain = world.plain.add.apply_async((1, 2), queue=world.queues.plain, expires=past, ignore_result=True)
    after = world.plain.add.apply_async((2, 2), queue=world.queues.plain)
    assert after.get(timeout=TIMEOUT) == 4

    (outboxed,) = strand(shop, 5, expires=utcnow() + timedelta(seconds=30), ignore_result=True)
    expire_outgoing(shop, outboxed.id)
    assert shop.outbox.recover().relay.expired == 1
    state = "PENDING" if CELERY >= (5, 6) else "REVOKED"
    assert (plain.state, outboxed.state) == (state, state)
    (letter,) = dead_letters(shop.outbox, outboxed.id)
    assert letter.reason == "expired"


def test_a_poison_message_fails_with_its_publish_error(world, shop, monkeypatch):
    """A message the broker refuses for itself (here: its publish raises ValueError). Plain
    Celery raises the error to the sender at once (no result is stored: the caller has no
    message id to wait on). The outbox stored the message in the sender's transaction and
    returned its result: the relay tries ``outbox_relay_max_attempts`` times, the dead letter
    (``poison``) commits, then FAILURE with the publish error, which ``get()`` raises. The
    same error, delivered later, to a caller that cannot get it at once."""
    real_publish = Producer.publish

    def publish(self, body, *args, **kwargs):
        if (kwargs.get("headers") or {}).get("argsrepr") in ("(1, 'poison')", "('poison',)"):
            raise ValueError("the broker refuses this message")
        return real_publish(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", publish)
    with pytest.raises(ValueError, match="refuses"):
        world.plain.add.apply_async((1, "poison"), queue=world.queues.plain)

    (outboxed,) = strand(shop, "poison")
    first, second = shop.outbox.recover(), shop.outbox.recover()
    assert (first.relay.failed, first.relay.dead_lettered, second.relay.dead_lettered) == (1, 0, 1)
    with pytest.raises(ValueError, match="refuses"):
        outboxed.get(timeout=TIMEOUT)
    assert outboxed.state == "FAILURE"
    assert unsent_rows(shop.outbox.store) == 0
    (letter,) = dead_letters(shop.outbox, outboxed.id)
    assert (letter.reason, letter.exception_type) == ("poison", "ValueError")


# -- a result backend that fails -------------------------------------------------------------------


def test_a_result_backend_that_fails_is_logged_and_the_dead_letter_kept(world, caplog):
    """The result is written after the dead letter commits: a result backend that cannot be
    reached (nothing listens on its port) is logged for each message, and the dead letters
    are kept (nothing lost). The sender's app has a working
    backend; the maintenance runs in another app on the same store, as a beat or CLI would."""
    prefix = unique_prefix()
    sender = make_shop(world.redis_url, world.postgres_url, prefix, result_backend=world.redis_url)
    maintenance = make_shop(world.redis_url, world.postgres_url, prefix,
                            result_backend=f"redis://127.0.0.1:{free_port()}/0",
                            result_backend_transport_options={"retry_policy": {"max_retries": 0}})
    sender.outbox.ready()
    try:
        sent = strand(sender, 5, 6, expires=utcnow() + timedelta(seconds=30))
        for message in sent:
            expire_outgoing(sender, message.id)
        with caplog.at_level(logging.ERROR, logger="celery_outbox.results"):
            assert maintenance.outbox.recover().relay.expired == 2
        for message in sent:
            (letter,) = dead_letters(sender.outbox, message.id)
            assert letter.reason == "expired"
            assert any(message.id in record.getMessage() and "could not be stored in the result backend"
                       in record.getMessage() for record in caplog.records), caplog.text
    finally:
        purge(sender.app, sender.plain_queue, sender.durable_queue)
        drop_store(sender.outbox.store)
        sender.outbox.engine.dispose()
        maintenance.outbox.engine.dispose()
