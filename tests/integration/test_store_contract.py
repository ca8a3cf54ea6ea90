"""The store contract: the same tests against SQLite and a real PostgreSQL.

Invariants: ``migrate`` is idempotent and concurrent-safe; outgoing rows go in with
one INSERT and out with one DELETE; concurrent claimers never take the same row;
an inbox key is inserted once and a duplicate is detected by error code.
"""

from __future__ import annotations

import math
import re
import signal
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
from celery import Celery
from sqlalchemy import Column, MetaData, Table, event, inspect, select
from sqlalchemy.exc import IntegrityError, ProgrammingError

from celery_outbox import IncompatibleSchema, Outbox
from celery_outbox.store import SCHEMA_VERSION, Store, as_utc, build_engine, is_unique_violation, utcnow
from celery_outbox.store.pipeline import prepared_statements

from ..conftest import drop_store


def outgoing_row(n: int, **extra):
    row = dict(
        message_id=f"m{n}", task_name="t.add", destination="q", exchange="", routing_key="q",
        body=b'[[1, 2], {}, {}]', content_type="application/json", content_encoding="utf-8",
        headers="{}", properties="{}", created_at=utcnow(),
    )
    row.update(extra)
    return row


def incoming_row(message_id: str, **extra):
    row = dict(message_id=message_id, destination="", task_name="t.add", queue="q", status="running",
               received_at=utcnow())
    row.update(extra)
    return row


class StatementLog:
    def __init__(self, engine):
        self.statements: list[str] = []
        event.listen(engine, "before_cursor_execute", self._record)
        self.engine = engine

    def _record(self, conn, cursor, statement, parameters, context, executemany):
        self.statements.append(statement)

    def close(self):
        event.remove(self.engine, "before_cursor_execute", self._record)

    def of(self, verb: str) -> list[str]:
        return [s for s in self.statements if s.lstrip().upper().startswith(verb)]


def test_migrate_creates_every_table_and_index_and_is_idempotent(store: Store):
    inspector = inspect(store.engine)
    for table in store.tables.all():
        assert inspector.has_table(table.name)
        names = {ix["name"] for ix in inspector.get_indexes(table.name)}
        assert {ix.name for ix in table.indexes} <= names
    again = store.migrate()
    assert again.created_tables == []
    assert again.version_before == SCHEMA_VERSION
    assert store.schema_version() == SCHEMA_VERSION


def test_migrate_upgrades_version_3_to_the_publish_identity_in_the_inbox_key(store: Store):
    """A store of version 3 (inbox keyed by message id and destination, no ``send_id``) gets the
    column on both tables and in the inbox's primary key; its rows stay, keyed by ``''``, so a
    copy of a message handled before the upgrade is still a duplicate after it."""
    incoming, outgoing = store.tables.incoming, store.tables.outgoing
    version_3 = Table(incoming.name, MetaData(), *[
        Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable, server_default=c.server_default)
        for c in incoming.columns if c.name != "send_id"])
    with store.begin() as conn:
        conn.exec_driver_sql(f'DROP TABLE "{incoming.name}"')
        version_3.create(conn)
        conn.exec_driver_sql(f'ALTER TABLE "{outgoing.name}" DROP COLUMN send_id')
        conn.execute(version_3.insert().values(incoming_row("before", status="handled")))
        conn.execute(store.tables.schema.update().values(version=3))

    result = store.migrate()

    assert (result.version_before, result.version_after) == (3, SCHEMA_VERSION)
    inspector = inspect(store.engine)
    assert inspector.get_pk_constraint(incoming.name)["constrained_columns"] == ["message_id", "destination",
                                                                                "send_id"]
    assert "send_id" in {c["name"] for c in inspector.get_columns(outgoing.name)}
    assert {ix.name for ix in incoming.indexes} <= {ix["name"] for ix in inspector.get_indexes(incoming.name)}
    assert (store.get_incoming("before").status, store.get_incoming("before").send_id) == ("handled", "")
    with store.begin() as conn:
        assert not store.claim_incoming(conn, incoming_row("before")), "a copy of it is still a duplicate"
        assert store.claim_incoming(conn, incoming_row("before", send_id="a-new-send")), "a new send is not"
        store.insert_outgoing(conn, [outgoing_row(1, send_id="a-new-send")])
    assert store.migrate().version_before == SCHEMA_VERSION


def test_migrate_upgrades_version_4_to_outgoing_rows_naming_their_sender(store: Store):
    """A store of version 4 (no ``sender``) gets the column; its rows stay and name no sender, so
    delivery tracking alone redelivers them, as before."""
    outgoing = store.tables.outgoing
    with store.begin() as conn:
        conn.exec_driver_sql(f'ALTER TABLE "{outgoing.name}" DROP COLUMN sender')
        conn.exec_driver_sql(f"INSERT INTO \"{outgoing.name}\" (message_id, destination, body, created_at) "
                             "VALUES ('before', 'q', X'00', CURRENT_TIMESTAMP)" if not store.is_postgres else
                             f"INSERT INTO \"{outgoing.name}\" (message_id, destination, body, created_at) "
                             "VALUES ('before', 'q', '\\x00', now())")
        conn.execute(store.tables.schema.update().values(version=4))

    result = store.migrate()

    assert (result.version_before, result.version_after) == (4, SCHEMA_VERSION)
    with store.begin() as conn:
        assert conn.execute(select(outgoing.c.message_id, outgoing.c.sender)).all() == [("before", None)]
    assert store.migrate().version_before == SCHEMA_VERSION


def test_migrate_upgrades_version_1_outgoing_indexes_to_partial_ones(store: Store):
    """A store made by version 1 (full indexes of redeliver_at and deliver_at) gets the partial
    indexes in their place, and its rows stay where the pollers find them."""
    prefix, outgoing = store.prefix, store.tables.outgoing.name
    with store.begin() as conn:
        for index in ("redelivery", "scheduled"):
            conn.exec_driver_sql(f'DROP INDEX "ix_{prefix}outgoing_{index}"')
        conn.exec_driver_sql(f'CREATE INDEX "ix_{prefix}outgoing_redeliver" ON {outgoing} (redeliver_at)')
        conn.exec_driver_sql(f'CREATE INDEX "ix_{prefix}outgoing_deliver" ON {outgoing} (deliver_at)')
        conn.execute(store.tables.schema.update().values(version=1))
        past = utcnow() - timedelta(minutes=1)
        store.insert_outgoing(conn, [outgoing_row(1), outgoing_row(2, sent_at=past, redeliver_at=past)])

    result = store.migrate()

    assert (result.version_before, result.version_after) == (1, SCHEMA_VERSION)
    assert store.schema_version() == SCHEMA_VERSION
    indexes = {ix["name"]: ix for ix in inspect(store.engine).get_indexes(outgoing)}
    assert not {f"ix_{prefix}outgoing_{old}" for old in ("redeliver", "deliver")} & set(indexes)
    for index in ("sent", "redelivery", "scheduled"):
        assert f"ix_{prefix}outgoing_{index}" in indexes
    now = utcnow()
    with store.begin() as conn:
        assert [row.message_id for row in store.lock_pending_outgoing(conn, 10, now)] == ["m1"]
        assert [row.message_id for row in store.lock_unacknowledged_outgoing(conn, now, 10)] == ["m2"]
    assert store.migrate().version_before == SCHEMA_VERSION


def test_migrate_upgrades_version_2_inbox_indexes_to_partial_ones_of_running_rows(store: Store):
    """A store made by version 2 (full indexes of the inbox's owner, claim time and recovery time)
    gets partial indexes of running rows in their place, and the claim pollers still find their rows."""
    prefix, incoming = store.prefix, store.tables.incoming.name
    new_names = {f"ix_{prefix}incoming_running_{name}" for name in ("owner", "claimed", "recover_after")}
    old_names = {f"ix_{prefix}incoming_{name}" for name in ("owner_status", "status_claimed", "recover_after")}
    now = utcnow()
    with store.begin() as conn:
        for name in new_names:
            conn.exec_driver_sql(f'DROP INDEX "{name}"')
        conn.exec_driver_sql(f'CREATE INDEX "ix_{prefix}incoming_owner_status" ON {incoming} (owner, status)')
        conn.exec_driver_sql(f'CREATE INDEX "ix_{prefix}incoming_status_claimed" ON {incoming} (status, claimed_at)')
        conn.exec_driver_sql(f'CREATE INDEX "ix_{prefix}incoming_recover_after" ON {incoming} (recover_after)')
        conn.execute(store.tables.schema.update().values(version=2))
        store.insert_incoming(conn, incoming_row("stale", owner=7, claimed_at=now - timedelta(hours=2)))
        store.insert_incoming(conn, incoming_row("due", recover_after=now - timedelta(seconds=1)))
        store.insert_incoming(conn, incoming_row("handled", status="handled", recover_after=now - timedelta(1),
                                                 keep_until=now + timedelta(days=1)))

    result = store.migrate()

    assert (result.version_before, result.version_after) == (2, SCHEMA_VERSION)
    indexes = {ix["name"] for ix in inspect(store.engine).get_indexes(incoming)}
    assert new_names <= indexes and not old_names & indexes
    with store.begin() as conn:
        assert [r.message_id for r in store.lock_recoverable_incoming(conn, now, 10)] == ["due"]
        assert store.dead_owners(conn) == [7], "an owner with no node row"
        assert store.release_stale_incoming(conn, now - timedelta(hours=1), 10, now) == 1
    assert store.get_incoming("stale").owner == 0
    assert store.migrate().version_before == SCHEMA_VERSION


def test_the_inbox_indexes_of_claims_hold_running_rows_only(store: Store):
    """A handled claim, nearly every inbox row, is in the primary key and the cleanup's ``keep_until``
    index and in no index of claims: each of those is partial, of running rows."""
    table = store.tables.incoming
    claims = [ix for ix in table.indexes if ix.name != f"ix_{store.prefix}incoming_keep_until"]
    assert sorted(ix.name for ix in claims) == sorted(
        f"ix_{store.prefix}incoming_running_{name}" for name in ("claimed", "owner", "recover_after"))
    if store.is_postgres:
        with store.begin() as conn:
            definitions = dict(conn.exec_driver_sql(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %(table)s", {"table": table.name}).all())
        where = "WHERE ((status)::text = 'running'::text)"
    else:
        with store.begin() as conn:
            definitions = dict(conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table.name,)).all())
        where = "WHERE status = 'running'"
    for index in claims:
        assert definitions[index.name].endswith(where), definitions[index.name]
    assert "WHERE" not in definitions[f"ix_{store.prefix}incoming_keep_until"]


def test_concurrent_migrations_both_succeed(database_url, table_prefix):
    stores = [Store(build_engine(database_url), table_prefix) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def run(store):
        barrier.wait()
        try:
            store.migrate()
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert stores[0].missing_tables() == []
        assert stores[0].schema_version() == SCHEMA_VERSION
    finally:
        drop_store(stores[0])
        for s in stores:
            s.engine.dispose()


def test_outgoing_rows_go_in_with_one_insert_and_out_with_one_delete(store: Store):
    """On PostgreSQL the INSERT goes through libpq, past SQLAlchemy's events: counted from the
    protocol trace there."""
    log = StatementLog(store.engine)
    trace = ProtocolTrace(store) if store.is_postgres else None
    try:
        with store.begin() as conn:
            ids = store.insert_outgoing(conn, [outgoing_row(n) for n in range(50)])
        assert len(ids) == 50 and ids == sorted(ids)
        with store.begin() as conn:
            assert store.delete_outgoing(conn, ids[:30]) == 30
        statements = trace.statements() if trace is not None else log.of("INSERT")
    finally:
        log.close()
        if trace is not None:
            trace.close()
    assert len([s for s in statements if "INSERT INTO" in s and "outgoing" in s]) == 1
    deletes = [s for s in log.of("DELETE") if "outgoing" in s]
    assert len(deletes) == 1
    if store.is_postgres:
        assert "ANY" in deletes[0].upper()
    assert store.count_outgoing() == 20


def test_inserted_ids_follow_the_rows_order(store: Store):
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, [outgoing_row(n) for n in range(10)])
        rows = store.lock_pending_outgoing(conn, 100, utcnow())
    assert [r.id for r in rows] == ids
    assert [r.message_id for r in rows] == [f"m{n}" for n in range(10)]


def rows_of_every_kind() -> list[dict]:
    """Bytes with NUL, text beyond ASCII, NULLs in a column next to values."""
    soon = utcnow() + timedelta(minutes=5)
    return [
        outgoing_row(0, body=b"\x00\xff binary", headers='{"h": "\u00e9\u20ac"}', expires_at=soon, deliver_at=None,
                     retries=0, nesting=0, replays=0),
        outgoing_row(1, body=None, content_type=None, content_encoding=None, properties=None, expires_at=None,
                     deliver_at=None, retries=1, nesting=0, replays=0),
        outgoing_row(2, deliver_at=soon, expires_at=None, retries=3, nesting=1, replays=2),
    ]


def test_inserted_rows_keep_every_value(store: Store):
    given = rows_of_every_kind()
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, given)
    assert_stored(store, ids, given)


@pytest.mark.parametrize("commit", [False, True], ids=["in-the-transaction", "with-the-commit"])
def test_a_row_inserted_alone_keeps_every_value(store: Store, commit: bool):
    """One row goes as a statement of its own values (PostgreSQL), not as a JSON text: every kind
    of value still comes back as given, whether the INSERT runs in the transaction or goes with
    its COMMIT."""
    given = rows_of_every_kind()
    ids = []
    for row in given:
        with store.begin() as conn:
            ids += store.insert_outgoing(conn, [row], commit=commit)
    assert_stored(store, ids, given)


def assert_stored(store: Store, ids: list[int], given: list[dict]) -> None:
    table = store.tables.outgoing
    with store.begin() as conn:
        rows = {row.id: row for row in conn.execute(select(table).where(table.c.id.in_(ids)))}
    for row_id, expected in zip(ids, given, strict=True):
        row = rows[row_id]._mapping
        for name, value in expected.items():
            stored = as_utc(row[name]) if name.endswith("_at") else row[name]
            assert stored == value, name


def test_one_insert_statement_at_any_row_count(store: Store):
    """PostgreSQL gets the same statement for 3 rows and for 2500 (parsed and planned once,
    and past SQLite's chunk of 1000; it goes through libpq, so the protocol trace shows it);
    SQLite one INSERT per 1000 rows."""
    log = StatementLog(store.engine)
    trace = ProtocolTrace(store) if store.is_postgres else None
    try:
        with store.begin() as conn:
            few = store.insert_outgoing(conn, [outgoing_row(n) for n in range(3)])
            many = store.insert_outgoing(conn, [outgoing_row(n) for n in range(3, 2503)])
        statements = trace.statements() if trace is not None else []
    finally:
        log.close()
        if trace is not None:
            trace.close()
    assert len(few) == 3 and len(many) == 2500 and few + many == sorted(few + many)
    if store.is_postgres:
        texts = [each for each in statements if "INSERT INTO" in each and "outgoing" in each]
        assert len(texts) == 1 and "jsonb_array_elements" in texts[0], statements
        name = texts[0].split(":")[0].removeprefix("PREPARE ")
        runs = [each for each in statements
                if each == f"EXECUTE {name}" or (each in texts and not each.startswith("PREPARE "))]
        assert len(runs) == 2, statements  # prepared once, run twice
    else:
        inserts = [s for s in log.of("INSERT") if "outgoing" in s]
        assert len(inserts) == 1 + 3
    assert store.count_outgoing() == 2503


def test_scheduled_rows_are_not_pending_until_due(store: Store):
    now = utcnow()
    with store.begin() as conn:
        due, later, unscheduled = store.insert_outgoing(conn, [
            outgoing_row(1, deliver_at=now - timedelta(seconds=1)),
            outgoing_row(2, deliver_at=now + timedelta(hours=1)),
            outgoing_row(3),
        ])
    with store.begin() as conn:
        assert [r.id for r in store.lock_pending_outgoing(conn, 10, now)] == [due, unscheduled]
    with store.begin() as conn:
        pending = store.lock_pending_outgoing(conn, 10, now + timedelta(hours=2))
        assert [r.id for r in pending] == [due, later, unscheduled]


def test_concurrent_claimers_never_take_the_same_row(store: Store):
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n) for n in range(200)])
    taken: list[list[int]] = [[], [], []]
    errors: list[BaseException] = []

    def claimer(mine: list[int]):
        try:
            while True:
                with store.begin() as conn:
                    rows = store.lock_pending_outgoing(conn, 7, utcnow())
                    if not rows:
                        return
                    mine.extend(r.id for r in rows)
                    store.delete_outgoing(conn, [r.id for r in rows])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(m,)) for m in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    every = [i for m in taken for i in m]
    assert len(every) == 200 and len(set(every)) == 200
    assert store.count_outgoing() == 0


@pytest.mark.parametrize("n_lockers", [2])
def test_skip_locked_lets_a_second_relay_take_other_rows(store: Store, n_lockers):
    if not store.is_postgres:
        pytest.skip("SQLite serialises writers: there is no second concurrent transaction to skip past")
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(n) for n in range(10)])
    with store.engine.connect() as first, store.engine.connect() as second:
        with first.begin(), second.begin():
            a = store.lock_pending_outgoing(first, 6, utcnow())
            b = store.lock_pending_outgoing(second, 10, utcnow())
            assert len(a) == 6 and len(b) == 4
            assert not {r.id for r in a} & {r.id for r in b}


def test_failed_publish_is_counted_per_row(store: Store):
    with store.begin() as conn:
        (row_id,) = store.insert_outgoing(conn, [outgoing_row(1)])
    with store.begin() as conn:
        assert store.record_outgoing_failure(conn, row_id, "boom") == 1
        assert store.record_outgoing_failure(conn, row_id, "boom again") == 2
        (row,) = store.lock_pending_outgoing(conn, 1, utcnow())
    assert row.attempts == 2 and row.last_error == "boom again"


def test_an_inbox_key_is_inserted_once(store: Store):
    with store.begin() as conn:
        assert store.insert_incoming(conn, incoming_row("a")) is True
    with store.begin() as conn:
        assert store.insert_incoming(conn, incoming_row("a")) is False
        assert store.insert_incoming(conn, incoming_row("a", destination="other")) is True


def test_an_outcome_is_recorded_unless_the_message_was_handled_or_a_later_attempt_ran(store: Store):
    def record(message_id: str, status: str = "dead", retries: int = 0) -> bool:
        with store.begin() as conn:
            return store.record_outcome(conn, incoming_row(message_id, status=status, retries=retries))

    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("handled", status="handled"))
        store.insert_incoming(conn, incoming_row("later", retries=1))
        store.insert_incoming(conn, incoming_row("running"))
    assert [record("new"), record("handled"), record("later"), record("running")] == [True, False, False, True]
    assert [store.get_incoming(m).status for m in ("new", "handled", "later", "running")] == \
        ["dead", "handled", "running", "dead"]


def test_a_concurrent_inbox_insert_waits_for_the_first_and_then_conflicts(store: Store):
    first_inserted = threading.Event()
    release_first = threading.Event()
    results: dict[str, bool] = {}

    def first():
        with store.begin() as conn:
            results["first"] = store.insert_incoming(conn, incoming_row("same"))
            first_inserted.set()
            release_first.wait(10)

    def second():
        first_inserted.wait(10)
        with store.begin() as conn:
            results["second"] = store.insert_incoming(conn, incoming_row("same"))

    t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
    t1.start()
    t2.start()
    t2.join(0.5)
    assert t2.is_alive(), "the second insert must wait for the first transaction"
    release_first.set()
    t1.join()
    t2.join()
    assert results == {"first": True, "second": False}


def test_a_claim_alone_commits_a_new_key_and_takes_over_only_what_a_claim_may(store: Store):
    """``claim_incoming_alone`` (the eager claim) commits on its own and keeps every value, quotes
    included; on an existing key it follows ``claim_incoming``'s rules: a later retry of a
    running row takes it over, a handled row is never claimed again."""
    now = utcnow()
    claim = incoming_row("eager'; DROP TABLE x; --", task_name="t.100%", owner=7, claimed_at=now, retries=0,
                         nesting=0, replays=0, keep_until=None)
    assert store.claim_incoming_alone(claim) is True
    row = store.get_incoming(claim["message_id"])
    assert (row.task_name, row.owner, row.status, as_utc(row.claimed_at)) == ("t.100%", 7, "running", now)
    assert store.claim_incoming_alone({**claim, "retries": 1, "owner": 8}) is True, "a retry takes the row over"
    row = store.get_incoming(claim["message_id"])
    assert (row.retries, row.owner) == (1, 8)
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("done", status="handled", keep_until=now + timedelta(1)))
    assert store.claim_incoming_alone({**claim, "message_id": "done"}) is False, "a handled row is a duplicate"
    assert store.get_incoming("done").status == "handled"


class ProtocolTrace:
    """The messages psycopg sends to PostgreSQL on the connections ``store`` opens from now on
    (libpq's protocol trace). While it traces, the pool pings no connection it hands out: the
    round trips it counts are the units' own, however long a loaded machine takes between two
    units (the ping after idleness has tests of its own)."""

    def __init__(self, store: Store):
        import psycopg

        from celery_outbox.store import engine as engine_module

        self._engine_module = engine_module
        self._ping_after_idle = engine_module.PING_AFTER_IDLE
        engine_module.PING_AFTER_IDLE = math.inf
        store.engine.dispose()
        self.engine = store.engine
        self.path = Path(tempfile.mkstemp(suffix=".trace")[1])
        self.file = self.path.open("w")
        self.connections: list = []

        def trace(dbapi_connection, _record):
            dbapi_connection.pgconn.trace(self.file.fileno())
            dbapi_connection.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            self.connections.append(dbapi_connection)

        self._trace = trace
        event.listen(store.engine, "connect", trace)

    def _messages(self) -> list[list[str]]:
        """The trace's messages, each split into its fields (a statement's own line breaks kept)."""
        self.file.flush()
        lines: list[str] = []
        for line in self.path.read_text().splitlines():
            if line.startswith(("F\t", "B\t")) or not lines:
                lines.append(line)
            else:  # the rest of a statement written over several lines
                lines[-1] += "\n" + line
        return [line.split("\t") for line in lines]

    def sent(self) -> list[tuple[str, str]]:
        """(message type, text) of every message sent so far."""
        return [(f[2], f[3].strip() if len(f) > 3 else "") for f in self._messages() if f[0] == "F"]

    def round_trips(self) -> list[list[tuple[str, str]]]:
        """The messages sent so far, by round trip: each group is what the client sent before it
        next read an answer from the server."""
        trips: list[list[tuple[str, str]]] = [[]]
        for f in self._messages():
            if f[0] == "F":
                trips[-1].append((f[2], f[3].strip() if len(f) > 3 else ""))
            elif f[0] == "B" and trips[-1]:
                trips.append([])
        return [trip for trip in trips if trip]

    def statement_trips(self, since: int = 0) -> list[list[str]]:
        """The round trips from the ``since``-th on, each as what it runs (``_statements``) or, for
        a round trip of simple queries, their texts (unquoted: libpq's trace quotes them, or not,
        by its version)."""
        return [_statements(trip) or [text.strip('"') for _, text in trip] for trip in self.round_trips()[since:]]

    def statements(self) -> list[str]:
        """What every round trip so far ran, in order (``statement_trips``, one list)."""
        return [each for trip in self.statement_trips() for each in trip]

    def trips_of(self, run: Callable[[], Any]) -> list[list[str]]:
        """The round trips ``run()`` sends, as ``statement_trips`` gives them."""
        since = len(self.round_trips())
        run()
        return self.statement_trips(since)

    def close(self) -> None:
        self._engine_module.PING_AFTER_IDLE = self._ping_after_idle
        event.remove(self.engine, "connect", self._trace)
        for connection in self.connections:
            if not connection.closed:
                connection.pgconn.untrace()
        self.file.close()
        self.path.unlink()


@pytest.fixture
def protocol(store: Store):
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite has no round trips")
    trace = ProtocolTrace(store)
    yield trace
    trace.close()


def _statements(trip: list[tuple[str, str]]) -> list[str]:
    """What each Parse and Bind of a round trip runs: the text of an unnamed statement it parses,
    or the name of the prepared statement it binds."""
    run = []
    for kind, text in trip:
        if kind == "Parse":
            name, statement = re.match(r'"(.*?)" "(.*?)"', text, re.S).groups()
            run.append(f"PREPARE {name}: {statement}" if name else statement)
        elif kind == "Bind" and (name := re.match(r'"" "([^"]+)"', text)):  # not '"" ""': unnamed
            run.append(f"EXECUTE {name.group(1)}")
    return run


def test_a_claim_alone_of_a_new_key_is_one_round_trip_to_postgresql(store: Store, protocol: ProtocolTrace):
    """On PostgreSQL the eager claim of a new key is one round trip: BEGIN, SET LOCAL
    synchronous_commit, the INSERT (prepared with the connection's first claim, its values as
    parameters) and COMMIT go in one write with one Sync; the pooled connection goes back
    between transactions."""
    assert store.claim_incoming_alone(incoming_row("first", owner=0, claimed_at=utcnow())) is True
    assert store.claim_incoming_alone(incoming_row("second", owner=0, claimed_at=utcnow())) is True
    first, second = protocol.round_trips()
    assert [kind for kind, _ in first].count("Sync") == 1 and first[-1][0] == "Sync", first
    prepare, *ran = _statements(first)
    assert prepare.startswith("PREPARE celery_outbox_claim_") and "INSERT INTO" in prepare, prepare
    claim = "EXECUTE " + prepare.split(":")[0].removeprefix("PREPARE ")
    assert ran == ["BEGIN", "SET LOCAL synchronous_commit TO OFF", claim, "COMMIT"], ran
    assert _statements(second) == ran and second[-1][0] == "Sync", second
    assert any("'first'" in text for kind, text in first if kind == "Bind"), "the key travels as a parameter"
    with store.engine.connect() as conn:
        assert conn.connection.driver_connection.info.transaction_status == 0, "idle: nothing left open"
    assert [store.get_incoming(key).status for key in ("first", "second")] == ["running", "running"]


def test_an_insert_opening_its_transaction_carries_the_begin(store: Store, protocol: ProtocolTrace):
    """On PostgreSQL an inbox INSERT that opens its transaction (the optimistic claim) sends
    BEGIN with it, in one round trip, and the transaction stays open for the body: what follows
    is in it, and a rollback undoes the claim."""
    with store.begin() as conn:
        assert store.insert_incoming(conn, incoming_row("kept")) is True
        conn.execute(store.tables.incoming.update().where(store.tables.incoming.c.message_id == "kept")
                     .values(task_name="t.body"))
    with pytest.raises(RuntimeError), store.begin() as conn:
        assert store.insert_incoming(conn, incoming_row("undone")) is True
        raise RuntimeError("the body failed")
    trips = protocol.statement_trips()
    prepare = trips[0][0]
    claim = "EXECUTE " + prepare.split(":")[0].removeprefix("PREPARE ")
    assert prepare.startswith("PREPARE celery_outbox_claim_") and trips[0][1:] == ["BEGIN", claim], trips
    assert ["BEGIN", claim] in trips[1:], trips
    assert sum(trip.count("BEGIN") for trip in trips) == 2, "no BEGIN of its own"
    assert trips[-1] == ["ROLLBACK"], trips
    assert store.get_incoming("kept").task_name == "t.body"
    assert store.get_incoming("undone") is None


def test_a_claim_recovers_when_its_prepared_statement_is_gone_or_already_there(store: Store):
    """The claim's prepared statement dropped behind its back (``DEALLOCATE ALL``), or prepared
    without its knowing: the claim runs anyway, once."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    store.engine.dispose()
    assert store.claim_incoming_alone(incoming_row("a", owner=0)) is True
    with store.engine.connect() as conn:
        conn.exec_driver_sql("DEALLOCATE ALL")
        conn.commit()
    assert store.claim_incoming_alone(incoming_row("b", owner=0)) is True
    with store.engine.connect() as conn:
        prepared, _ = prepared_statements(conn)
        prepared.clear()
    with store.begin() as conn:
        assert store.insert_incoming(conn, incoming_row("c", owner=0)) is True
        assert store.insert_incoming(conn, incoming_row("c", owner=0)) is False
    assert all(store.get_incoming(key) is not None for key in "abc")


class SoftTimeLimit(Exception):
    pass


def test_a_claim_waiting_for_a_concurrent_claim_yields_to_a_signal(store: Store):
    """A claim waiting for a concurrent claim of its key (a row lock) is interrupted by a signal
    handler that raises, as Celery's soft time limit does; its connection is not reused, and
    the key is claimed once the first claim rolls back."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite's writers queue on the database lock")
    holding, release = threading.Event(), threading.Event()

    def first_claim():
        with store.engine.connect() as conn, conn.begin():
            store.insert_incoming(conn, incoming_row("contended", owner=0))
            holding.set()
            release.wait(30)
            conn.rollback()

    def soft_time_limit(_signum, _frame):
        raise SoftTimeLimit()

    first = threading.Thread(target=first_claim)
    first.start()
    previous = signal.signal(signal.SIGALRM, soft_time_limit)
    try:
        assert holding.wait(10)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(SoftTimeLimit):
            store.claim_incoming_alone(incoming_row("contended", owner=0))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
        first.join()
    assert store.get_incoming("contended") is None, "neither claim committed"
    assert store.claim_incoming_alone(incoming_row("contended", owner=0)) is True


def test_a_claim_prepares_nothing_when_prepared_statements_are_off(store: Store, protocol: ProtocolTrace):
    """With psycopg's prepared statements off (``prepare_threshold = None``, as behind a
    transaction-pooling PgBouncer) the claim's INSERT goes as an unnamed statement, still in
    one round trip."""
    @event.listens_for(store.engine, "connect")
    def no_prepared_statements(dbapi_connection, _record):
        dbapi_connection.prepare_threshold = None

    try:
        assert store.claim_incoming_alone(incoming_row("text", owner=0)) is True
        assert store.claim_incoming_alone(incoming_row("text 2", owner=0)) is True
    finally:
        event.remove(store.engine, "connect", no_prepared_statements)
    for trip in protocol.round_trips():
        begin, set_local, insert, commit = _statements(trip)
        assert (begin, set_local, commit) == ("BEGIN", "SET LOCAL synchronous_commit TO OFF", "COMMIT"), trip
        assert insert.startswith("INSERT INTO") and "$1" in insert, insert
    assert store.get_incoming("text").status == "running"
    assert store.get_incoming("text 2").status == "running"


def test_a_claim_the_database_rejects_raises_its_error_and_leaves_nothing_open(store: Store):
    """A claim whose row breaks a constraint raises the database's own error (as SQLAlchemy
    would have), in both styles; nothing is written and the pooled connection is reused, between
    transactions."""
    bad = incoming_row("bad", owner=0, status=None)
    with pytest.raises(IntegrityError, match="status"):
        store.claim_incoming_alone(bad)
    with pytest.raises(IntegrityError, match="status"), store.begin() as conn:
        store.insert_incoming(conn, bad)
    assert store.get_incoming("bad") is None
    assert store.claim_incoming_alone(incoming_row("good", owner=0)) is True
    if store.is_postgres:
        with store.engine.connect() as conn:
            assert conn.connection.driver_connection.info.transaction_status == 0, "idle: nothing left open"
    assert store.get_incoming("good").status == "running"


def test_duplicates_are_detected_by_error_code(store: Store):
    table = store.tables.incoming
    with store.begin() as conn:
        conn.execute(table.insert().values(**incoming_row("dup")))
    with pytest.raises(IntegrityError) as duplicate:
        with store.begin() as conn:
            conn.execute(table.insert().values(**incoming_row("dup")))
    assert is_unique_violation(duplicate.value)
    with pytest.raises(IntegrityError) as not_null:
        with store.begin() as conn:
            conn.execute(table.insert().values(**incoming_row("x", status=None)))
    assert not is_unique_violation(not_null.value)


def test_nodes_register_and_heartbeat(store: Store):
    node = store.register_node("host:abc", "host", 123)
    assert store.heartbeat(node) is True
    assert [n.name for n in store.live_nodes()] == ["host:abc"]
    assert store.heartbeat(node + 1000) is False


def test_the_sends_a_dead_node_stored_marked_sent_are_due_for_redelivery_at_once(store: Store):
    """``redeliver_rows_of_senders``: the sent rows naming a dead node as their sender are due now
    and name no sender any more; another node's, and an unsent row, stay as they were. The dead
    node is forgotten only once no row names it; a relay's take and a redelivery clear the sender
    too (the row is theirs from then on)."""
    dead, alive = store.register_node("host:10:a", "host", 10), store.register_node("host:11:b", "host", 11)
    now = utcnow()
    later = now + timedelta(minutes=10)
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, [
            outgoing_row(1, sent_at=now, redeliver_at=later, sender=dead),
            outgoing_row(2, sent_at=now, redeliver_at=later, sender=dead),
            outgoing_row(3, sent_at=now, redeliver_at=later, sender=alive),
            outgoing_row(4, sent_at=None, redeliver_at=None, sender=dead),  # as a publisher never stores one
        ])
    with store.begin() as conn:
        assert store.check_nodes(conn, store.database_now(conn), stale_before=later, checks_needed=1,
                                 counted_before=later, silent_before=later) == [dead, alive]
        conn.execute(store.tables.nodes.update().where(store.tables.nodes.c.id == alive).values(dead_at=None))
        assert store.dead_nodes(conn) == [dead]
        assert store.forget_released_nodes(conn) == 0, "rows still name it"
        assert store.redeliver_rows_of_senders(conn, [dead], now, limit=1) == 1
        assert store.redeliver_rows_of_senders(conn, [dead], now, limit=10) == 1
        assert store.forget_released_nodes(conn) == 1
    outgoing = store.tables.outgoing
    with store.begin() as conn:
        rows = {r.message_id: (as_utc(r.redeliver_at) if r.redeliver_at else None, r.sender)
                for r in conn.execute(select(outgoing))}
    assert rows == {"m1": (now, None), "m2": (now, None), "m3": (later, alive), "m4": (None, dead)}
    with store.begin() as conn:
        assert store.take_outgoing(conn, [ids[3]], now, later) == [ids[3]]
        store.mark_redelivered(conn, [{"id": ids[2], "redeliver_at": later}])
        assert dict(conn.execute(select(outgoing.c.message_id, outgoing.c.sender)).all()) == {
            "m1": None, "m2": None, "m3": None, "m4": None}


def test_a_process_seen_dying_releases_only_its_running_claim_of_the_attempt(store: Store):
    """``release_claim_of_process``: the running claim of this attempt owned by a node of the dead
    process (by host and pid) is released, unowned and due for recovery at once; the same
    attempt's claim under another process's node, another attempt's claim, and an ended claim
    stay as they are."""
    dead = store.register_node("host:10:a", "host", 10)
    other_pid = store.register_node("host:11:b", "host", 11)
    other_host = store.register_node("elsewhere:10:c", "elsewhere", 10)
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("lost", owner=dead))
        store.insert_incoming(conn, incoming_row("lost", destination="other-queue", owner=dead))
        store.insert_incoming(conn, incoming_row("later-attempt", retries=1, owner=dead))
        store.insert_incoming(conn, incoming_row("taken-over", owner=other_pid))
        store.insert_incoming(conn, incoming_row("elsewhere", owner=other_host))
        store.insert_incoming(conn, incoming_row("ended", status="handled", owner=0, handled_at=utcnow()))
    now = utcnow()
    with store.begin() as conn:
        assert [store.release_claim_of_process(conn, message_id, "", "host", 10, (0, 0, 0), now)
                for message_id in ("lost", "later-attempt", "taken-over", "elsewhere", "ended")] == [1, 0, 0, 0, 0]
    incoming = store.tables.incoming
    with store.begin() as conn:
        rows = {(r.message_id, r.destination, r.retries): (r.status, r.owner, r.recover_after is not None)
                for r in conn.execute(select(incoming))}
    assert rows == {
        ("lost", "", 0): ("running", 0, True),
        ("lost", "other-queue", 0): ("running", dead, False),
        ("later-attempt", "", 1): ("running", dead, False),
        ("taken-over", "", 0): ("running", other_pid, False),
        ("elsewhere", "", 0): ("running", other_host, False),
        ("ended", "", 0): ("handled", 0, False),
    }


def test_status_counts_rows_by_status_and_destination(store: Store):
    now = utcnow()
    with store.begin() as conn:
        store.insert_outgoing(conn, [outgoing_row(1, created_at=now - timedelta(seconds=30)), outgoing_row(2),
                                     outgoing_row(3, destination="later", deliver_at=now + timedelta(hours=1))])
        store.insert_incoming(conn, incoming_row("a"))
        store.insert_incoming(conn, incoming_row("b", status="handled", keep_until=now))
    store.register_node("n1", "host", 1)
    report = store.status(now)
    assert {"status": "pending", "destination": "q", "count": 2} in report["outgoing"]
    assert {"status": "scheduled", "destination": "later", "count": 1} in report["outgoing"]
    assert {"status": "running", "queue": "q", "count": 1} in report["incoming"]
    assert {"status": "handled", "queue": "q", "count": 1} in report["incoming"]
    assert report["oldest_pending_outgoing_age_seconds"] == pytest.approx(30, abs=1)
    assert [n["name"] for n in report["nodes"]] == ["n1"]


def _take_over(store: Store, message_id: str, owner: int) -> None:
    """Another node takes the running claim of ``message_id`` over (as recovery lets it)."""
    incoming = store.tables.incoming
    with store.begin() as conn:
        conn.execute(incoming.update().where(incoming.c.message_id == message_id).values(owner=owner))


def test_finishing_an_eager_claim_commits_the_body_with_it(store: Store):
    """``finish_incoming(commit=True)`` marks the claim handled in the body's transaction; the
    caller's commit then commits the body's writes with it. A claim another node took over
    meanwhile is not marked: False, and nothing of that transaction commits (the caller rolls
    back), on each store."""
    now = utcnow()
    for key in ("ours", "lost"):
        assert store.claim_incoming_alone(incoming_row(key, owner=7, claimed_at=now, keep_until=None)) is True
    _take_over(store, "lost", owner=8)
    for key, finished in (("ours", True), ("lost", False)):
        with store.engine.connect() as conn:
            conn.begin()
            store.insert_incoming(conn, incoming_row(f"effect of {key}", status="handled"))
            assert store.finish_incoming(conn, key, "", 7, (0, 0, 0), now, now + timedelta(1), commit=True) \
                is finished
            (conn.commit if finished else conn.rollback)()
    ours, lost = store.get_incoming("ours"), store.get_incoming("lost")
    assert (ours.status, ours.owner, as_utc(ours.handled_at)) == ("handled", 0, now)
    assert store.get_incoming("effect of ours") is not None
    assert (lost.status, lost.owner, lost.handled_at) == ("running", 8, None), "the other node's claim stands"
    assert store.get_incoming("effect of lost") is None, "the body's write did not commit"


def test_finishing_an_eager_claim_sends_its_commit_with_it_in_one_round_trip(store: Store, protocol: ProtocolTrace):
    """On PostgreSQL the finish and the COMMIT go with one Sync (and the BEGIN too when the body
    wrote nothing); the caller's commit sends nothing more. Its values go as parameters; the
    finish is prepared once per connection, with the first message that opens its transaction,
    and runs prepared inside the body's transaction too once it is."""
    now = utcnow()
    for key in ("quiet", "busy", "again"):
        assert store.claim_incoming_alone(incoming_row(key, owner=7, claimed_at=now, keep_until=None)) is True
    claims = len(protocol.round_trips())
    with store.engine.connect() as conn:
        for key in ("quiet", "busy", "again"):
            conn.begin()
            if key == "busy":
                store.insert_incoming(conn, incoming_row("effect", status="handled"))
            assert store.finish_incoming(conn, key, "", 7, (0, 0, 0), now, now + timedelta(1), commit=True)
            conn.commit()
    quiet, *busy, again = [_statements(trip) for trip in protocol.round_trips()[claims:]]
    prepare, *ran = quiet
    assert prepare.startswith("PREPARE celery_outbox_finish_") and "UPDATE" in prepare, prepare
    finish = "EXECUTE " + prepare.split(":")[0].removeprefix("PREPARE ")
    assert ran == ["BEGIN", finish, "COMMIT"], quiet
    assert busy[-1] == [finish, "COMMIT"], busy
    assert again == ["BEGIN", finish, "COMMIT"], again
    assert [store.get_incoming(key).status for key in ("quiet", "busy", "again")] == ["handled"] * 3


def test_a_claim_alone_can_open_the_bodys_transaction_in_its_round_trip(store: Store, protocol: ProtocolTrace):
    """Given the attempt's connection, the eager claim sends a BEGIN after its COMMIT, in the same
    round trip: the claim is committed (another connection sees it) while the body's transaction
    is open, and the body's first statement goes without a BEGIN of its own."""
    now = utcnow()
    with store.engine.connect() as conn:
        assert store.claim_incoming_alone(incoming_row("opened", owner=7, claimed_at=now, keep_until=None),
                                          then_begin=conn) is True
        assert conn.connection.driver_connection.info.transaction_status == 2, "in a transaction"
        [claim] = [_statements(trip) for trip in protocol.round_trips()]
        assert store.get_incoming("opened").status == "running", "committed before the body"
        seen = len(protocol.round_trips())
        conn.begin()
        assert store.insert_incoming(conn, incoming_row("effect", status="handled")) is True
        assert store.finish_incoming(conn, "opened", "", 7, (0, 0, 0), now, now + timedelta(1), commit=True)
        conn.commit()
    body, finish = protocol.statement_trips(seen)
    assert claim[1:] == ["BEGIN", "SET LOCAL synchronous_commit TO OFF", claim[0].split(":")[0].replace(
        "PREPARE", "EXECUTE"), "COMMIT", "BEGIN"], claim
    assert "BEGIN" not in body and "INSERT INTO" in body[-1], body
    assert finish[0].startswith("WITH finished AS") and finish[1:] == ["COMMIT"], finish
    assert (store.get_incoming("opened").status, store.get_incoming("effect").status) == ("handled", "handled")


def test_a_finish_inside_the_bodys_transaction_is_prepared_ahead_for_the_next(store: Store,
                                                                             protocol: ProtocolTrace):
    """The first finish inside a body's transaction on a connection goes unnamed (nothing says
    its statement is there, and a failed message could not be sent again); it is prepared in
    a round trip of its own before the connection's next claim, between transactions, and from
    then on runs prepared inside the body's transaction, with its COMMIT."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    store.engine.dispose()
    now = utcnow()
    with store.engine.connect() as conn:
        for key in ("first", "second", "third"):
            assert store.claim_incoming_alone(incoming_row(key, owner=7, claimed_at=now, keep_until=None),
                                              then_begin=conn) is True
            assert store.finish_incoming(conn, key, "", 7, (0, 0, 0), now, now + timedelta(1), commit=True)
            conn.commit()
    trips = [_statements(trip) for trip in protocol.round_trips()]
    _, first_finish, prepare_ahead, _, second_finish, _, third_finish = trips
    assert first_finish[0].startswith("WITH finished AS") and first_finish[1:] == ["COMMIT"], first_finish
    [prepare] = prepare_ahead
    assert prepare.startswith("PREPARE celery_outbox_finish_") and "WITH finished AS" in prepare, prepare
    finish = "EXECUTE " + prepare.split(":")[0].removeprefix("PREPARE ")
    assert second_finish == third_finish == [finish, "COMMIT"], trips
    assert [store.get_incoming(key).status for key in ("first", "second", "third")] == ["handled"] * 3


def test_statements_sent_in_one_message_outlive_psycopg_deallocating_them_on_rollback(store: Store):
    """psycopg answers a rollback with ``DEALLOCATE ALL`` once it prepared statements of its own,
    taking ours with them: the next claim prepares its statement again, and the finish inside
    the body's transaction, which could not be sent again, does not rely on one it had: it goes
    unnamed once, and is prepared again before the next claim."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    store.engine.dispose()
    now = utcnow()
    ours = "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'celery_outbox_%%'"

    def attempt(conn, key):
        assert store.claim_incoming_alone(incoming_row(key, owner=7, claimed_at=now, keep_until=None),
                                          then_begin=conn) is True
        conn.begin()
        assert store.insert_incoming(conn, incoming_row(f"effect of {key}", status="handled")) is True
        assert store.finish_incoming(conn, key, "", 7, (0, 0, 0), now, now + timedelta(1), commit=True)
        conn.commit()

    with store.engine.connect() as conn:
        for _ in range(6):  # psycopg prepares a query it ran five times
            conn.exec_driver_sql("SELECT 1").scalar_one()
        conn.commit()
        attempt(conn, "before")
        attempt(conn, "before again")  # the finish is prepared by now too
        assert conn.exec_driver_sql(ours).scalar_one() == 2
        conn.rollback()
        assert conn.exec_driver_sql(ours).scalar_one() == 0, "psycopg's rollback deallocated them"
        conn.rollback()
        attempt(conn, "after")
        attempt(conn, "again")
        assert conn.exec_driver_sql(ours).scalar_one() == 2, "the claim and the finish, prepared again"
        conn.rollback()
    assert [store.get_incoming(key).status for key in ("before", "before again", "after", "again",
                                                       "effect of again")] == ["handled"] * 5


def test_a_finish_whose_statement_vanished_behind_psycopgs_back_fails_and_is_prepared_again(store: Store):
    """A prepared finish that something other than psycopg deallocated (SQL run on the session
    while psycopg held no prepared statement of its own) fails inside the body's transaction,
    which rolls back with nothing marked; the next finish goes unnamed and prepares it again."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite prepares nothing")
    store.engine.dispose()
    now = utcnow()

    def attempt(conn, key):
        assert store.claim_incoming_alone(incoming_row(key, owner=7, claimed_at=now, keep_until=None),
                                          then_begin=conn) is True
        assert store.insert_incoming(conn, incoming_row(f"effect of {key}", status="handled")) is True
        assert store.finish_incoming(conn, key, "", 7, (0, 0, 0), now, now + timedelta(1), commit=True)
        conn.commit()

    with store.engine.connect() as conn:
        attempt(conn, "first")
        attempt(conn, "second")  # the finish runs prepared from here on
        conn.connection.driver_connection.pgconn.exec_(b"DEALLOCATE ALL")  # psycopg does not see it
        with pytest.raises(ProgrammingError, match="does not exist"):
            attempt(conn, "lost")
        conn.rollback()
        attempt(conn, "after")
        attempt(conn, "again")
    assert [store.get_incoming(key).status for key in ("first", "second", "after", "again")] == ["handled"] * 4
    assert store.get_incoming("lost").status == "running", "claimed, not marked handled"
    assert store.get_incoming("effect of lost") is None, "the body's write rolled back"


def test_migrate_on_a_current_schema_runs_no_ddl(store: Store):
    """Every process that gets ready migrates (each new pool process): on a current schema that
    is a read of the catalog, not one DDL statement."""
    log = StatementLog(store.engine)
    try:
        result = store.migrate()
    finally:
        log.close()
    assert result.created_tables == [] and result.version_before == SCHEMA_VERSION
    assert log.of("CREATE") == [] and log.of("ALTER") == [] and log.of("DROP") == []


def test_code_meeting_a_newer_schema_refuses_and_leaves_its_version(store: Store):
    """A schema a newer release migrated is refused, by ``migrate`` and by an outbox that gets ready
    without migrating, with a message naming both versions; the recorded version is not rewritten
    and no DDL runs."""
    newer = SCHEMA_VERSION + 1
    with store.begin() as conn:
        conn.execute(store.tables.schema.update().values(version=newer))
    log = StatementLog(store.engine)
    try:
        with pytest.raises(IncompatibleSchema, match=f"schema version {newer}, newer than version {SCHEMA_VERSION}"):
            store.migrate()
    finally:
        log.close()
    assert store.schema_version() == newer
    assert log.of("CREATE") == [] and log.of("UPDATE") == [] and log.of("DROP") == []
    for auto_create_schema in (True, False):
        app = Celery("newer", broker="memory://", set_as_current=False)
        outbox = Outbox(app, engine=store.engine, table_prefix=store.prefix, auto_create_schema=auto_create_schema)
        with pytest.raises(IncompatibleSchema, match="upgrade celery-outbox"):
            outbox.ready()
    assert store.schema_version() == newer


def test_migrate_on_a_current_schema_neither_waits_for_nor_blocks_writers(store: Store):
    """``CREATE INDEX IF NOT EXISTS`` takes a SHARE lock on its table even when the index exists:
    a migrate run by a new pool process waited for the transactions writing to the inbox, and a
    task's transaction deadlocked with it. On a current schema migrate takes no such lock."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only: SQLite has no table locks")
    finished, errors = threading.Event(), []

    def migrate() -> None:
        try:
            store.migrate()
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)
        finished.set()

    migrating = threading.Thread(target=migrate)
    with store.engine.connect() as writer, writer.begin() as held:
        writer.execute(store.tables.incoming.insert().values(**incoming_row("held-by-a-writer")))
        migrating.start()
        migrated_meanwhile = finished.wait(timeout=20)
        held.rollback()
    migrating.join(timeout=60)
    assert errors == []
    assert migrated_meanwhile, "migrate waited for a transaction writing to the inbox"
