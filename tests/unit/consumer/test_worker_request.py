"""The worker's main process and the attempt of a pool process that died or was killed
(``OutboxRequest``), on the embedded store.

* Celery hands a lost attempt back to the broker as it is (``reject_on_worker_lost``): the claim
  the dead process held is released first, so that the copy runs at once; when the store cannot
  take the release, the message goes back all the same.
* Celery fails a task at its hard time limit: the attempt ends as ``dead`` with a dead letter,
  over the claim the killed process left, unless Celery hands the message back instead; then the
  claim is released once the pool has killed the process (on the worker's event loop).

Real worker processes: tests/integration/test_inbox_workers.py,
tests/django/test_django_worker_kill.py and tests/integration/test_time_limits.py."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Iterator

import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery
from celery.exceptions import Reject, TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from kombu.asynchronous import Hub, set_event_loop

from celery_outbox import Outbox
from celery_outbox.consumer.celery_internals import HANDS_BACK_AT_TIME_LIMIT, request_context
from celery_outbox.consumer.delivery import Delivery
from celery_outbox.consumer.worker_request import OutboxRequest
from celery_outbox.core.node import this_host

from ...conftest import drop_store
from ...integration.test_store_contract import incoming_row
from ..celery_objects import delivered

DEAD_PID = 4242


@pytest.fixture
def outbox(sqlite_url, table_prefix) -> Iterator[Outbox]:
    """An outbox on SQLite whose app's default queue is durable, with a plain ``acks_late`` task."""
    name = f"lost-{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker="memory://", backend="disabled://", set_as_current=False)
    app.conf.update(task_default_queue=name, outbox_database_url=sqlite_url, outbox_table_prefix=table_prefix,
                    outbox_durable_queues=[name])
    outbox = Outbox(app).ready()

    @app.task(name="t.ship", shared=False, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def ship(*args: Any) -> None:
        pass

    @app.task(name="t.overrun", shared=False, ignore_result=True, time_limit=2)
    def overrun(*args: Any) -> None:
        pass

    @app.task(name="t.overrun_late", shared=False, ignore_result=True, time_limit=2, acks_late=True,
              acks_on_failure_or_timeout=False)
    def overrun_late(*args: Any) -> None:
        pass

    yield outbox
    drop_store(outbox.store)
    outbox.engine.dispose()
    app.close()


class Lost:
    """A delivered request of ``t.ship`` whose pool process ``DEAD_PID`` ran it, with the running
    claim that process's node committed; records what the request handed to the broker."""

    def __init__(self, outbox: Outbox, owner_pid: int = DEAD_PID, task_name: str = "t.ship"):
        app = outbox.app
        task = app.tasks[task_name]
        self.requeued: list[bool] = []
        self.acked: list[bool] = []
        self.request = OutboxRequest(
            delivered(app, task.name), app=app, task=task, on_ack=lambda *a: self.acked.append(True),
            on_reject=lambda _logger, _errors, requeue: self.requeued.append(requeue),
            hostname="w@lost", eventer=None)
        self.request.worker_pid = DEAD_PID
        self.store = outbox.store
        delivery = Delivery.from_context(task, request_context(self.request), outbox.runtime.settings)
        self.key = (delivery.message_id, delivery.destination)
        node = self.store.register_node(f"{this_host()}:{owner_pid}:test", this_host(), owner_pid)
        with self.store.begin() as conn:
            self.store.insert_incoming(conn, incoming_row(**delivery.key(), task_name=task.name, queue=delivery.queue,
                                                          owner=node))

    def fail_with(self, exc: BaseException) -> None:
        try:
            raise exc
        except BaseException:  # noqa: BLE001 - the pool's report of the attempt, as the worker gets it
            self.request.on_failure(ExceptionInfo())

    def time_out(self) -> None:
        """The hard time limit, as the pool reports it (the job's failure, then its timeout); then
        the record's thread, if one started, ends (the pool kills the process meanwhile)."""
        try:
            raise TimeLimitExceeded(2)
        except TimeLimitExceeded:
            self.request.on_failure(ExceptionInfo())
        self.request.on_timeout(soft=False, timeout=2)
        for thread in threading.enumerate():
            if thread.name == "celery-outbox-time-limit":
                thread.join(timeout=30)

    def claim(self) -> tuple[str, bool, bool]:
        """The claim's status, whether an owner holds it, whether it is due for recovery."""
        row = self.store.get_incoming(self.key[0], self.key[1])
        return row.status, row.owner != 0, row.recover_after is not None


def test_a_lost_attempt_handed_back_releases_the_dead_processs_claim_first(outbox, caplog):
    lost = Lost(outbox)
    with caplog.at_level(logging.INFO, logger="celery_outbox.worker_request"):
        lost.fail_with(WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."))
    assert lost.requeued == [True], "Celery hands the message back to the broker"
    assert lost.claim() == ("running", False, True), "released: the copy takes it over"
    assert f"lost its pool process {DEAD_PID}; its claim is released" in caplog.text


def test_a_claim_another_process_holds_is_left_to_it(outbox):
    """The attempt's claim is not the dead process's (another node took it over): it stays."""
    lost = Lost(outbox, owner_pid=DEAD_PID + 1)
    lost.fail_with(WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."))
    assert lost.requeued == [True]
    assert lost.claim() == ("running", True, False)


def test_a_message_handed_back_by_the_body_leaves_the_claim_to_the_body(outbox):
    """``Reject(requeue=True)`` comes from a living process, which released its own claim (or
    holds it): the main process does not touch it."""
    lost = Lost(outbox)
    lost.fail_with(Reject("not now", requeue=True))
    assert lost.requeued == [True]
    assert lost.claim() == ("running", True, False)


def test_a_store_that_cannot_take_the_release_still_hands_the_message_back(outbox, caplog):
    """Another transaction holds SQLite's write lock for longer than ``BUSY_ROW_WAIT``: the release
    gives up, says so, and the message goes back all the same (the copy waits for recovery)."""
    lost = Lost(outbox)
    holder = outbox.engine.connect()
    holder.begin()  # the store's SQLite engine takes the write lock as a transaction begins
    try:
        with caplog.at_level(logging.WARNING, logger="celery_outbox.worker_request"):
            lost.fail_with(WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."))
    finally:
        holder.rollback()
        holder.close()
    assert lost.requeued == [True], "the message is never kept from the broker"
    assert lost.claim() == ("running", True, False)
    assert f"could not release the claim of t.ship[{lost.key[0]}], whose pool process {DEAD_PID} ended" \
        in caplog.text


def test_a_task_failed_at_its_hard_time_limit_ends_as_a_dead_letter(outbox, caplog):
    """The killed process's eager claim is taken over: recovery will not publish it again."""
    lost = Lost(outbox, task_name="t.overrun")
    with caplog.at_level(logging.ERROR, logger="celery_outbox.worker_request"):
        lost.time_out()
    assert lost.claim() == ("dead", False, False)
    (letter,) = outbox.store.list_dead_letters(outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason, letter.exception_type) == (
        lost.key[0], "failed", "TimeLimitExceeded")
    assert f"t.overrun[{lost.key[0]}] failed at its hard time limit (2s); dead-lettered" in caplog.text


@pytest.mark.skipif(not HANDS_BACK_AT_TIME_LIMIT, reason="before Celery 5.7 Celery fails it for good")
def test_a_task_celery_hands_back_at_its_hard_time_limit_keeps_its_attempt(outbox, caplog):
    """``acks_late`` with ``acks_on_timeout`` off (Celery 5.7): Celery hands the message back to the
    broker rather than failing the task for good, so the attempt is not ended. With no event
    loop to release the claim on after the kill (no worker here), the copy waits for recovery."""
    late = Lost(outbox, task_name="t.overrun_late")
    with caplog.at_level(logging.INFO, logger="celery_outbox.worker_request"):
        late.time_out()
    assert late.claim() == ("running", True, False)
    assert outbox.store.count_dead_letters() == 0
    assert (late.acked, late.requeued) == ([], [True])
    assert "with no event loop to release its claim after the kill" in caplog.text


@pytest.mark.skipif(HANDS_BACK_AT_TIME_LIMIT, reason="Celery 5.7 hands the message back (acks_on_timeout)")
def test_before_celery_5_7_a_task_dropped_at_its_hard_time_limit_ends_as_a_dead_letter(outbox):
    """Before Celery 5.7, ``acks_on_failure_or_timeout`` off makes Celery drop the message at the
    hard time limit (rejected, not requeued) and mark ``FAILURE``: the task fails for good, and
    its attempt ends as ``dead`` with a dead letter, as with the message acked."""
    late = Lost(outbox, task_name="t.overrun_late")
    late.time_out()
    assert late.requeued == [False]
    assert late.claim() == ("dead", False, False)
    (letter,) = outbox.store.list_dead_letters(outbox.store.dead_letter_filter())
    assert (letter.reason, letter.exception_type) == ("failed", "TimeLimitExceeded")


@pytest.mark.skipif(not HANDS_BACK_AT_TIME_LIMIT, reason="before Celery 5.7 the message stays unacknowledged")
def test_a_task_handed_back_at_its_hard_time_limit_has_its_claim_released_after_the_kill(outbox, caplog):
    """Celery hands the message back within the pool's hard-time-limit timer, which kills the
    process once it returns: the claim is released in the timer due next, not before."""
    hub = Hub()
    set_event_loop(hub)
    try:
        late = Lost(outbox, task_name="t.overrun_late")
        with caplog.at_level(logging.INFO, logger="celery_outbox.worker_request"):
            late.time_out()
            assert late.requeued == [True]
            assert late.claim() == ("running", True, False), "the process still runs: its claim stays"
            hub.fire_timers()  # the worker's loop, once the pool's timer (and the kill) returned
    finally:
        set_event_loop(None)
        hub.close()
    assert late.claim() == ("running", False, True), "released: the copy takes it over"
    assert outbox.store.count_dead_letters() == 0
    assert f"t.overrun_late[{late.key[0]}] passed its hard time limit; the pool killed its process {DEAD_PID}; " \
           "its claim is released" in caplog.text


def test_a_hard_time_limit_in_a_cold_shutdown_is_left_to_recovery(outbox, monkeypatch):
    monkeypatch.setattr(worker_state, "should_terminate", True)
    lost = Lost(outbox, task_name="t.overrun")
    lost.time_out()
    assert lost.claim() == ("running", True, False)
    assert outbox.store.count_dead_letters() == 0


def test_a_time_limit_record_the_store_cannot_take_is_logged(outbox, caplog, monkeypatch):
    """Another transaction holds SQLite's write lock past the record's wait: it gives up and says
    so; Celery's failure stands."""
    monkeypatch.setattr("celery_outbox.consumer.worker_request.TERMINATED_LOCK_WAIT", 0.2)
    lost = Lost(outbox, task_name="t.overrun")
    holder = outbox.engine.connect()
    holder.begin()
    try:
        with caplog.at_level(logging.ERROR, logger="celery_outbox.worker_request"):
            lost.time_out()
    finally:
        holder.rollback()
        holder.close()
    assert lost.claim() == ("running", True, False)
    assert f"cannot record that t.overrun[{lost.key[0]}] failed at its hard time limit (2s)" in caplog.text
