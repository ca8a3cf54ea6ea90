"""``Store.begin(lock_wait=...)`` on SQLite, the embedded store: every transaction takes the
write lock when it begins (``BEGIN IMMEDIATE``), and an optimistic attempt holds it for its
whole body. A bounded transaction (a record the worker's main process writes, a consumer's dead
letter, a sender giving rows back) waits for it at most ``lock_wait``, not the engine's busy
timeout of 30 s, and gives up with an error ``is_lock_timeout`` recognises; its pooled
connection gets the engine's busy timeout back. (PostgreSQL's ``lock_timeout``:
tests/integration/test_terminated_attempts.py.)"""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError

from celery_outbox.consumer.main_process import RevokeRecord, installed_main_process
from celery_outbox.store import is_lock_timeout
from celery_outbox.store.engine import SQLITE_BUSY_TIMEOUT_MS
from celery_outbox.vocabulary import BUSY_ROW_WAIT

from ..integration.test_terminated_attempts import delivery, durable_outbox


@pytest.fixture
def outbox(sqlite_url, table_prefix):
    yield from durable_outbox(sqlite_url, table_prefix)


@pytest.fixture
def write_lock_held(outbox):
    """Another transaction holding the write lock, as a running optimistic attempt does."""
    holder = outbox.engine.connect()
    holder.begin()
    yield
    holder.rollback()
    holder.close()


def busy_timeouts(outbox) -> list[int]:
    """The busy timeout of every connection the pool holds."""
    pool = outbox.engine.pool
    held = [outbox.engine.connect() for _ in range(pool.checkedin())]
    try:
        return [conn.connection.dbapi_connection.execute("PRAGMA busy_timeout").fetchone()[0] for conn in held]
    finally:
        for conn in held:
            conn.close()


def test_a_bounded_transaction_gives_up_on_the_write_lock_another_holds(outbox, write_lock_held):
    with pytest.raises(OperationalError) as raised:
        with outbox.store.begin(lock_wait=BUSY_ROW_WAIT):
            pass
    assert is_lock_timeout(raised.value), raised.value
    assert set(busy_timeouts(outbox)) == {SQLITE_BUSY_TIMEOUT_MS}, "the pooled connection has its timeout back"


def test_the_main_processs_records_give_up_on_a_running_attempts_write_lock(outbox, write_lock_held):
    """A revoked copy's record is ``IN_FLIGHT`` (the revoke stands unrecorded; the running
    attempt records its own outcome); a lost pool process's dead letter raises a lock timeout
    (its message goes back to the broker)."""
    from celery_outbox.message.dead_letter_rows import dead_letter_row
    from celery_outbox.store import utcnow
    from celery_outbox.vocabulary import DeadLetterReason

    outcomes = installed_main_process(outbox.app)
    assert outcomes.end_revoked_attempt(delivery("revoked-1")) is RevokeRecord.IN_FLIGHT
    letter = dead_letter_row(reason=DeadLetterReason.WORKER_LOST, failed_at=utcnow(), message_id="lost-1")
    with pytest.raises(OperationalError) as raised:
        outcomes.end_killed_attempt(delivery("lost-1"), letter)
    assert is_lock_timeout(raised.value)


def test_once_the_lock_is_free_bounded_and_unbounded_transactions_write(outbox):
    outcomes = installed_main_process(outbox.app)
    assert outcomes.end_revoked_attempt(delivery("revoked-1")) is RevokeRecord.RECORDED
    assert outbox.store.get_incoming("revoked-1").status == "revoked"
    assert set(busy_timeouts(outbox)) == {SQLITE_BUSY_TIMEOUT_MS}
