"""Batch queries on a real PostgreSQL whose statistics lag behind a backlog.

A backlog (the broker was down, or it lost its messages) piles up faster than autovacuum
analyzes the outgoing table. On such stale statistics the planner estimates a handful of
rows and reads and sorts every matching row for each batch. The relay's and delivery
tracking's batch queries must walk their index instead and stop at the batch's limit.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from sqlalchemy import event

from celery_outbox.store import Store, build_engine, utcnow

from ..conftest import _drop
from .test_store_contract import outgoing_row

BACKLOG, LIMIT = 20_000, 500
BODY = os.urandom(1500)  # a task message of a usual size, incompressible


@pytest.fixture
def stale_store(postgres_url, table_prefix):
    """A store whose outgoing table is never analyzed (autovacuum off for it)."""
    store = Store(build_engine(postgres_url), table_prefix)
    store.migrate()
    with store.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {store.tables.outgoing.name} SET (autovacuum_enabled = false)")
    yield store
    _drop(store)
    store.engine.dispose()


def statements_of(store: Store, call) -> list[tuple[str, object]]:
    """The statements ``call`` sends to the database, with their parameters."""
    sent: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        with store.begin() as conn:
            rows = call(conn)
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert len(rows) == LIMIT
    return sent


def plan_of_last_select(store: Store, statements: list[tuple[str, object]]) -> dict:
    """Replay the statements in one transaction, the last one (the SELECT) under EXPLAIN ANALYZE."""
    *before, (select, parameters) = statements
    assert select.lstrip().upper().startswith("SELECT"), select
    with store.begin() as conn:
        for statement, params in before:
            conn.exec_driver_sql(statement, params)
        return conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {select}", parameters).scalar_one()[0]["Plan"]


def nodes(plan: dict) -> list[dict]:
    return [plan] + [node for child in plan.get("Plans", []) for node in nodes(child)]


def rows_read(plan: dict) -> int:
    return max(node["Actual Rows"] for node in nodes(plan) if "Scan" in node["Node Type"])


def assert_walks_an_index(plan: dict) -> None:
    assert not [node for node in nodes(plan) if node["Node Type"] == "Sort"], plan
    assert rows_read(plan) <= LIMIT, f"a batch of {LIMIT} read {rows_read(plan)} rows: {plan}"


def test_a_relay_batch_reads_only_its_own_rows_of_a_backlog(stale_store):
    store = stale_store
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n, body=BODY) for n in range(BACKLOG)])
    now = utcnow()
    halfway = BACKLOG // 2
    statements = statements_of(store, lambda conn: store.lock_pending_outgoing(conn, LIMIT, now, after_id=halfway))
    assert_walks_an_index(plan_of_last_select(store, statements))
    # the same query as the planner would run it on its own: the trap is real on this table
    unguided = plan_of_last_select(store, statements[-1:])
    assert rows_read(unguided) > LIMIT, "the planner alone did not fall into the trap: the test shows nothing"


def test_a_redelivery_batch_reads_only_its_own_rows_of_a_backlog(stale_store):
    store = stale_store
    past = utcnow() - timedelta(minutes=5)
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n, sent_at=past, redeliver_at=past + timedelta(milliseconds=n))
                                     for n in range(BACKLOG)])
    now = utcnow()
    plan = plan_of_last_select(store, statements_of(
        store, lambda conn: store.lock_unacknowledged_outgoing(conn, now, LIMIT)))
    assert_walks_an_index(plan)


def test_a_relay_batch_reads_no_sent_row_waiting_for_its_acknowledgement(stale_store):
    """Sent rows stay until their consumer acknowledges them; the relay's index holds unsent rows only."""
    store = stale_store
    past = utcnow() - timedelta(minutes=5)
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n, body=BODY, sent_at=past, redeliver_at=past + timedelta(hours=1))
                                     for n in range(BACKLOG)])
        store.insert_outgoing(conn, [outgoing_row(BACKLOG + n, body=BODY) for n in range(LIMIT)])
    plan = plan_of_last_select(store, statements_of(
        store, lambda conn: store.lock_pending_outgoing(conn, LIMIT, utcnow())))
    assert_walks_an_index(plan)
