"""Batch queries on a real PostgreSQL whose statistics lag behind a backlog.

A backlog (the broker was down, or it lost its messages) piles up faster than autovacuum
analyzes the outgoing table. On such stale statistics the planner estimates a handful of
rows and reads and sorts every matching row for each batch. The relay's and delivery
tracking's batch queries must walk their index instead and stop at the batch's limit.

The inbox's pollers of claims must reach its few running rows through the partial indexes
that hold only those, in a prepared statement's generic plan too, never reading the handled
rows that make up nearly all of an inbox.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import pytest
from sqlalchemy import event

from celery_outbox.store import Store, build_engine, utcnow

from ..conftest import drop_store
from .test_store_contract import incoming_row, outgoing_row

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
    drop_store(store)
    store.engine.dispose()


def statements_of(store: Store, call, expect: int | None = LIMIT) -> list[tuple[str, object]]:
    """The statements ``call`` sends to the database, with their parameters; ``call`` returns
    ``expect`` rows (any number with None). Its transaction commits."""
    sent: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        with store.begin() as conn:
            rows = call(conn)
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert expect is None or len(rows) == expect
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
    """Sent rows stay until their consumer acknowledges them; the relay's batch walks only the unsent
    end of its ``(sent_at, id)`` index."""
    store = stale_store
    past = utcnow() - timedelta(minutes=5)
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n, body=BODY, sent_at=past, redeliver_at=past + timedelta(hours=1))
                                     for n in range(BACKLOG)])
        store.insert_outgoing(conn, [outgoing_row(BACKLOG + n, body=BODY) for n in range(LIMIT)])
    plan = plan_of_last_select(store, statements_of(
        store, lambda conn: store.lock_pending_outgoing(conn, LIMIT, utcnow())))
    assert_walks_an_index(plan)


def test_taking_rows_for_a_publish_never_scans_the_table_in_a_generic_plan(stale_store):
    """psycopg prepares a statement after its fifth run, and PostgreSQL may then run a generic plan,
    made without the ids. On a table whose statistics lag behind its backlog that plan must still
    reach the given rows through an index, not read the table. (A partial index of unsent rows once
    led the publisher's take to a sequential scan in a benchmark whose table autovacuum had
    analyzed while small; this backlog did not reproduce that plan, so the test guards the shape,
    not that one history.)"""
    store = stale_store
    table = store.tables.outgoing.name
    past = utcnow() - timedelta(minutes=5)
    for start, count in ((0, 60), (60, BACKLOG)):  # analyzed while small: autovacuum's first look
        with store.begin() as conn:  # published and waiting for their consumer, as publishers leave them
            sent = store.insert_outgoing(conn, [outgoing_row(start + n, body=BODY) for n in range(count)])
        with store.begin() as conn:
            store.finish_sent(conn, sent, past, past + timedelta(hours=1))
            if start == 0:
                conn.exec_driver_sql(f"ANALYZE {table}")
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, [outgoing_row(BACKLOG + n, body=BODY) for n in range(10)])
    now = utcnow()
    (take, parameters), = [(statement, params) for statement, params in statements_of(
        store, lambda conn: store.take_outgoing(conn, ids, now, now + timedelta(minutes=10)), expect=None)
        if statement.lstrip().upper().startswith("UPDATE")]
    with store.begin() as conn:
        store.unmark_sent(conn, ids)  # unsent again, for the replay
    raw = store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(take, parameters, prepare=True)
        taken = sorted(row[0] for row in cursor.fetchall())
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE 'UPDATE%'")
        (name,), = cursor.fetchall()
        cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}(now(), now(), '{{{','.join(map(str, ids))}}}')")
        plan = cursor.fetchone()[0][0]["Plan"]
    finally:
        raw.rollback()
        raw.close()
    assert taken == sorted(ids)  # the statement replayed is the take, and its rows were still unsent
    scans = [node["Node Type"] for node in nodes(plan) if "Scan" in node["Node Type"]
             and node.get("Relation Name") == table]
    assert scans and "Seq Scan" not in scans, plan


# -- the inbox's pollers of claims ------------------------------------------------------------------

HANDLED = 20_000


@pytest.fixture
def busy_inbox(postgres_url, table_prefix):
    """An analyzed inbox of many handled rows and a few running ones: a claim owned by a node,
    stale, and an unowned envelope due for recovery."""
    store = Store(build_engine(postgres_url), table_prefix)
    store.migrate()
    now = utcnow()
    node = store.register_node("busy", "host", 1)
    with store.begin() as conn:
        conn.execute(store.tables.incoming.insert(), [
            incoming_row(f"handled{n}", status="handled", claimed_at=now, keep_until=now + timedelta(days=1))
            for n in range(HANDLED)])
        store.insert_incoming(conn, incoming_row("owned", owner=node, claimed_at=now - timedelta(hours=2)))
        store.insert_incoming(conn, incoming_row("due", recover_after=now - timedelta(seconds=1)))
        conn.exec_driver_sql(f"ANALYZE {store.tables.incoming.name}")
    yield store, node
    drop_store(store)
    store.engine.dispose()


def generic_plan(store: Store, statement: str) -> dict:
    """The plan PostgreSQL makes for ``statement`` (psycopg's ``%(name)s`` placeholders) prepared,
    without its parameters' values: the generic plan a statement psycopg prepared may run."""
    names: dict[str, int] = {}
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.setdefault(m.group(1), len(names) + 1)}", statement)
    raw = store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE generic AS {numbered.replace('%%', '%')}")
        arguments = f"({', '.join(['NULL'] * len(names))})" if names else ""
        cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE generic{arguments}")
        return cursor.fetchone()[0][0]["Plan"]
    finally:
        raw.rollback()
        raw.cursor().execute("DEALLOCATE ALL")  # a prepared statement outlives its transaction
        raw.close()


def test_the_claim_pollers_reach_running_rows_through_partial_indexes_in_a_generic_plan(busy_inbox):
    """Every query of the inbox's claims (dead and orphan owners, stale claims, envelopes due for
    recovery, a node's shutdown) states ``status = 'running'`` as a constant, so that a prepared
    statement's generic plan still walks the partial index of running rows and never reads the
    handled rows, nearly all of an inbox. (An UPDATE may also look the rows it changes up by
    primary key.)"""
    store, node = busy_inbox
    incoming = store.tables.incoming.name
    now = utcnow()
    calls = {
        "recover": lambda conn: store.lock_recoverable_incoming(conn, now, 10),
        "release stale": lambda conn: store.release_stale_incoming(conn, now - timedelta(hours=1), 10, now),
        "release owned": lambda conn: store.release_owned(conn, [node], 10, now),
        "dead owners": store.dead_owners,
        "forget nodes": store.forget_released_nodes,
        "deregister": lambda conn: store.deregister_node(node),
    }
    partial = {ix.name for ix in store.tables.incoming.indexes if ix.dialect_options["postgresql"]["where"] is not None}
    for name, call in calls.items():
        statements = [statement for statement, _ in statements_of(store, call, expect=None) if incoming in statement]
        assert statements, name
        for statement in statements:
            plan = generic_plan(store, statement)
            assert not [node for node in nodes(plan) if node["Node Type"] == "Seq Scan"
                        and node["Relation Name"] == incoming], (name, statement, plan)
            assert {node.get("Index Name") for node in nodes(plan)} & partial, (name, statement, plan)
