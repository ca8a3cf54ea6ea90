"""Countdowns, ETAs, canvas countdowns and task-sent events: the same scenario on plain Celery and
with the Outbox, one real worker per variant (Redis broker, Redis result backend, PostgreSQL
store), the outbox's maintenance run by explicit ``recover`` passes instead of beat.

Each test asserts the user-visible outcome plain Celery gives: a task runs no earlier than its
eta and sees that eta in ``request.eta``, ``inspect scheduled`` lists it while the worker holds
it, a countdown on a chord or group delays its header, one ``task-sent`` event goes out per send
and a failed one is buffered by Celery's dispatcher. The deliberate differences (a durable message
further than ``outbox_release_ahead`` from its eta waits in the database, so no worker lists it
yet) are asserted as such.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
from celery import chord, group, signals
from sqlalchemy import select

from celery_outbox.signals import message_published
from celery_outbox.store import utcnow

from ..apps import schedule_app
from ..brokers import purge, receive
from ..conftest import drop_store, unique_prefix
from ..services import TcpProxy, require, wait_until
from ..versions import CELERY
from ..workers import WorkerProcess

QUEUES = ["queue", "durable_queue"]  # a plain queue; a durable one (an ordinary queue on plain Celery)


def build(mode: str, broker_url: str, names: dict[str, str]) -> schedule_app.SimpleNamespace:
    world = schedule_app.create(broker_url, names["TEST_BACKEND_URL"], names["TEST_DATABASE_URL"],
                                names["TEST_TABLE_PREFIX"], names["TEST_QUEUE"], names["TEST_DURABLE_QUEUE"],
                                names["TEST_IDLE_QUEUE"], mode == "outbox")
    world.mode, world.redelivered = mode, 0
    return world


@pytest.fixture(scope="module", params=["plain", "outbox"])
def world(request, tmp_path_factory):
    """The app of one variant and one real worker consuming its plain and durable queues (not the
    idle one: a message there is never acknowledged, so delivery tracking redelivers it)."""
    redis_url = require("redis")
    database_url = require("postgres") if request.param == "outbox" else "unused://"
    suffix = uuid.uuid4().hex[:8]
    env = {"TEST_BROKER_URL": redis_url, "TEST_BACKEND_URL": redis_url, "TEST_DATABASE_URL": database_url,
           "TEST_TABLE_PREFIX": unique_prefix(), "TEST_QUEUE": f"when_{suffix}",
           "TEST_DURABLE_QUEUE": f"when_durable_{suffix}", "TEST_IDLE_QUEUE": f"when_idle_{suffix}",
           "TEST_OUTBOX": "1" if request.param == "outbox" else "0"}
    world = build(request.param, redis_url, env)
    world.env = env
    if world.outbox is not None:
        world.outbox.ready()
    log = tmp_path_factory.mktemp(f"schedule_{request.param}") / "worker.log"
    worker = WorkerProcess("tests.apps.schedule_app", env, concurrency=2,
                           queues=[world.queue, world.durable_queue], log_path=log).start()
    try:
        worker.wait_ready()
        yield world
    finally:
        worker.stop(cold=True)
        purge(world.app, world.queue, world.durable_queue, world.idle_queue)
        if world.outbox is not None:
            drop_store(world.outbox.store)
            world.outbox.engine.dispose()


def unit_of_work(world):
    """The outbox's transaction (published after its commit); nothing on plain Celery."""
    return world.outbox.transaction() if world.outbox is not None else contextlib.nullcontext()


def recover(world):
    """One maintenance pass, as beat would run it (plain Celery has none); counts redeliveries."""
    if world.outbox is None:
        return None
    result = world.outbox.recover()
    world.redelivered += result.redelivered
    return result


def tick(world) -> None:
    """A recover pass inside a condition: ``tick(world) or condition``."""
    recover(world)


def settled(world, result, timeout: float = 30):
    """Wait for ``result``, running recover passes meanwhile; its value."""
    wait_until(lambda: tick(world) or result.ready(), timeout=timeout, interval=0.2,
               message=f"{result.id} to finish")
    return result.get(timeout=5)


def scheduled_ids(app) -> list[str]:
    """The ids of the ETA requests the workers hold (``celery inspect scheduled``)."""
    replies = app.control.inspect(timeout=0.5).scheduled() or {}
    return [entry["request"]["id"] for entries in replies.values() for entry in entries or ()]


def outgoing_rows(world):
    table = world.outbox.store.tables.outgoing
    with world.outbox.store.begin() as conn:
        return conn.execute(select(table)).all()


@pytest.mark.parametrize("kind", QUEUES)
def test_an_eta_task_is_held_by_the_worker_and_runs_at_its_eta_seeing_it(world, kind):
    """An eta within ``outbox_release_ahead`` (3 s here): the outbox publishes the message at the
    commit with its eta, so the worker holds it (listed as scheduled) and runs it no earlier than
    its eta, with ``request.eta`` as sent; delivery tracking does not publish it again while the
    worker holds it (its redelivery, 1 s here, counts from the eta)."""
    redelivered = world.redelivered
    eta = utcnow() + timedelta(seconds=2.5)
    with unit_of_work(world):
        result = world.when.apply_async(("short",), eta=eta, queue=getattr(world, kind))
    wait_until(lambda: result.id in scheduled_ids(world.app), timeout=10, message="the worker to hold the task")
    seen = settled(world, result)
    assert seen["eta"] == eta.isoformat(), "request.eta is the eta that was sent"
    assert seen["started"] >= eta.timestamp(), "not run before its eta"
    assert world.redelivered == redelivered, "not redelivered while the worker held it"
    if world.outbox is not None and kind == "durable_queue":
        wait_until(lambda: outgoing_rows(world) == [], timeout=10, message="the inbox to acknowledge the row")


def test_a_long_countdown_is_scheduled_from_its_release_and_runs_at_its_eta(world):
    """An eta beyond ``outbox_release_ahead`` to a durable queue: plain Celery's worker holds the
    message at once; the outbox keeps it in the outgoing table (the deliberate difference: no
    worker lists it yet) until a recover pass inside the window releases it with its eta. From
    then on both are the same: listed as scheduled, run no earlier than the eta, seeing it."""
    redelivered = world.redelivered
    eta = utcnow() + timedelta(seconds=6)
    result = world.when.apply_async(("long",), eta=eta, queue=world.durable_queue)
    if world.outbox is not None:
        assert recover(world).relay.published == 0, "held in the database until the window"
        assert result.id not in scheduled_ids(world.app)
        (row,) = [row for row in outgoing_rows(world) if row.message_id == result.id]
        assert row.sent_at is None
    wait_until(lambda: tick(world) or result.id in scheduled_ids(world.app), timeout=15,
               message="the worker to hold the task")
    if world.outbox is not None:
        assert utcnow() >= eta - timedelta(seconds=schedule_app.OUTBOX_CONF["outbox_release_ahead"]), \
            "released no earlier than the window"
    seen = settled(world, result)
    assert seen["eta"] == eta.isoformat()
    assert seen["started"] >= eta.timestamp()
    assert world.redelivered == redelivered, "the relay's release is not redelivered while the worker holds it"


@pytest.mark.parametrize("kind", QUEUES)
def test_an_eta_task_past_its_expiry_is_revoked_not_run(world, kind):
    """``expires`` before the eta: the worker finds the task expired when it is due and revokes it
    (state REVOKED, the body never runs). On a durable queue the inbox records the attempt as
    ``revoked`` and acknowledges the outgoing row: nothing redelivers it, no dead letter."""
    now = utcnow()
    result = world.when.apply_async(("stale",), eta=now + timedelta(seconds=2), expires=now + timedelta(seconds=1),
                                    queue=getattr(world, kind))
    wait_until(lambda: tick(world) or result.state == "REVOKED", timeout=20, interval=0.2,
               message="the task to be revoked as expired")
    if world.outbox is not None and kind == "durable_queue":
        store = world.outbox.store
        wait_until(lambda: tick(world) or not any(r.message_id == result.id for r in outgoing_rows(world)),
                   timeout=20, interval=0.2, message="the expired row to leave the outgoing table")
        letters = [x for x in store.list_dead_letters(store.dead_letter_filter()) if x.message_id == result.id]
        assert letters == []
        assert store.get_incoming(result.id).status == "revoked"
    assert result.state == "REVOKED", "never run"


@pytest.mark.parametrize("kind", QUEUES)
@pytest.mark.parametrize("canvas", [
    pytest.param("chord", marks=pytest.mark.skipif(
        CELERY < (5, 7), reason="before Celery 5.7 a chord's countdown does not reach its header tasks, in plain "
        "Celery as well (the compatibility suite's DOCUMENTED_SINCE)")),
    "group"])
def test_a_countdown_on_a_chord_or_group_delays_its_header(world, canvas, kind):
    """``chord(header, body).apply_async(countdown=2)`` and ``group(...).apply_async(countdown=2)``:
    every header task starts no earlier than the countdown; a chord's body after its header."""
    queue = getattr(world, kind)
    header = [world.when.s(f"h{i}").set(queue=queue) for i in range(2)]
    sent = time.time()
    with unit_of_work(world):
        if canvas == "chord":
            result = chord(header, world.join.s().set(queue=queue)).apply_async(countdown=2)
        else:
            result = group(header).apply_async(countdown=2)
    value = settled(world, result)
    header_results = result.parent.get(timeout=5) if canvas == "chord" else value
    assert sorted(r["label"] for r in header_results) == ["h0", "h1"]
    assert all(r["started"] >= sent + 2 for r in header_results), "the header waited for the countdown"
    assert all(r["eta"] is not None for r in header_results)
    if canvas == "chord":
        assert value["labels"] == ["h0", "h1"] and value["started"] >= max(r["started"] for r in header_results)


class EventCapture:
    """Every event of the app's broker, received by a real ``app.events.Receiver`` in a thread."""

    def __init__(self, app):
        self.app = app
        self.events: list[dict] = []

    def __enter__(self) -> "EventCapture":
        self.connection = self.app.connection_for_read()
        self.receiver = self.app.events.Receiver(self.connection, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # Events published before the receiver listens reach nobody (Redis PUB/SUB), and on this
        # kombu the first events after a first probe can still be missed: ready once a burst of
        # probes arrives whole.
        wait_until(self._burst_arrives, timeout=20, interval=0, message="the event receiver to listen")
        return self

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def _burst_arrives(self, size: int = 10) -> bool:
        probes = {f"probe-{uuid.uuid4().hex}" for _ in range(size)}
        with self.app.events.default_dispatcher() as dispatcher:
            for probe in probes:
                dispatcher.send("task-probe", uuid=probe)
        try:
            wait_until(lambda: probes <= {e.get("uuid") for e in list(self.events)}, timeout=1)
        except AssertionError:
            return False
        return True

    def all_arrived(self) -> list[dict]:
        """The events so far: a probe sent after the sends arrives after their events."""
        wait_until(self._burst_arrives, timeout=20, interval=0, message="the last probes")
        return list(self.events)

    def __exit__(self, *exc_info) -> None:
        self.receiver.should_stop = True
        self.thread.join(timeout=10)
        self.connection.release()


def test_one_task_sent_event_per_send_with_celerys_fields(world):
    """One ``task-sent`` event per send, with the fields Celery gives it, whatever the outbox does
    with the message: published at the commit, held in the database and relayed, or published
    again by delivery tracking (the idle queue has no consumer)."""
    eta = utcnow() + timedelta(seconds=5)
    redelivered = world.redelivered
    with EventCapture(world.app) as capture:
        sends = {"plain": world.when.apply_async(("plain",), queue=world.queue)}
        with unit_of_work(world):
            sends["durable"] = world.when.apply_async(("durable",), queue=world.durable_queue)
        sends["held"] = world.when.apply_async(("held",), eta=eta, queue=world.durable_queue)
        sends["idle"] = world.when.apply_async(("idle",), queue=world.idle_queue)
        for label in ("plain", "durable", "held"):
            settled(world, sends[label])
        if world.outbox is not None:
            wait_until(lambda: tick(world) or world.redelivered > redelivered, timeout=15, interval=0.2,
                       message="the idle queue's message to be redelivered")
        events = capture.all_arrived()
    queues = {"plain": world.queue, "durable": world.durable_queue, "held": world.durable_queue,
              "idle": world.idle_queue}
    for label, result in sends.items():
        sent = [e for e in events if e["type"] == "task-sent" and e["uuid"] == result.id]
        assert len(sent) == 1, f"{label}: {len(sent)} task-sent events among {len(events)} events"
        (event,) = sent
        expected = {"name": "schedule.when", "queue": queues[label], "exchange": "", "routing_key": queues[label],
                    "args": f"('{label}',)", "kwargs": "{}", "retries": 0, "root_id": result.id, "parent_id": None,
                    "eta": eta.isoformat() if label == "held" else None, "expires": None}
        assert {key: event.get(key) for key in expected} == expected, label
        assert {"hostname", "timestamp", "clock", "pid", "utcoffset"} <= set(event)


@pytest.mark.skipif(CELERY < (5, 7), reason="on Celery and kombu 5.4 the sender retries the task-sent event's "
                    "publish over the lost connection instead of buffering it, in plain Celery as well")
@pytest.mark.parametrize("kind", ["queue", "idle_queue"])
def test_a_task_sent_event_that_cannot_be_published_is_buffered_by_celerys_dispatcher(world, kind):
    """The broker goes away right after the task message is published: the event's publish fails
    and Celery's dispatcher keeps it in its outbound buffer (``buffer_while_offline``); the
    send does not fail and the task message is on its queue (a plain one, and a durable one;
    no worker consumes either)."""
    redis = urlsplit(world.env["TEST_BROKER_URL"])
    proxy = TcpProxy(redis.hostname, redis.port or 6379).start()
    sender = build(world.mode, f"redis://127.0.0.1:{proxy.port}{redis.path}",
                   dict(world.env, TEST_QUEUE=f"cut_{uuid.uuid4().hex[:8]}",
                        TEST_IDLE_QUEUE=f"cut_idle_{uuid.uuid4().hex[:8]}"))
    queue = getattr(sender, kind)

    def cut(**_):
        proxy.stop()

    hook = signals.after_task_publish if sender.outbox is None else message_published
    hook.connect(cut, weak=False)
    try:
        with unit_of_work(sender):
            result = sender.when.apply_async(("cut",), queue=queue)
    finally:
        hook.disconnect(cut)
        proxy.stop()
    buffered = list(sender.app.amqp._event_dispatcher._outbound_buffer)
    assert [(event["type"], event["uuid"]) for event, _ in buffered] == [("task-sent", result.id)]
    assert [routing_key for _, routing_key in buffered] == ["task.sent"]
    try:
        (message,) = receive(world.app, queue, 1)
        assert message.id == result.id
    finally:
        purge(world.app, sender.queue, sender.idle_queue)
    if sender.outbox is not None:
        sender.outbox.engine.dispose()
    with contextlib.suppress(Exception):
        sender.app.pool.force_close_all()
