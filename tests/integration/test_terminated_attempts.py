"""``revoke(terminate=True)``: the worker's main process records the terminated attempt as
``revoked`` (``MainProcessOutcomes.end_revoked_attempt(..., terminated=True)``), on a real PostgreSQL, whatever
state the killed pool process left its claim in:

* an eager claim (running, owned by a live node): taken over, so recovery never runs it again;
* an optimistic claim, still in the killed process's open transaction: the record waits for that
  transaction to end (the killed process's connection closing rolls it back), then is written; if
  the attempt committed first, its outcome stands;
* a transaction that does not end within ``TERMINATED_LOCK_WAIT``: the record gives up with an
  error (the worker logs it; the revoke stands in that worker), instead of holding up the
  worker's main process.

Real worker processes and a real ``revoke(terminate=True)`` are in
tests/integration/test_unacknowledged_messages.py."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
from celery import Celery
from sqlalchemy import text

from celery_outbox import Outbox
from celery_outbox.consumer import main_process
from celery_outbox.consumer.delivery import Delivery
from celery_outbox.consumer.inbox import installed_inbox
from celery_outbox.consumer.main_process import RevokeRecord, installed_main_process
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import IncomingStatus

from ..conftest import drop_store
from ..services import wait_until
from .test_store_contract import incoming_row, outgoing_row


def durable_outbox(database_url: str, table_prefix: str) -> Iterator[Outbox]:
    """An outbox ready on ``database_url`` with one durable queue, ``durable``; its tables
    dropped after."""
    app = Celery("terminated", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=database_url, outbox_table_prefix=table_prefix,
                    outbox_durable_queues=["durable"])
    outbox = Outbox(app).ready()
    yield outbox
    outbox.node.deregister()
    drop_store(outbox.store)
    outbox.engine.dispose()


@pytest.fixture
def outbox(postgres_url, table_prefix):
    yield from durable_outbox(postgres_url, table_prefix)


def delivery(message_id: str) -> Delivery:
    return Delivery(message_id=message_id, destination="", task_name="t.block", queue="durable", retries=0, nesting=0)


def claim_row(message_id: str, status: IncomingStatus, owner: int) -> dict:
    """The claim of ``delivery(message_id)``'s attempt, as its pool process left it."""
    return incoming_row(message_id, task_name="t.block", queue="durable", status=status.value, owner=owner,
                        claimed_at=utcnow())


def status_of(outbox: Outbox, message_id: str) -> str | None:
    row = outbox.store.get_incoming(message_id)
    return None if row is None else row.status


def test_an_eager_claim_of_a_live_node_is_taken_over_only_when_terminated(outbox):
    """A running claim of a heartbeating node: a plain revoke leaves it (the attempt may still
    finish), a terminated attempt takes it over as revoked."""
    outcomes = installed_main_process(outbox.app)
    for message_id in ("revoked-1", "terminated-1"):
        with outbox.store.begin() as conn:
            outbox.store.insert_incoming(conn, claim_row(message_id, IncomingStatus.RUNNING, outbox.node.id))
    outcomes.end_revoked_attempt(delivery("revoked-1"))
    outcomes.end_revoked_attempt(delivery("terminated-1"), terminated=True)
    assert status_of(outbox, "revoked-1") == IncomingStatus.RUNNING.value
    assert status_of(outbox, "terminated-1") == IncomingStatus.REVOKED.value
    row = outbox.store.get_incoming("terminated-1")
    assert row.owner == 0 and row.recover_after is None, "nothing left for recovery"


class OpenClaim:
    """An optimistic claim in a transaction of its own, left open, as the killed pool process's
    body left it; ``end`` commits or rolls it back."""

    def __init__(self, outbox: Outbox, message_id: str):
        self.context = outbox.engine.begin()
        self.conn = self.context.__enter__()
        self.pid = self.conn.execute(text("SELECT pg_backend_pid()")).scalar()
        outbox.store.insert_incoming(self.conn, claim_row(message_id, IncomingStatus.HANDLED, 0))

    def end(self, commit: bool) -> None:
        if commit:
            self.context.__exit__(None, None, None)
        else:
            self.conn.rollback()
            self.context.__exit__(None, None, None)


def waiting_for_a_lock(outbox: Outbox, holder_pid: int) -> bool:
    with outbox.engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND :holder = ANY("
            "pg_blocking_pids(pid))"), {"holder": holder_pid}).scalar())


def run_in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Start ``work`` in a thread; its outcome (a list) gets what it returned ("done" for None), or the
    exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            returned = work()
            outcome.append("done" if returned is None else returned)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def record_in_thread(outcomes, message_id: str) -> tuple[threading.Thread, list]:
    return run_in_thread(lambda: outcomes.end_revoked_attempt(delivery(message_id), terminated=True))


@pytest.mark.parametrize("commit, status", [(False, IncomingStatus.REVOKED), (True, IncomingStatus.HANDLED)])
def test_an_optimistic_claim_in_an_open_transaction_is_waited_for(outbox, commit, status):
    """The record waits for the killed process's transaction: rolled back (its connection closed),
    the attempt is recorded revoked; committed first, the attempt's own outcome stands."""
    outcomes = installed_main_process(outbox.app)
    claim = OpenClaim(outbox, "optimistic-1")
    thread, outcome = record_in_thread(outcomes, "optimistic-1")
    try:
        wait_until(lambda: waiting_for_a_lock(outbox, claim.pid), timeout=10, message="the record waiting")
    finally:
        claim.end(commit)
    thread.join(timeout=30)
    assert outcome == [RevokeRecord.RECORDED]
    assert status_of(outbox, "optimistic-1") == status.value


def test_a_transaction_that_does_not_end_is_waited_for_only_so_long(outbox, monkeypatch):
    monkeypatch.setattr(main_process, "TERMINATED_LOCK_WAIT", 0.2)
    outcomes = installed_main_process(outbox.app)
    claim = OpenClaim(outbox, "stuck-1")
    try:
        thread, outcome = record_in_thread(outcomes, "stuck-1")
        thread.join(timeout=30)
        assert len(outcome) == 1 and "lock timeout" in str(outcome[0]), outcome
    finally:
        claim.end(commit=False)
    assert status_of(outbox, "stuck-1") is None, "nothing recorded; the revoke stands in the worker"


class HeldSendersRow(OpenClaim):
    """The sender's outgoing row of ``message_id``, deleted in a transaction left open, as an
    optimistic attempt's claim from a durable queue holds it until its body ends."""

    def __init__(self, outbox: Outbox, message_id: str):  # holds no inbox row, only the sender's
        with outbox.store.begin() as conn:  # sent, and tracked
            (self.row_id,) = outbox.store.insert_outgoing(conn, [outgoing_row(
                0, message_id=message_id, destination="durable", routing_key="durable", sent_at=utcnow(),
                redeliver_at=utcnow())])
        self.context = outbox.engine.begin()
        self.conn = self.context.__enter__()
        assert outbox.store.acknowledge_outgoing(self.conn, message_id, None, (0, 0, 0)) == 1


@pytest.mark.parametrize("held", ["the inbox key", "the sender's row"])
def test_a_revoked_copy_gives_up_on_rows_a_running_attempt_holds(outbox, held):
    """A revoked or expired copy, in the worker's main process, while an optimistic attempt of its
    message runs elsewhere: that attempt's open transaction holds the inbox key and, from a
    durable queue, the sender's row. The record gives up after ``BUSY_ROW_WAIT`` (``IN_FLIGHT``:
    the revoke stands, unrecorded) while the attempt still runs, instead of waiting for its body;
    the attempt's own outcome stands."""
    outcomes = installed_main_process(outbox.app)
    holder = OpenClaim(outbox, "running-1") if held == "the inbox key" else HeldSendersRow(outbox, "running-1")
    try:
        thread, outcome = run_in_thread(lambda: outcomes.end_revoked_attempt(delivery("running-1")))
        thread.join(timeout=30)
        assert not thread.is_alive(), "the record still waits for the running attempt"
        assert outcome == [RevokeRecord.IN_FLIGHT]
    finally:
        holder.end(commit=True)
    if held == "the inbox key":
        assert status_of(outbox, "running-1") == IncomingStatus.HANDLED.value, "the attempt's outcome stands"
    else:
        assert status_of(outbox, "running-1") is None, "nothing recorded by the copy"
        assert outbox.store.count_outgoing() == 0, "the attempt acknowledged the sender's row"


def test_a_lost_process_dead_letter_gives_up_on_a_key_another_attempt_holds(outbox):
    """The worker's main process dead-letters an attempt whose pool process died once too often;
    meanwhile another attempt of the message (a copy delivery tracking published again) runs
    elsewhere and holds its key. The dead letter gives up after ``BUSY_ROW_WAIT`` and raises (the
    message goes back to the broker) instead of stalling the consumer for that attempt's body."""
    from celery_outbox.message.dead_letter_rows import dead_letter_row
    from celery_outbox.vocabulary import DeadLetterReason

    outcomes = installed_main_process(outbox.app)
    holder = OpenClaim(outbox, "lost-1")
    letter = dead_letter_row(reason=DeadLetterReason.WORKER_LOST, failed_at=utcnow(), message_id="lost-1")
    try:
        thread, outcome = run_in_thread(lambda: outcomes.end_killed_attempt(delivery("lost-1"), letter))
        thread.join(timeout=30)
        assert not thread.is_alive(), "the dead letter still waits for the running attempt"
        assert len(outcome) == 1 and "lock timeout" in str(outcome[0]), outcome
    finally:
        holder.end(commit=True)
    assert outbox.store.count_dead_letters() == 0
    assert status_of(outbox, "lost-1") == IncomingStatus.HANDLED.value, "the running attempt's outcome stands"


def test_a_failed_attempt_leaves_no_dead_letter_when_a_copy_was_handled_meanwhile(outbox):
    """An optimistic attempt fails and rolls back; a copy waiting for its key runs and commits
    before the failure is recorded. The message is handled: neither the failure's record nor a
    lost pool process's dead-letters it (a dead letter of a handled message could not be replayed)."""
    from celery_outbox.message.dead_letter_rows import dead_letter_row
    from celery_outbox.vocabulary import DeadLetterReason

    outcomes = installed_main_process(outbox.app)
    with outbox.store.begin() as conn:
        outbox.store.insert_incoming(conn, claim_row("copied-1", IncomingStatus.HANDLED, 0))

    @outbox.app.task(name="t.block", shared=False)
    def block() -> None:
        raise AssertionError("not run")

    block.push_request(args=(), kwargs={}, id="copied-1")
    try:
        records = installed_inbox(outbox.app).records
        records.record(block, delivery("copied-1"), IncomingStatus.DEAD, ValueError("failed"))
    finally:
        block.pop_request()
    letter = dead_letter_row(reason=DeadLetterReason.WORKER_LOST, failed_at=utcnow(), message_id="copied-1")
    assert outcomes.end_killed_attempt(delivery("copied-1"), letter) is False
    assert outbox.store.count_dead_letters() == 0
    assert status_of(outbox, "copied-1") == IncomingStatus.HANDLED.value
