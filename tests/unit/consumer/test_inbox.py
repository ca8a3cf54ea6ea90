"""The inbox (``celery_outbox.consumer.inbox``) on SQLite with an in-process worker: claims, duplicates,
retries, dead letters. Without a worker, deliveries run in the test's thread as a pool process runs
them, on a fixed clock and through a fake outlet (tests/unit/doubles.py).

Real worker processes on PostgreSQL, Redis and RabbitMQ: tests/integration/test_inbox_workers.py.
"""

from __future__ import annotations

import logging
import threading
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest
from celery import Celery, Task, signals
from celery.contrib.testing.worker import start_worker
from celery.worker.request import Request
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.exc import IntegrityError

from celery_outbox import IdempotencyStyle, IdempotentTask, Outbox
from celery_outbox.errors import OutboxError
from celery_outbox.monitoring.tracing import Step
from celery_outbox.signals import duplicate_discarded
from celery_outbox.store import as_utc

from ...brokers import copy_options, receive_until_marker
from ...conftest import drop_store
from ...versions import CELERY


class Harness:
    """An app with an in-process solo worker, a user table, and a record of task outcomes."""

    def __init__(self, sqlite_url: str, prefix: str, queue: str | None = None, **conf):
        suffix = uuid.uuid4().hex[:8]
        self.queue, self.other_queue = queue or f"q_{suffix}", f"other_{suffix}"
        self.app = Celery(f"inbox_{suffix}", broker="memory://", set_as_current=False)
        self.app.conf.update(task_default_queue=self.queue, outbox_database_url=sqlite_url,
                             outbox_table_prefix=prefix, result_backend="cache+memory://",
                             broker_transport_options={"polling_interval": 0.01}, **conf)
        self.outbox = Outbox(self.app)
        self.outbox.ready()
        self.metadata = MetaData()
        self.effects = Table(f"{prefix}effects", self.metadata, Column("id", Integer, primary_key=True),
                             Column("note", String(100)))
        self.metadata.create_all(self.outbox.engine)
        self.runs: list[tuple[str, int]] = []
        self.states: dict[str, list[str]] = {}
        self.failures: list[str] = []
        self.done = threading.Condition()
        self._connect_signals()

    def _connect_signals(self):
        def postrun(sender=None, task_id=None, state=None, **_):
            with self.done:
                self.states.setdefault(task_id, []).append(state)
                self.done.notify_all()

        def failure(sender=None, task_id=None, **_):
            self.failures.append(task_id)

        self._receivers = (postrun, failure)  # keep strong references
        signals.task_postrun.connect(postrun, weak=False)
        signals.task_failure.connect(failure, weak=False)

    def close(self):
        signals.task_postrun.disconnect(self._receivers[0])
        signals.task_failure.disconnect(self._receivers[1])

    def wait_for_states(self, task_id: str, count: int, timeout: float = 15.0) -> list[str]:
        """The task's states once it has ``count`` of them."""
        return self._wait(task_id, lambda states: len(states) >= count, timeout)

    def wait_for_state(self, task_id: str, state: str, timeout: float = 15.0) -> list[str]:
        """The task's states once one of them is ``state``."""
        return self._wait(task_id, lambda states: state in states, timeout)

    def _wait(self, task_id: str, reached: Callable[[list[str]], bool], timeout: float) -> list[str]:
        with self.done:
            assert self.done.wait_for(lambda: reached(self.states.get(task_id, [])), timeout), self.states
            return list(self.states[task_id])

    def effect_count(self) -> int:
        with self.outbox.engine.begin() as conn:
            return conn.execute(select(func.count()).select_from(self.effects)).scalar_one()

    def worker(self, queues=None):
        return start_worker(self.app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                            queues=queues or [self.queue])


@pytest.fixture
def harness(sqlite_url, table_prefix):
    harness = Harness(sqlite_url, table_prefix)
    yield harness
    harness.close()


def define_pay(harness, **options):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.pay", shared=False, **options)
    def pay(self, note):
        harness.runs.append((self.request.id, self.request.retries))
        self.session.execute(insert(harness.effects).values(note=note))
        return note

    return pay


def send_pay_and_its_copy(harness, pay) -> None:
    """``pay-1`` runs in an in-process worker, then a copy of its send arrives and is discarded."""
    with harness.worker():
        pay.apply_async(("first",), **copy_options("pay-1"))
        assert harness.wait_for_states("pay-1", 1) == ["SUCCESS"]
        pay.apply_async(("copy",), **copy_options("pay-1"))
        assert harness.wait_for_states("pay-1", 2) == ["SUCCESS", "IGNORED"]


@contextmanager
def discards() -> Iterator[list[tuple[str, str, str]]]:
    """The (message id, task name, queue) of each ``duplicate_discarded`` signal while the block runs."""
    discarded: list[tuple[str, str, str]] = []

    def on_discard(sender, message_id, task_name, queue, **_):
        discarded.append((message_id, task_name, queue))

    duplicate_discarded.connect(on_discard)
    try:
        yield discarded
    finally:
        duplicate_discarded.disconnect(on_discard)


@contextmanager
def inbox_log() -> Iterator[list[logging.LogRecord]]:
    """The inbox's records at INFO and above while the block runs (the in-process worker sets the
    root logger to ERROR, so pytest's ``caplog`` does not see them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("celery_outbox.inbox")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


def test_same_id_delivered_twice_runs_once(harness):
    pay = define_pay(harness)
    with discards() as discarded:
        send_pay_and_its_copy(harness, pay)
    assert harness.runs == [("pay-1", 0)]
    assert harness.effect_count() == 1
    assert harness.failures == []
    assert discarded == [("pay-1", "shop.pay", harness.queue)]
    row = harness.outbox.store.get_incoming("pay-1")
    assert (row.status, row.duplicates) == ("handled", 1)
    assert row.keep_until is not None and row.handled_at is not None


def test_the_discarded_duplicate_is_logged_with_its_fields(harness):
    """A real duplicate, discarded by an in-process worker: its INFO line has the fields."""
    pay = define_pay(harness)
    with inbox_log() as records:
        send_pay_and_its_copy(harness, pay)
    (record,) = [r for r in records if "discarded duplicate" in r.getMessage()]
    assert {name: getattr(record, name) for name in ("message_id", "task_name", "queue", "attempt")} == {
        "message_id": "pay-1", "task_name": "shop.pay", "queue": harness.queue, "attempt": "0.0.0"}


def test_an_exception_rolls_back_the_claim_and_the_effects_and_dead_letters_the_envelope(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.broken", shared=False)
    def broken(self, note):
        self.session.execute(insert(harness.effects).values(note=note))
        raise ValueError(f"cannot handle {note}")

    with harness.worker():
        broken.apply_async(("x",), **copy_options("broken-1"))
        assert harness.wait_for_states("broken-1", 1) == ["FAILURE"]
        broken.apply_async(("x",), **copy_options("broken-1"))
        assert harness.wait_for_states("broken-1", 2) == ["FAILURE", "IGNORED"]
    assert harness.effect_count() == 0, "the body's writes rolled back"
    assert harness.failures == ["broken-1"], "the duplicate is no failure"
    assert harness.outbox.store.get_incoming("broken-1").status == "dead"
    with harness.outbox.store.begin() as conn:
        (letter,) = conn.execute(select(harness.outbox.store.tables.dead_letters)).all()
    assert (letter.message_id, letter.reason, letter.exception_type) == ("broken-1", "failed", "ValueError")
    assert letter.exception_message == "cannot handle x"
    assert "ValueError: cannot handle x" in letter.traceback
    assert letter.body and letter.task_name == "shop.broken"


def test_a_retry_is_a_new_attempt_and_runs(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.flaky", shared=False, max_retries=2)
    def flaky(self):
        harness.runs.append((self.request.id, self.request.retries))
        self.session.execute(insert(harness.effects).values(note=f"attempt {self.request.retries}"))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "ok"

    with harness.worker():
        flaky.apply_async(**copy_options("flaky-1"))
        assert harness.wait_for_states("flaky-1", 2) == ["RETRY", "SUCCESS"]
        flaky.apply_async(**copy_options("flaky-1"))  # a late redelivery of attempt 0
        assert harness.wait_for_states("flaky-1", 3)[-1] == "IGNORED"
    assert harness.runs == [("flaky-1", 0), ("flaky-1", 1)]
    with harness.outbox.engine.begin() as conn:
        assert conn.execute(select(harness.effects.c.note)).scalars().all() == ["attempt 1"]


def test_messages_sent_by_the_body_go_out_after_its_commit(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.notify", shared=False)
    def notify(self, to_queue):
        self.app.send_task("shop.receipt", args=["r"], queue=to_queue)
        assert receive_until_marker(self.app, to_queue, "before-commit") == [], "not before the commit"

    receipts = f"receipts_{uuid.uuid4().hex[:8]}"
    with harness.worker():
        notify.apply_async((receipts,), task_id="n-1")
        assert harness.wait_for_states("n-1", 1) == ["SUCCESS"]
    assert [m.task for m in receive_until_marker(harness.app, receipts, "after")] == ["shop.receipt"]


def test_id_and_destination_runs_one_id_once_per_queue(sqlite_url, table_prefix):
    harness = Harness(sqlite_url, table_prefix, outbox_message_identity="id_and_destination")
    try:
        pay = define_pay(harness)
        with harness.worker(queues=[harness.queue, harness.other_queue]):
            pay.apply_async(("a",), **copy_options("shared-1"), queue=harness.queue)
            pay.apply_async(("b",), **copy_options("shared-1"), queue=harness.other_queue)
            pay.apply_async(("c",), **copy_options("shared-1"), queue=harness.other_queue)
            assert sorted(harness.wait_for_states("shared-1", 3)) == ["IGNORED", "SUCCESS", "SUCCESS"]
        assert harness.effect_count() == 2
    finally:
        harness.close()


def test_eager_style_commits_the_claim_before_the_body(harness_on_each_store):
    """The eager claim commits before the body runs (on PostgreSQL the body's transaction opens in
    the claim's round trip, after its COMMIT): another connection sees it while the body runs."""
    harness = harness_on_each_store
    seen_during_body = []

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.eager", shared=False)
    def eager(self):
        seen_during_body.append(harness.outbox.store.get_incoming(self.request.id).status)

    eager.idempotency = "eager"
    with harness.worker():
        eager.apply_async(**copy_options("e-1"))
        eager.apply_async(**copy_options("e-1"))
        assert harness.wait_for_states("e-1", 2) == ["SUCCESS", "IGNORED"]
    assert seen_during_body == ["running"], "another connection sees the committed claim while the body runs"
    row = harness.outbox.store.get_incoming("e-1")
    assert (row.status, row.owner, row.duplicates) == ("handled", 0, 1)


def test_global_eager_style_setting(sqlite_url, table_prefix):
    harness = Harness(sqlite_url, table_prefix, outbox_idempotency_style="eager")
    try:
        statuses = []

        @harness.app.task(base=IdempotentTask, bind=True, name="shop.g", shared=False)
        def g(self):
            statuses.append(harness.outbox.store.get_incoming(self.request.id).status)

        with harness.worker():
            g.apply_async(task_id="g-1")
            assert harness.wait_for_states("g-1", 1) == ["SUCCESS"]
        assert statuses == ["running"]
    finally:
        harness.close()


def test_a_task_idempotency_that_is_not_a_style_is_an_error_naming_the_task(sqlite_url, table_prefix):
    harness = Harness(sqlite_url, table_prefix)
    try:
        @harness.app.task(base=IdempotentTask, name="shop.odd", shared=False)
        def odd():
            return "ran"

        odd.idempotency = "pessimistic"
        failed = odd.apply()
        assert failed.failed() and isinstance(failed.result, OutboxError)
        assert str(failed.result) == ("shop.odd.idempotency = 'pessimistic' is not valid: expected one of "
                                      "'optimistic', 'eager'")
        odd.idempotency = IdempotencyStyle.EAGER
        assert odd.apply().get() == "ran"
    finally:
        harness.close()


def test_plain_tasks_on_durable_queues_get_an_envelope_and_reject_duplicates(sqlite_url, table_prefix):
    durable_queue = f"durable_{uuid.uuid4().hex[:8]}"
    harness = Harness(sqlite_url, table_prefix + "d", outbox_durable_queues=[durable_queue])
    try:
        calls = []

        @harness.app.task(name="shop.plain_on_durable", shared=False)
        def plain_on_durable(x):
            calls.append(x)

        with harness.worker(queues=[durable_queue]):
            plain_on_durable.apply_async((1,), **copy_options("d-1"), queue=durable_queue)
            plain_on_durable.apply_async((1,), **copy_options("d-1"), queue=durable_queue)
            assert harness.wait_for_states("d-1", 2) == ["SUCCESS", "IGNORED"]
        assert calls == [1]
        row = harness.outbox.store.get_incoming("d-1")
        assert (row.status, row.queue, row.task_name) == ("handled", durable_queue, "shop.plain_on_durable")
        assert row.body and row.headers, "the full envelope is kept for recovery and replay"
    finally:
        harness.close()


def test_direct_calls_and_eager_mode_run_the_body_in_a_unit_of_work(harness, monkeypatch):
    """(Outside a worker: another test's in-process worker may have left Celery's flag that
    forbids ``get()`` in a task set in this process.)"""
    import celery._state

    monkeypatch.setattr(celery._state, "_task_join_will_block", False)
    pay = define_pay(harness)
    assert pay("direct") == "direct"
    assert pay.apply(("eager",)).get() == "eager"
    assert harness.effect_count() == 2
    assert harness.outbox.store.count_incoming() == 0, "no message, nothing to deduplicate"


@pytest.fixture
def harness_on_each_store(database_url, table_prefix):
    """A harness on SQLite and on a real PostgreSQL; its tables are dropped afterwards."""
    harness = Harness(database_url, table_prefix)
    yield harness
    harness.close()
    harness.metadata.drop_all(harness.outbox.engine)
    drop_store(harness.outbox.store)
    harness.outbox.engine.dispose()


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_connection_and_session_are_one_transaction_with_the_claim(harness_on_each_store, style):
    """``self.connection`` (Core) and ``self.session`` (ORM) write in one transaction: the
    Session's own ``commit()`` only flushes, and an exception after it rolls back both writes
    (and, optimistic, the claim); otherwise both commit with the row marked handled."""
    harness = harness_on_each_store
    same_connection = []

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.both", shared=False)
    def both(self, note, fail):
        self.connection.execute(insert(harness.effects).values(note=f"{note} core"))
        self.session.execute(insert(harness.effects).values(note=f"{note} orm"))
        self.session.commit()
        same_connection.append(self.session.connection() is self.connection)
        if fail:
            raise ValueError("after the session's commit")

    both.idempotency = style
    with harness.worker():
        both.apply_async(("failed", True), task_id="both-1")
        assert harness.wait_for_states("both-1", 1) == ["FAILURE"]
        assert harness.effect_count() == 0, "the session's commit did not end the task's transaction"
        both.apply_async(("ok", False), task_id="both-2")
        assert harness.wait_for_states("both-2", 1) == ["SUCCESS"]
    assert same_connection == [True, True]
    with harness.outbox.engine.begin() as conn:
        assert sorted(conn.execute(select(harness.effects.c.note)).scalars()) == ["ok core", "ok orm"]
    assert harness.outbox.store.get_incoming("both-1").status == "dead"
    assert harness.outbox.store.get_incoming("both-2").status == "handled"


def test_a_body_that_never_touches_the_session_makes_none(harness, monkeypatch):
    made = []
    runtime = harness.outbox.runtime
    new_session = runtime.new_session
    monkeypatch.setattr(runtime, "new_session", lambda *a, **kw: made.append(1) or new_session(*a, **kw))

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.core_only", shared=False)
    def core_only(self, note):
        self.connection.execute(insert(harness.effects).values(note=note))

    pay = define_pay(harness)
    with harness.worker():
        core_only.apply_async(("core",), task_id="core-1")
        assert harness.wait_for_states("core-1", 1) == ["SUCCESS"]
        assert made == [], "no ORM Session for a body that writes through self.connection"
        pay.apply_async(("orm",), task_id="orm-1")
        assert harness.wait_for_states("orm-1", 1) == ["SUCCESS"]
    assert made == [1], "one Session, made when the body asked for self.session"
    assert harness.effect_count() == 2


def test_a_savepoint_rolled_back_in_the_body_drops_only_its_writes_and_messages(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.partly", shared=False)
    def partly(self):
        self.connection.execute(insert(harness.effects).values(note="kept"))
        self.app.send_task("shop.receipt", args=["kept"], queue=harness.other_queue)
        with pytest.raises(ValueError):
            with self.session.begin_nested():
                self.session.execute(insert(harness.effects).values(note="dropped"))
                self.app.send_task("shop.receipt", args=["dropped"], queue=harness.other_queue)
                raise ValueError("undo the savepoint")
        self.app.send_task("shop.receipt", args=["after"], queue=harness.other_queue)

    with harness.worker():
        partly.apply_async(task_id="sp-1")
        assert harness.wait_for_states("sp-1", 1) == ["SUCCESS"]
    with harness.outbox.engine.begin() as conn:
        assert conn.execute(select(harness.effects.c.note)).scalars().all() == ["kept"]
    assert [m.args for m in receive_until_marker(harness.app, harness.other_queue, "end")] == [["kept"], ["after"]]
    assert harness.outbox.store.get_incoming("sp-1").status == "handled"


def test_rolling_back_inside_the_body_fails_the_task_with_a_clear_error(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.rolls_back", shared=False)
    def rolls_back(self, note):
        self.session.execute(insert(harness.effects).values(note=note))
        self.session.rollback()
        self.app.send_task("shop.receipt", args=["r"], queue=harness.other_queue)

    with harness.worker():
        rolls_back.apply_async(("x",), task_id="rb-1")
        assert harness.wait_for_states("rb-1", 1) == ["FAILURE"]
    assert harness.effect_count() == 0
    assert harness.outbox.store.get_incoming("rb-1").status == "dead"
    with harness.outbox.store.begin() as conn:
        (letter,) = conn.execute(select(harness.outbox.store.tables.dead_letters)).all()
    assert letter.exception_type == "OutboxError"
    assert "rolled back inside its body" in letter.exception_message
    assert receive_until_marker(harness.app, harness.other_queue, "after") == [], "nothing sent by a failed task"


def test_session_outside_the_body_is_a_clear_error(harness):
    pay = define_pay(harness)
    with pytest.raises(OutboxError, match="only while the task body runs"):
        pay.session  # noqa: B018
    with pytest.raises(OutboxError, match="only while the task body runs"):
        pay.connection  # noqa: B018


def test_idempotent_task_defaults():
    assert IdempotentTask.acks_late is True
    assert IdempotentTask.reject_on_worker_lost is True


def test_the_worker_runs_the_body_on_the_request_it_pushed_and_other_calls_still_run(harness):
    """Under the worker the body runs on the request Celery's tracer pushed, as a plain task's
    body does (``Task.__call__`` would push a copy of it again); a ``__call__`` of another base
    class between ``IdempotentTask`` and ``Task`` still runs; a direct call pushes its own request."""
    seen, audited = [], []

    class Audited(Task):
        abstract = True

        def __call__(self, *args, **kwargs):
            audited.append(args)
            return super().__call__(*args, **kwargs)

    class AuditedIdempotent(IdempotentTask, Audited):
        abstract = True

    def record(task, note):
        seen.append((task.name, note, task.request.id, tuple(task.request.args), len(task.request_stack.stack),
                     harness.app.current_task is task))

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.seen", shared=False)
    def plain_seen(self, note):
        record(self, note)

    @harness.app.task(base=AuditedIdempotent, bind=True, name="shop.audited", shared=False)
    def audited_seen(self, note):
        record(self, note)

    with harness.worker():
        plain_seen.apply_async(("queued",), task_id="seen-1")
        audited_seen.apply_async(("queued",), task_id="seen-2")
        assert harness.wait_for_states("seen-1", 1) == ["SUCCESS"]
        assert harness.wait_for_states("seen-2", 1) == ["SUCCESS"]
    plain_seen("direct")
    # the mixin's __call__ reaches Celery's Task.__call__, which pushes a request of its own: with
    # or without the outbox, before Celery 5.5 it holds the arguments alone (no id)
    audited_id = "seen-2" if CELERY >= (5, 5) else None
    assert seen[:2] == [("shop.seen", "queued", "seen-1", ("queued",), 1, True),
                        ("shop.audited", "queued", audited_id, ("queued",), 2, True)]
    assert seen[2][:4] == ("shop.seen", "direct", None, ("direct",)) and seen[2][4:] == (1, True)
    assert audited == [("queued",)], "the mixin's __call__ ran for the worker's delivery"
    assert harness.outbox.store.get_incoming("seen-1").status == "handled"
    assert harness.outbox.store.get_incoming("seen-2").status == "handled"


def test_an_eager_claim_taken_over_while_the_body_ran_commits_nothing_and_sends_the_message_back(
        harness_on_each_store):
    """Another node took the eager claim over while the body ran (recovery found this node
    dead): the attempt's finish finds the claim no longer ours, so its writes and its messages
    roll back, and the message goes back to the broker (never acked as a duplicate). The copy
    finds the claim's owner gone, takes it over and runs: the effect and the message once."""
    harness = harness_on_each_store
    incoming = harness.outbox.store.tables.incoming

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.overtaken", shared=False)
    def overtaken(self):
        harness.runs.append((self.request.id, self.request.retries))
        if len(harness.runs) == 1:
            with harness.outbox.store.begin() as conn:
                conn.execute(incoming.update().where(incoming.c.message_id == self.request.id).values(owner=424242))
        self.connection.execute(insert(harness.effects).values(note="overtaken"))
        harness.app.send_task("shop.sent_by_the_body", queue=harness.other_queue)

    overtaken.idempotency = "eager"
    with harness.worker():
        overtaken.apply_async(task_id="overtaken-1")
        assert harness.wait_for_states("overtaken-1", 2) == ["REJECTED", "SUCCESS"]
    assert harness.effect_count() == 1, "the overtaken attempt's write rolled back, the copy's committed"
    row = harness.outbox.store.get_incoming("overtaken-1")
    assert (row.status, row.owner, row.duplicates) == ("handled", 0, 0)
    with harness.app.connection_for_read() as connection:
        assert connection.SimpleQueue(harness.other_queue).qsize() == 1, "only the copy's message was published"


def fail_once(monkeypatch, target: Any, name: str, error: BaseException) -> list[BaseException]:
    """Make ``target.name`` raise ``error`` the first time it is called, then work as before; the
    list of the errors it raised."""
    original, raised = getattr(target, name), []

    def failing_once(*args, **kwargs):
        if not raised:
            raised.append(error)
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing_once)
    return raised


def test_a_store_error_after_an_eager_claim_releases_it_and_the_redelivered_copy_runs(harness_on_each_store,
                                                                                     monkeypatch):
    """The eager finish fails on a store error while the database stays up (a deadlock, seen in a
    crash drill): the attempt rolls back, the message goes back to the broker, and the claim is
    released, so the redelivered copy runs instead of meeting this live node's claim as a
    duplicate; its effects are written once. (When the release itself fails, the node's heartbeat
    releases the claim later and the copy goes back until then: REJECTED more than once, never
    IGNORED.)"""
    from sqlalchemy.exc import OperationalError

    harness = harness_on_each_store
    store = harness.outbox.store
    failures = fail_once(monkeypatch, store, "finish_incoming",
                         OperationalError("UPDATE ...", {}, Exception("deadlock detected")))

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.eager_once", shared=False)
    def eager_once(self, note):
        harness.runs.append((self.request.id, self.request.retries))
        self.connection.execute(insert(harness.effects).values(note=note))

    eager_once.idempotency = "eager"
    with harness.worker():
        eager_once.apply_async(("paid",), task_id="eager-store-error")
        states = harness.wait_for_state("eager-store-error", "SUCCESS", timeout=30)
    assert len(failures) == 1
    assert states[-1] == "SUCCESS" and set(states[:-1]) == {"REJECTED"}, states
    assert harness.runs == [("eager-store-error", 0)] * 2, "the body ran again on the redelivered copy"
    assert harness.effect_count() == 1, "the failed attempt's write rolled back"
    row = store.get_incoming("eager-store-error")
    assert (row.status, row.owner, row.duplicates) == ("handled", 0, 0)


def test_an_eager_claim_whose_node_cannot_register_goes_back_to_the_broker(harness, monkeypatch):
    """The first eager claim of a process registers its node; when the store is locked or away
    right then (SQLite's "database is locked" in a pool process forked under load), that is an
    outage like any other: the message goes back to the broker and runs once the node registers,
    never a failed task whose message is acked."""
    from celery_outbox.errors import StoreUnavailable

    store = harness.outbox.store
    failures = fail_once(monkeypatch, store, "register_node",
                         StoreUnavailable("cannot use the message store: database is locked"))
    harness.outbox.nodes.default.deregister()  # the worker's first claim registers it

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.eager_first", shared=False)
    def eager_first(self, note):
        harness.runs.append((self.request.id, self.request.retries))
        self.connection.execute(insert(harness.effects).values(note=note))

    eager_first.idempotency = "eager"
    with harness.worker():
        eager_first.apply_async(("paid",), task_id="eager-node-locked")
        states = harness.wait_for_state("eager-node-locked", "SUCCESS", timeout=30)
    assert len(failures) == 1
    assert states[-1] == "SUCCESS" and set(states[:-1]) == {"REJECTED"}, states
    assert harness.runs == [("eager-node-locked", 0)], "the body ran once, after the node registered"
    assert harness.effect_count() == 1
    assert store.get_incoming("eager-node-locked").status == "handled"


def test_a_duplicate_the_store_cannot_count_goes_back_and_is_counted_when_it_comes_again(harness_on_each_store,
                                                                                        monkeypatch):
    """The connection counting a discarded duplicate is cut (on PostgreSQL by the server,
    ``pg_terminate_backend``): the copy is not acked uncounted but goes back to the broker, and
    when it comes again it is discarded and counted once; the body ran once."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    harness = harness_on_each_store
    store = harness.outbox.store
    count_duplicate = store.count_duplicate
    cuts = []

    def count_cut_once(conn, *args, **kwargs):
        if not cuts:
            cuts.append("cut")
            if store.is_postgres:
                conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
            raise OperationalError("UPDATE ...", {}, Exception("database is locked"))
        return count_duplicate(conn, *args, **kwargs)

    monkeypatch.setattr(store, "count_duplicate", count_cut_once)
    pay = define_pay(harness)
    with discards() as discarded, harness.worker():
        pay.apply_async(("first",), **copy_options("pay-cut"))
        assert harness.wait_for_states("pay-cut", 1) == ["SUCCESS"]
        pay.apply_async(("copy",), **copy_options("pay-cut"))
        assert harness.wait_for_states("pay-cut", 3, timeout=30) == ["SUCCESS", "REJECTED", "IGNORED"]
    assert cuts == ["cut"]
    assert discarded == [("pay-cut", "shop.pay", harness.queue)], "discarded once, when it was counted"
    assert harness.runs == [("pay-cut", 0)] and harness.effect_count() == 1
    assert harness.failures == []
    row = store.get_incoming("pay-cut")
    assert (row.status, row.duplicates) == ("handled", 1)


def test_a_duplicate_whose_count_fails_for_another_reason_is_discarded_uncounted(harness, monkeypatch):
    """A store error that is no outage (here a programming error) while counting a duplicate: the
    discard stands (a copy that can never be counted must not circle for ever), the warning
    names the message, and the row keeps its count."""
    from sqlalchemy.exc import ProgrammingError

    def count_failing(*args, **kwargs):
        raise ProgrammingError("UPDATE ...", {}, Exception("no such column: duplicates"))

    monkeypatch.setattr(harness.outbox.store, "count_duplicate", count_failing)
    pay = define_pay(harness)
    with inbox_log() as records:
        send_pay_and_its_copy(harness, pay)
    assert any(record.levelno == logging.WARNING and "could not record a duplicate of pay-1" in record.getMessage()
               and "no such column" in record.getMessage() for record in records)
    assert harness.runs == [("pay-1", 0)] and harness.effect_count() == 1
    row = harness.outbox.store.get_incoming("pay-1")
    assert (row.status, row.duplicates) == ("handled", 0)


@pytest.fixture
def durable_harness_on_postgres(postgres_url, table_prefix):
    """A harness on a real PostgreSQL whose queue is durable (delivery tracking on, the default)."""
    durable_queue = f"durable_{uuid.uuid4().hex[:8]}"
    harness = Harness(postgres_url, table_prefix, queue=durable_queue, outbox_durable_queues=[durable_queue])
    yield harness
    harness.close()
    harness.metadata.drop_all(harness.outbox.engine)
    drop_store(harness.outbox.store)
    harness.outbox.engine.dispose()


def define_watched_pay(harness, seen: dict[str, tuple]):
    """``shop.pay`` that records, from a connection of its own while its body runs, the committed
    inbox row of its message (None when there is none) and how many outgoing rows the store has."""
    store = harness.outbox.store

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.pay", shared=False)
    def pay(self, note):
        row = store.get_incoming(self.request.id)
        seen[self.request.id] = (row and (row.status, row.owner, bool(row.body)), store.count_outgoing())
        self.connection.execute(insert(harness.effects).values(note=note))
        if note == "retry" and not self.request.retries:
            raise self.retry(countdown=0)
        return note

    return pay


def test_an_optimistic_attempt_held_by_its_senders_row_commits_nothing_before_its_body(durable_harness_on_postgres):
    """The sender's tracked outgoing row holds the message: the claim, the envelope and the
    acknowledgment of that row are the first statement of the attempt's transaction, and nothing
    is committed before the body runs."""
    harness, seen = durable_harness_on_postgres, {}
    pay = define_watched_pay(harness, seen)
    with harness.worker(queues=[harness.queue]):
        pay.apply_async(("held",), task_id="held-1")
        assert harness.wait_for_states("held-1", 1) == ["SUCCESS"]
    assert seen["held-1"] == (None, 1), "no inbox row committed; the sender's row still there"
    row = harness.outbox.store.get_incoming("held-1")
    assert (row.status, row.owner) == ("handled", 0) and row.body and row.headers, "the envelope is kept"
    assert harness.outbox.store.count_outgoing() == 0, "the sender's row is acknowledged with the claim"
    assert harness.effect_count() == 1


def test_an_optimistic_attempt_without_a_tracked_row_commits_its_envelope_first(durable_harness_on_postgres):
    """A message whose sender's row is gone (a sender without delivery tracking deletes it once
    published): the held claim finds nothing holding the message, rolls back, and the envelope is
    committed before the body, running and unowned, for recovery."""
    harness, seen = durable_harness_on_postgres, {}
    pay = define_watched_pay(harness, seen)
    pay.apply_async(("untracked",), task_id="untracked-1")
    with harness.outbox.engine.begin() as conn:
        conn.execute(harness.outbox.store.tables.outgoing.delete())
    with harness.worker(queues=[harness.queue]):
        assert harness.wait_for_states("untracked-1", 1) == ["SUCCESS"]
    assert seen["untracked-1"] == (("running", 0, True), 0), "the envelope committed, unowned, before the body"
    assert harness.outbox.store.get_incoming("untracked-1").status == "handled"
    assert harness.effect_count() == 1


def test_an_optimistic_retry_from_a_durable_queue_runs_twice_and_leaves_nothing_outgoing(
        durable_harness_on_postgres):
    """The first attempt retries: its rollback puts the sender's row back, and the record of the
    retry acknowledges it. The retry's key has a row already, so its envelope is committed first,
    with no held claim tried."""
    harness, seen = durable_harness_on_postgres, {}
    pay = define_watched_pay(harness, seen)
    store, held_claims = harness.outbox.store, []
    claim_held_envelope = store.claim_held_envelope

    def recorded(conn, row, *args):
        held_claims.append(row["retries"])
        return claim_held_envelope(conn, row, *args)

    store.claim_held_envelope = recorded
    with harness.worker(queues=[harness.queue]):
        pay.apply_async(("retry",), task_id="retry-1")
        assert harness.wait_for_states("retry-1", 2) == ["RETRY", "SUCCESS"]
    assert seen["retry-1"] == (("running", 0, True), 0), "the retry's envelope committed before its body"
    assert held_claims == [0], "only the first attempt tries the held claim: the retry's key has a row"
    row = harness.outbox.store.get_incoming("retry-1")
    assert (row.status, row.retries) == ("handled", 1)
    assert harness.outbox.store.count_outgoing() == 0, "both attempts' rows acknowledged"
    assert harness.effect_count() == 1, "the first attempt's write rolled back with its claim"


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_body_that_swallows_a_database_error_fails_and_commits_nothing(harness_on_each_store, style):
    """``try: insert ... except IntegrityError: pass`` with no savepoint: on PostgreSQL the
    transaction is aborted, so its COMMIT would end as a ROLLBACK. The attempt fails as the body's
    own error would (a dead letter here: no retries), naming the swallowed error; on SQLite, where
    the failed statement alone is undone, the body's other writes commit."""
    harness = harness_on_each_store
    on_postgres = harness.outbox.engine.dialect.name == "postgresql"

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.swallow", shared=False)
    def swallow(self, note):
        self.connection.execute(insert(harness.effects).values(id=1, note=note))
        try:
            self.connection.execute(insert(harness.effects).values(id=1, note="again"))
        except IntegrityError:
            pass
        return note

    swallow.idempotency = style
    with harness.worker():
        swallow.apply_async(("first",), task_id="swallow-1")
        states = harness.wait_for_states("swallow-1", 1)
    row = harness.outbox.store.get_incoming("swallow-1")
    if on_postgres:
        assert states == ["FAILURE"] and harness.effect_count() == 0
        assert row is not None and row.status == "dead", row
        [letter] = harness.outbox.store.list_dead_letters(harness.outbox.store.dead_letter_filter())
        assert letter.message_id == "swallow-1" and "aborted" in letter.exception_message
        assert "IntegrityError" in letter.exception_message, letter.exception_message
    else:
        assert states == ["SUCCESS"] and harness.effect_count() == 1 and row.status == "handled"


def test_a_body_that_catches_a_database_error_in_a_savepoint_keeps_its_other_writes(harness_on_each_store):
    """The idiom the docs give: the statement that may fail in ``begin_nested()``."""
    harness = harness_on_each_store

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.nested", shared=False)
    def nested(self, note):
        self.session.execute(insert(harness.effects).values(id=1, note=note))
        try:
            with self.session.begin_nested():
                self.session.execute(insert(harness.effects).values(id=1, note="again"))
        except IntegrityError:
            pass
        return note

    with harness.worker():
        nested.apply_async(("first",), task_id="nested-1")
        assert harness.wait_for_states("nested-1", 1) == ["SUCCESS"]
    assert harness.effect_count() == 1
    assert harness.outbox.store.get_incoming("nested-1").status == "handled"


def run_here(harness: Harness, task: Task, args: tuple, task_id: str, queue: str | None = None) -> Any:
    """Send a copy of the send ``task_id`` of ``task`` (``copy_options``) and run the delivered message
    in this thread, as a worker's pool process runs it (``Request.execute``): no worker. Returns
    what the task returned."""
    queue = queue or harness.queue
    task.apply_async(args, queue=queue, **copy_options(task_id))
    with harness.app.connection_for_write() as connection:
        message = harness.app.amqp.queues[queue].bind(connection.default_channel).get(accept=["json"])
    assert message is not None, f"nothing delivered on {queue}"
    request = Request(message, app=harness.app, task=harness.app.tasks[task.name], on_ack=lambda *_: None,
                      on_reject=lambda *_: None, hostname="celery@here", eventer=None)
    return request.execute()


def test_a_handled_delivery_is_kept_for_the_dedupe_window_and_its_copy_discarded(harness, fixed_clock):
    """Run in this thread on a fixed clock: the attempt is recorded handled at the clock's instant and
    kept ``outbox_keep_after_handling`` from it; a copy of the send a minute later is discarded,
    counted, and leaves the window as it was."""
    pay = define_pay(harness)
    handled_at = fixed_clock.now
    assert run_here(harness, pay, ("first",), "pay-1") == "first"
    fixed_clock.advance(60)
    run_here(harness, pay, ("copy",), "pay-1")
    assert harness.states["pay-1"] == ["SUCCESS", "IGNORED"]
    assert harness.runs == [("pay-1", 0)] and harness.effect_count() == 1
    row = harness.outbox.store.get_incoming("pay-1")
    assert (row.status, row.duplicates, as_utc(row.handled_at)) == ("handled", 1, handled_at)
    assert as_utc(row.keep_until) == handled_at + timedelta(seconds=harness.outbox.settings.keep_after_handling)


@pytest.fixture
def durable_harness(sqlite_url, table_prefix):
    """A harness whose tasks send to a durable queue, ``harness.durable``."""
    durable = f"durable_{uuid.uuid4().hex[:8]}"
    harness = Harness(sqlite_url, table_prefix, outbox_durable_queues=[durable])
    harness.durable = durable
    yield harness
    harness.close()


def define_ship(harness, outlet, seen: list[list[str]], fails: bool = False):
    """``shop.ship``: sends ``shop.receipt`` to the durable queue, noting what ``outlet`` was asked
    to publish by then (``seen``); with ``fails``, raises after the send."""

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.ship", shared=False)
    def ship(self, note):
        self.app.send_task("shop.receipt", args=[note], queue=harness.durable)
        seen.append([message.message_id for message in outlet.asked])
        if fails:
            raise ValueError("the parcel is lost")
        return note

    return ship


def test_a_bodys_durable_send_reaches_the_outlet_only_after_its_claim_commits(durable_harness, fake_outlet):
    seen: list[list[str]] = []
    ship = define_ship(durable_harness, fake_outlet, seen)
    run_here(durable_harness, ship, ("parcel",), "ship-1")
    assert seen == [[]], "nothing offered to the broker while the body ran"
    (receipt,) = fake_outlet.published
    assert (receipt.task_name, receipt.destination, fake_outlet.steps) == ("shop.receipt", durable_harness.durable,
                                                                           [Step.PUBLISH])
    assert durable_harness.outbox.store.get_incoming("ship-1").status == "handled"


def test_a_body_that_fails_after_a_durable_send_offers_the_outlet_nothing(durable_harness, fake_outlet):
    seen: list[list[str]] = []
    ship = define_ship(durable_harness, fake_outlet, seen, fails=True)
    run_here(durable_harness, ship, ("parcel",), "ship-1")
    assert durable_harness.states["ship-1"] == ["FAILURE"] and seen == [[]]
    assert fake_outlet.asked == [] and fake_outlet.producer.calls == []
    assert durable_harness.outbox.store.get_incoming("ship-1").status == "dead"
