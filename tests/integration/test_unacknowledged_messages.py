"""Messages no inbox would acknowledge are not published again by delivery tracking.

Each scenario runs twice, with plain Celery and with the outbox (a durable queue, delivery
tracking with a short ``outbox_redeliver_after``), on real worker processes, a Redis broker and
result backend and (with the outbox) a PostgreSQL store; a task counts its runs in Redis. With
the outbox, ``recover`` (what beat runs) is run once the redelivery time has passed: it must
publish nothing, and the user-visible outcome is plain Celery's:

* revoked before it runs: never runs (also in a worker started after the redelivery time, which
  has forgotten the revoke), state REVOKED; the outgoing row is gone;
* expired while waiting in the broker: never runs, state REVOKED;
* a task whose class does not derive from the app's task base: runs exactly once;
* sent with ``task_protocol = 1``: runs exactly once, its outgoing row acknowledged.

"Never runs" is shown without sleeping: a sentinel task sent after it to the same queue, to a
worker of concurrency 1, has run.
"""

from __future__ import annotations

import json
import socket
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from celery_outbox.store import as_utc, utcnow
from celery_outbox.vocabulary import IncomingStatus

from ..apps import unacked_app
from ..brokers import purge
from ..conftest import drop_store, handled_row, unique_prefix
from ..services import require, wait_until
from ..workers import WorkerProcess

REDELIVER_AFTER = 1.0  # seconds: delivery tracking would publish an unacknowledged message again this soon


class Setup:
    """One worker (prefork, concurrency 1) of tests/apps/unacked_app.py, plain or with the outbox,
    and the same app in this process to send with."""

    def __init__(self, mode: str, log_dir, worker_database_url: str | None = None):
        self.with_outbox = mode == "outbox"
        redis_url = require("redis")
        postgres_url = require("postgres") if self.with_outbox else ""
        suffix = uuid.uuid4().hex[:8]
        conf = {"outbox_redeliver_after": REDELIVER_AFTER} if self.with_outbox else {}
        self.env = {
            "TEST_BROKER_URL": redis_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": unique_prefix(),
            "TEST_QUEUE": f"unacked_{suffix}", "TEST_LATE_QUEUE": f"unacked_late_{suffix}",
            "TEST_COUNTERS": f"unacked_runs_{suffix}", "TEST_WITH_OUTBOX": "1" if self.with_outbox else "0",
            "TEST_CONF": json.dumps(conf),
        }
        self.worker_env = dict(self.env, TEST_DATABASE_URL=worker_database_url or postgres_url)
        self.shop = self._app()
        self.queue, self.late_queue = self.env["TEST_QUEUE"], self.env["TEST_LATE_QUEUE"]
        if self.with_outbox:
            self.shop.outbox.ready()
        self.log_dir = log_dir
        self.workers: list[WorkerProcess] = []
        self.worker = self._start_worker()

    def _app(self, **conf) -> SimpleNamespace:
        env = self.env
        return unacked_app.create(env["TEST_BROKER_URL"], env["TEST_DATABASE_URL"], env["TEST_TABLE_PREFIX"],
                                  env["TEST_QUEUE"], env["TEST_LATE_QUEUE"], env["TEST_COUNTERS"],
                                  self.with_outbox, **json.loads(env["TEST_CONF"]), **conf)

    def _start_worker(self) -> WorkerProcess:
        worker = WorkerProcess("tests.apps.unacked_app", self.worker_env, concurrency=1, queues=[self.queue],
                               log_path=self.log_dir / f"worker{len(self.workers)}.log").start()
        self.workers.append(worker)
        worker.wait_ready()
        name = worker.command[worker.command.index("-n") + 1]
        self.node = name.replace("%h", socket.gethostname())
        return worker

    def restart(self) -> None:
        """A warm shutdown and a new worker: it has forgotten every revoke (kept in memory)."""
        self.worker.stop()
        self.worker = self._start_worker()

    def control(self, method: str, *args, **options) -> None:
        """A remote control command to this test's worker only, once it has answered."""
        command = getattr(self.shop.app.control, method)
        wait_until(lambda: command(*args, destination=[self.node], reply=True, timeout=2, **options), timeout=30,
                   message=f"the worker to answer {method}{args} (log: {self.worker.log_path})")

    def ran_after(self, task_id: str, queue: str) -> int:
        """How often ``task_id`` ran, once a sentinel task sent after it to ``queue`` has run: with
        one pool process, anything of that queue before the sentinel has been taken first."""
        sentinel = self.shop.count.apply_async(queue=queue)
        assert sentinel.get(timeout=30) == sentinel.id
        return self.shop.runs(task_id)

    def outgoing_rows(self, task_id: str) -> list:
        store = self.shop.outbox.store
        table = store.tables.outgoing
        with store.begin() as conn:
            return conn.execute(select(table).where(table.c.message_id == task_id)).all()

    def nothing_redelivered(self, sent_at: datetime) -> None:
        """After the redelivery time: recovery (what beat runs) publishes nothing again."""
        result = self.recover_after_redelivery_time(sent_at)
        assert result.redelivered == 0, result
        assert result.relay.published == 0, result

    def recover_after_redelivery_time(self, sent_at: datetime):
        """One recover pass once the redelivery time of a send at ``sent_at`` has passed, and that
        of every outgoing row still stored (its own ``redeliver_at``: the send stamps it a moment
        after the caller's ``sent_at``, later still when it first registers its node)."""
        due = sent_at + timedelta(seconds=REDELIVER_AFTER)
        if self.with_outbox:
            store = self.shop.outbox.store
            table = store.tables.outgoing
            with store.begin() as conn:
                stamped = conn.execute(select(table.c.redeliver_at).where(table.c.redeliver_at.is_not(None))).scalars()
                due = max([due, *(as_utc(moment) for moment in stamped)])
        wait_until(lambda: utcnow() >= due, timeout=10, message="the redelivery time to pass")
        return self.shop.outbox.recover()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(cold=True)
        purge(self.shop.app, self.queue, self.late_queue)
        self.shop.forget()
        if self.with_outbox:
            drop_store(self.shop.outbox.store)
            self.shop.outbox.engine.dispose()


@pytest.fixture(scope="module", params=["plain", "outbox"])
def setup(request, tmp_path_factory):
    setup = Setup(request.param, tmp_path_factory.mktemp(f"unacked_{request.param}"))
    yield setup
    setup.close()


def test_a_message_revoked_before_it_runs_never_runs(setup):
    task_id = f"revoked-{uuid.uuid4().hex[:8]}"
    setup.control("revoke", task_id)
    sent_at = utcnow()
    result = setup.shop.count.apply_async(task_id=task_id, queue=setup.queue)
    wait_until(lambda: setup.shop.runs(f"revoked:{task_id}") == 1, timeout=30,
               message=f"the worker to discard {task_id} (log: {setup.worker.log_path})")
    assert result.state == "REVOKED"
    if setup.with_outbox:
        # recorded, and the outgoing row acknowledged, before Celery acked the message
        assert setup.outgoing_rows(task_id) == [], "the outgoing row is acknowledged"
        assert setup.shop.outbox.store.get_incoming(task_id).status == IncomingStatus.REVOKED.value
        setup.nothing_redelivered(sent_at)
    setup.restart()
    assert setup.ran_after(task_id, setup.queue) == 0, "never runs, also in a worker that forgot the revoke"
    assert result.state == "REVOKED"


def test_a_running_task_revoked_with_terminate_is_not_run_again(setup):
    """``revoke(terminate=True)`` of a running attempt: Celery kills the pool process running it,
    marks it REVOKED and acknowledges the message. With the outbox the attempt's claim was taken by
    the killed process: recovery, once that process is declared dead, must not publish it again
    as a lost worker's, so it never runs again, also in a worker that forgot the revoke."""
    task_id = f"terminated-{uuid.uuid4().hex[:8]}"
    sent_at = utcnow()
    result = setup.shop.block.apply_async(task_id=task_id, queue=setup.queue)
    wait_until(lambda: setup.shop.runs(task_id) == 1, timeout=30,
               message=f"{task_id} to start (log: {setup.worker.log_path})")
    setup.control("revoke", task_id, terminate=True)
    wait_until(lambda: result.state == "REVOKED", timeout=30, message=f"{task_id} to be REVOKED")
    if setup.with_outbox:
        store = setup.shop.outbox.store
        owner = store.get_incoming(task_id).owner
        published = []

        def owner_declared_dead() -> bool:
            recovered = setup.recover_after_redelivery_time(sent_at)
            published.append(recovered.envelopes_republished + recovered.redelivered + recovered.relay.published)
            return owner == 0 or owner in recovered.nodes_declared_dead

        wait_until(owner_declared_dead, timeout=30, interval=0.2, message="the killed pool process declared dead")
        owner_declared_dead()  # a pass after the declaration, over what it released
        assert sum(published) == 0, "nothing published again"
        assert store.get_incoming(task_id).status == IncomingStatus.REVOKED.value
        assert setup.outgoing_rows(task_id) == [], "the outgoing row is acknowledged"
    setup.restart()
    assert setup.ran_after(task_id, setup.queue) == 1, "ran once, never again"
    assert result.state == "REVOKED"


def test_a_message_expired_in_the_broker_never_runs(setup):
    """The message waits in a queue nobody consumes until it has expired; then the worker takes it."""
    task_id = f"expired-{uuid.uuid4().hex[:8]}"
    expires = datetime.now(timezone.utc) + timedelta(seconds=1)
    sent_at = utcnow()
    result = setup.shop.count.apply_async(task_id=task_id, queue=setup.late_queue, expires=expires)
    wait_until(lambda: datetime.now(timezone.utc) > expires, timeout=10, message="the message to expire")
    setup.control("add_consumer", setup.late_queue)
    wait_until(lambda: setup.shop.runs(f"expired:{task_id}") == 1, timeout=30,
               message=f"the worker to discard {task_id} as expired (log: {setup.worker.log_path})")
    assert result.state == "REVOKED"
    if setup.with_outbox:
        store = setup.shop.outbox.store
        assert setup.outgoing_rows(task_id) == [], "the outgoing row is acknowledged"
        assert store.get_incoming(task_id).status == IncomingStatus.REVOKED.value
        setup.nothing_redelivered(sent_at)
        assert store.count_dead_letters() == 0, "an expiry is no failure"
    assert setup.ran_after(task_id, setup.late_queue) == 0, "never runs"
    assert result.state == "REVOKED"


@pytest.mark.parametrize("task_name", ["foreign", "foreign_custom"])
def test_a_task_of_a_foreign_base_class_runs_once(setup, task_name):
    """``base=celery.Task``, and a base of the user's own with its own request class (kept: it
    still sees the run accepted)."""
    task = getattr(setup.shop, task_name)
    task_id = f"{task_name}-{uuid.uuid4().hex[:8]}"
    sent_at = utcnow()
    result = task.apply_async(task_id=task_id, queue=setup.queue)
    assert result.get(timeout=30) == task_id
    if task_name == "foreign_custom":
        wait_until(lambda: setup.shop.runs(f"request:{task_id}") == 1, timeout=10,
                   message="the user's request class to see the run accepted")
    if setup.with_outbox:
        assert setup.outgoing_rows(task_id) == [], "the inbox acknowledged the outgoing row"
        assert setup.shop.outbox.store.get_incoming(task_id).status == IncomingStatus.HANDLED.value
        setup.nothing_redelivered(sent_at)
    assert setup.ran_after(task_id, setup.queue) == 1, "runs exactly once"
    assert result.state == "SUCCESS"


def test_a_protocol_1_message_runs_once(setup):
    """Sent by an app with ``task_protocol = 1`` (the id and name in the body); the worker converts
    it to protocol 2."""
    sender = setup._app(task_protocol=1)
    try:
        task_id = f"proto1-{uuid.uuid4().hex[:8]}"
        sent_at = utcnow()
        result = sender.count.apply_async(task_id=task_id, queue=setup.queue)
        assert result.get(timeout=30) == task_id
        if setup.with_outbox:
            store = setup.shop.outbox.store
            # every row acknowledged, whatever id it was stored under (the earlier tests' rows are gone)
            wait_until(lambda: store.count_outgoing() == 0, timeout=10,
                       message="the inbox to acknowledge the outgoing row")
            assert store.get_incoming(task_id).status == IncomingStatus.HANDLED.value
            setup.nothing_redelivered(sent_at)
        assert setup.ran_after(task_id, setup.queue) == 1, "runs exactly once"
        assert result.state == "SUCCESS"
    finally:
        if sender.outbox is not None:
            sender.outbox.engine.dispose()


def test_a_revoke_the_store_cannot_record_stands_and_is_recorded_at_the_redelivery(tmp_path):
    """The worker's database is unreachable when it discards a revoked message: the revoke stands
    (never runs, REVOKED, acked as in plain Celery: see the test above), the failure is logged and
    the outgoing row stays unacknowledged. Once the database is back, delivery tracking publishes
    it again; the worker, which still remembers the revoke, discards the copy and records it then:
    the row is acknowledged and nothing more is published."""
    from sqlalchemy.engine import make_url

    from ..services import TcpProxy

    real = make_url(require("postgres"))
    proxy = TcpProxy(real.host or "127.0.0.1", real.port or 5432).start()
    proxied_url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    setup = Setup("outbox", tmp_path, worker_database_url=proxied_url)
    try:
        task_id = f"revoked-{uuid.uuid4().hex[:8]}"
        setup.control("revoke", task_id)
        proxy.stop()
        sent_at = utcnow()
        result = setup.shop.count.apply_async(task_id=task_id, queue=setup.queue)
        wait_until(lambda: setup.shop.runs(f"revoked:{task_id}") == 1, timeout=30,
                   message=f"the worker to discard {task_id} (log: {setup.worker.log_path})")
        assert f"cannot record that unacked.count[{task_id}] was revoked" in setup.worker.log()
        assert len(setup.outgoing_rows(task_id)) == 1, "unacknowledged: the store could not take it"
        assert result.state == "REVOKED"

        proxy.start()
        assert setup.recover_after_redelivery_time(sent_at).redelivered == 1
        wait_until(lambda: setup.shop.runs(f"revoked:{task_id}") == 2, timeout=30,
                   message=f"the worker to discard the copy of {task_id} (log: {setup.worker.log_path})")
        assert setup.outgoing_rows(task_id) == [], "acknowledged with the copy"
        assert setup.shop.outbox.store.get_incoming(task_id).status == IncomingStatus.REVOKED.value
        assert setup.ran_after(task_id, setup.queue) == 0, "never runs"
        assert result.state == "REVOKED"
    finally:
        proxy.start() if proxy._listener is None else None
        setup.close()
        proxy.stop()


def test_an_expired_copy_of_a_running_attempt_does_not_stall_the_worker(tmp_path):
    """An optimistic attempt from a durable queue holds its message's inbox key and its sender's
    row in its open transaction until its body ends. A copy of that message reaching another
    worker past its ``expires`` (as a broker gives a long task back after its visibility timeout)
    is discarded by that worker's main process, which records it first. The record gives up
    after ``BUSY_ROW_WAIT`` instead of waiting for the running body: the worker goes on consuming
    (a task sent after the copy runs while the body still runs), and the running attempt's
    outcome stands."""
    from celery_outbox.vocabulary import SEND_HEADER

    from ..brokers import copy_options

    setup = Setup("outbox", tmp_path)
    plain = unacked_app.create(setup.env["TEST_BROKER_URL"], "", setup.env["TEST_TABLE_PREFIX"], setup.queue,
                               setup.late_queue, setup.env["TEST_COUNTERS"], with_outbox=False)
    other = WorkerProcess("tests.apps.unacked_app", setup.worker_env, concurrency=1, queues=[setup.late_queue],
                          log_path=tmp_path / "other-worker.log")
    setup.workers.append(other)
    task_id = f"held-{uuid.uuid4().hex[:8]}"
    try:
        other.start().wait_ready()
        setup.shop.held.apply_async(**copy_options(task_id), queue=setup.queue)
        wait_until(lambda: setup.shop.runs(task_id) == 1, timeout=30,
                   message=f"{task_id}'s body to run (log: {setup.worker.log_path})")
        plain.app.send_task("unacked.held", task_id=task_id, headers={SEND_HEADER: f"send-of-{task_id}"},
                            queue=setup.late_queue, expires=datetime.now(timezone.utc) - timedelta(seconds=1))
        wait_until(lambda: setup.shop.runs(f"expired:{task_id}") == 1, timeout=30,
                   message=f"the other worker to discard the expired copy (log: {other.log_path})")
        sentinel = setup.shop.count.apply_async(queue=setup.late_queue)
        assert sentinel.get(timeout=30) == sentinel.id, "the other worker goes on consuming"
        store = setup.shop.outbox.store
        assert handled_row(store, task_id) is None and setup.shop.runs(task_id) == 1, \
            "while the first attempt still runs"
        assert "while an attempt of it runs" in other.log_path.read_text()
        setup.shop.release(task_id)
        wait_until(lambda: handled_row(store, task_id) is not None, timeout=30,
                   message=f"the running attempt of {task_id} to end (log: {setup.worker.log_path})")
        assert store.get_incoming(task_id).status == IncomingStatus.HANDLED.value, "its outcome stands"
        assert setup.outgoing_rows(task_id) == [], "the sender's row is acknowledged"
        assert setup.shop.runs(task_id) == 1
    finally:
        setup.shop.release(task_id)
        setup.close()
        plain.forget()
