"""Bookkeeping made on the way of other work gives up, after ``BUSY_ROW_WAIT``, on a sender's
outgoing row that an attempt running elsewhere holds (an optimistic attempt from a durable queue
deletes it in its claim, in a transaction open until its body ends), on a real PostgreSQL:

* the guard's dead letter of a message the worker cannot run, made in the consumer: the message
  goes back to the broker, from the consumer's timer, for a later try;
* a sender giving back rows whose publish failed though the broker took the message: the rows
  stay marked sent, for delivery tracking to publish again if that attempt rolls back.

The worker's records of revoked and expired copies are in test_terminated_attempts.py."""

from __future__ import annotations

import logging

from celery_outbox.consumer import guard
from celery_outbox.vocabulary import DeadLetterReason

from ..conftest import outgoing_rows
from ..unit.test_hostile_input import FakeMessage, fake_consumer
from .test_terminated_attempts import HeldSendersRow, outbox, run_in_thread  # noqa: F401 - the fixture


def test_the_guards_dead_letter_gives_up_on_a_row_a_running_attempt_holds(outbox):  # noqa: F811
    holder = HeldSendersRow(outbox, "busy-1")
    consumer, message = fake_consumer(), FakeMessage({"task": "t.nowhere", "id": "busy-1"})
    message.delivery_info["routing_key"] = "durable"
    try:
        thread, outcome = run_in_thread(lambda: guard._dead_letter(outbox.runtime, consumer, message,
                                                                   DeadLetterReason.UNKNOWN_TASK, "not registered"))
        thread.join(timeout=30)
        assert not thread.is_alive() and outcome == ["done"], "the consumer still waits for the running attempt"
        assert (message.acked, message.requeued, len(consumer.timer.entries)) == (0, 0, 1), \
            "handed back to the broker later, from the consumer's timer"
        assert outbox.store.count_dead_letters() == 0, "nothing stored this time"
    finally:
        holder.end(commit=True)


def test_rows_whose_publish_failed_stay_marked_sent_while_a_running_attempt_holds_them(outbox, caplog):  # noqa: F811
    holder = HeldSendersRow(outbox, "busy-2")
    try:
        with caplog.at_level(logging.WARNING, logger="celery_outbox.publishing"):
            thread, outcome = run_in_thread(lambda: outbox.publisher._give_back([holder.row_id]))
            thread.join(timeout=30)
        assert not thread.is_alive() and outcome == ["done"], "the sender still waits for the running attempt"
        assert "held by a consumer's running attempt" in caplog.text
    finally:
        holder.end(commit=False)  # the attempt rolled back: the row is the sender's again
    assert outgoing_rows(outbox.store) == (1, 0), "still marked sent: delivery tracking publishes it again"
