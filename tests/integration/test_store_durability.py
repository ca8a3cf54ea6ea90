"""The store's maintenance statements, on SQLite and on a real PostgreSQL: dead nodes, releases,
recoverable envelopes, cleanup deletes, dead-letter queries."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from celery_outbox.core.node import node_lock_key
from celery_outbox.store import Store, utcnow

from .test_store_contract import incoming_row


def dead_letter(n: int, **extra):
    row = dict(message_id=f"d{n}", task_name="t.add", queue="q", reason="failed", exception_type="ValueError",
               failed_at=utcnow(), body=b"[[1], {}, {}]", content_type="application/json",
               content_encoding="utf-8", headers='{"id": "d%d", "task": "t.add"}' % n, properties="{}")
    row.update(extra)
    return row


def check(store: Store, now, stale_after=30, checks=3, period=0, silent_after: float | None = 3):
    """One check of the nodes; ``silent_after=None`` counts stale checks alone (on PostgreSQL a node
    silent that long whose lock is free is dead at once, whatever its count)."""
    with store.begin() as conn:
        return store.check_nodes(conn, now, stale_before=now - timedelta(seconds=stale_after),
                                 checks_needed=checks, counted_before=now - timedelta(seconds=period),
                                 silent_before=None if silent_after is None else now - timedelta(seconds=silent_after))


class LiveNode:
    """A node row whose liveness lock is held (on PostgreSQL) by a connection of this test, as a worker's is."""

    def __init__(self, store: Store, name: str):
        self.store = store
        self.connection = store.engine.connect() if store.is_postgres else None
        self.id = store.register_node(name, "host", 1, conn=self.connection,
                                      lock_key=lambda node_id: node_lock_key(node_id, store.prefix))

    def die(self):
        if self.connection is not None:
            self.connection.invalidate()
            self.connection.close()
            self.connection = None


def set_heartbeat(store: Store, node_id: int, at):
    nodes = store.tables.nodes
    with store.begin() as conn:
        conn.execute(nodes.update().where(nodes.c.id == node_id).values(heartbeat_at=at))


def test_a_node_is_dead_after_n_consecutive_stale_checks(store: Store):
    node = LiveNode(store, "stale")
    fresh = LiveNode(store, "fresh")
    try:
        node.die()  # its process gone: on PostgreSQL its lock is free
        now = utcnow()
        set_heartbeat(store, node.id, now - timedelta(seconds=60))
        for n in range(1, 3):
            assert check(store, now + timedelta(seconds=n), silent_after=None) == [], f"check {n} of 3 declares nothing"
        assert check(store, now + timedelta(seconds=3), silent_after=None) == [node.id]
        assert store.heartbeat(node.id) is False, "a node declared dead cannot heartbeat back to life"
        assert store.heartbeat(fresh.id) is True
        assert check(store, now + timedelta(seconds=4), silent_after=None) == []
    finally:
        node.die()
        fresh.die()


def test_a_heartbeat_resets_the_stale_checks(store: Store):
    node = LiveNode(store, "flapping")
    try:
        node.die()
        now = utcnow()
        set_heartbeat(store, node.id, now - timedelta(seconds=60))
        check(store, now, silent_after=None)
        check(store, now + timedelta(seconds=1), silent_after=None)
        assert store.heartbeat(node.id, now - timedelta(seconds=60)) is True  # an old heartbeat, but a heartbeat
        assert check(store, now + timedelta(seconds=2), silent_after=None) == []
        assert check(store, now + timedelta(seconds=3), silent_after=None) == []
        assert check(store, now + timedelta(seconds=4), silent_after=None) == [node.id]
    finally:
        node.die()


def test_two_checks_in_one_period_count_once(store: Store):
    node = LiveNode(store, "doubly-checked")
    try:
        node.die()
        now = utcnow()
        set_heartbeat(store, node.id, now - timedelta(seconds=60))
        for _ in range(5):  # five recover runs within one check period of 10 s
            assert check(store, now, checks=2, period=10, silent_after=None) == []
        assert check(store, now + timedelta(seconds=11), checks=2, period=10, silent_after=None) == [node.id]
    finally:
        node.die()


def test_postgres_declares_a_node_dead_once_silent_when_its_process_is_gone(store: Store):
    """The liveness lock free and the heartbeat silent (three intervals): dead at the first check,
    with no stale checks counted. The lock free alone (a dropped liveness connection of a live,
    heartbeating node) declares nothing."""
    if not store.is_postgres:
        pytest.skip("the liveness lock is PostgreSQL's; SQLite nodes die by stale heartbeats only")
    node = LiveNode(store, "killed")
    alive = LiveNode(store, "alive")
    try:
        assert check(store, utcnow()) == [], "fresh heartbeats, locks held"
        node.die()
        assert check(store, utcnow()) == [], "its lock is free but it heartbeats: not dead"
        now = utcnow()
        set_heartbeat(store, node.id, now - timedelta(seconds=5))
        set_heartbeat(store, alive.id, now - timedelta(seconds=5))
        assert check(store, now) == [node.id], "silent and unlocked: no stale checks needed"
    finally:
        alive.die()


def test_postgres_never_declares_dead_a_node_whose_process_holds_its_lock(store: Store):
    """Stale and silent for ten minutes by the heartbeats (a paused process, a clock set back):
    while its session holds the liveness lock the node is alive, however many checks count."""
    if not store.is_postgres:
        pytest.skip("the liveness lock is PostgreSQL's; SQLite nodes die by stale heartbeats only")
    node = LiveNode(store, "paused")
    try:
        now = utcnow()
        set_heartbeat(store, node.id, now - timedelta(minutes=10))
        for n in range(5):
            assert check(store, now + timedelta(seconds=n), checks=1) == [], f"check {n}"
        assert [row.id for row in store.live_nodes() if row.dead_at is None] == [node.id]
        node.die()
        assert check(store, now + timedelta(seconds=5), checks=1) == [node.id], "its lock free: dead at once"
    finally:
        node.die()


def test_dead_nodes_claims_are_released_and_the_node_forgotten(store: Store):
    dead, alive = LiveNode(store, "dead"), LiveNode(store, "alive")
    try:
        now = utcnow()
        with store.begin() as conn:
            for n in range(7):
                store.insert_incoming(conn, incoming_row(f"dead{n}", owner=dead.id, claimed_at=now))
            store.insert_incoming(conn, incoming_row("alive", owner=alive.id, claimed_at=now))
            store.insert_incoming(conn, incoming_row("orphan", owner=dead.id + alive.id + 100, claimed_at=now))
        set_heartbeat(store, dead.id, now - timedelta(seconds=60))
        dead.die()
        assert check(store, now, checks=1) == [dead.id]
        with store.begin() as conn:
            owners = store.dead_owners(conn)
        assert owners == sorted([dead.id, dead.id + alive.id + 100]), "declared dead, and owners with no node"
        with store.begin() as conn:
            assert store.release_owned(conn, owners, 5, now) == 5, "one bounded batch"
        with store.begin() as conn:
            assert store.forget_released_nodes(conn) == 0, "the node still owns rows"
            assert store.release_owned(conn, owners, 5, now) == 3
            assert store.forget_released_nodes(conn) == 1
        rows = {m: store.get_incoming(m) for m in [f"dead{n}" for n in range(7)] + ["alive", "orphan"]}
        assert {m: r.owner for m, r in rows.items() if r.owner} == {"alive": alive.id}
        assert all(r.recover_after is not None for m, r in rows.items() if m != "alive")
        assert [n.name for n in store.live_nodes()] == ["alive"]
    finally:
        dead.die()
        alive.die()


def test_stale_claims_are_released_by_claim_time(store: Store):
    now = utcnow()
    node = LiveNode(store, "slow")
    try:
        with store.begin() as conn:
            store.insert_incoming(conn, incoming_row("old-claim", owner=node.id, claimed_at=now - timedelta(hours=2),
                                                     received_at=now - timedelta(hours=3)))
            store.insert_incoming(conn, incoming_row("new-claim", owner=node.id, claimed_at=now,
                                                     received_at=now - timedelta(hours=3)))
        with store.begin() as conn:
            assert store.release_stale_incoming(conn, now - timedelta(hours=1), 100, now) == 1
        assert store.get_incoming("old-claim").owner == 0
        assert store.get_incoming("new-claim").owner == node.id, "received long ago, claimed just now: not stale"
    finally:
        node.die()


def test_recoverable_envelopes_are_running_unowned_and_due(store: Store):
    now = utcnow()
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("due", recover_after=now - timedelta(seconds=1)))
        store.insert_incoming(conn, incoming_row("later", recover_after=now + timedelta(seconds=60)))
        store.insert_incoming(conn, incoming_row("owned", owner=5, recover_after=now - timedelta(seconds=1)))
        store.insert_incoming(conn, incoming_row("handled", status="handled", recover_after=now - timedelta(1),
                                                 keep_until=now + timedelta(days=1)))
        store.insert_incoming(conn, incoming_row("no-envelope"))
    with store.begin() as conn:
        assert [r.message_id for r in store.lock_recoverable_incoming(conn, now, 10)] == ["due"]
        store.mark_recovered(conn, [{"message_id": "due", "destination": "", "send_id": "",
                                     "recover_after": now + timedelta(1)}])
    row = store.get_incoming("due")
    assert row.recoveries == 1
    with store.begin() as conn:
        assert store.lock_recoverable_incoming(conn, now, 10) == []


def test_an_optimistic_claim_in_flight_is_not_recoverable(store: Store):
    if not store.is_postgres:
        pytest.skip("on SQLite a claim in flight holds the database's only write lock")
    now = utcnow()
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("in-flight", recover_after=now - timedelta(seconds=1)))
    with store.engine.connect() as worker:
        with worker.begin():
            claim = incoming_row("in-flight", status="handled", claimed_at=now, keep_until=now + timedelta(1))
            assert store.claim_incoming(worker, claim) is True
            with store.begin() as conn:
                assert store.lock_recoverable_incoming(conn, now, 10) == [], "the claim's row lock is skipped"
            worker.rollback()  # the worker died: the row is stranded again
    with store.begin() as conn:
        assert [r.message_id for r in store.lock_recoverable_incoming(conn, now, 10)] == ["in-flight"]


def test_a_replay_claims_a_dead_row_and_a_plain_redelivery_does_not(store: Store):
    now = utcnow()
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("failed", status="dead", keep_until=now + timedelta(1)))
    attempt = dict(status="handled", claimed_at=now, keep_until=now + timedelta(1))
    with store.begin() as conn:
        assert store.claim_incoming(conn, incoming_row("failed", **attempt)) is False, "a redelivery is a duplicate"
        assert store.claim_incoming(conn, incoming_row("failed", retries=1, **attempt)) is False, \
            "a dead row is not taken over by a later retry"
        assert store.claim_incoming(conn, incoming_row("failed", replays=1, **attempt)) is True
    with store.begin() as conn:
        assert store.claim_incoming(conn, incoming_row("failed", replays=2, **attempt)) is False, \
            "a handled row is never run again, replay or not"
    assert (store.get_incoming("failed").status, store.get_incoming("failed").replays) == ("handled", 1)


def test_cleanup_deletes_exactly_the_expired_rows_in_batches(store: Store):
    now = utcnow()
    with store.begin() as conn:
        for n in range(25):
            store.insert_incoming(conn, incoming_row(f"old{n}", status="handled", keep_until=now - timedelta(1)))
        for n in range(5):
            store.insert_incoming(conn, incoming_row(f"kept{n}", status="handled", keep_until=now + timedelta(1)))
        store.insert_incoming(conn, incoming_row("running"))
    deleted = []
    while True:
        with store.begin() as conn:
            count = store.delete_expired_incoming(conn, now, 10)
        deleted.append(count)
        if count < 10:
            break
    assert deleted == [10, 10, 5]
    with store.begin() as conn:
        left = set(conn.execute(select(store.tables.incoming.c.message_id)).scalars())
    assert left == {f"kept{n}" for n in range(5)} | {"running"}


def test_dead_letter_filters_and_replay_bookkeeping(store: Store):
    now = utcnow()
    with store.begin() as conn:
        store.insert_dead_letters(conn, [
            dead_letter(1, failed_at=now - timedelta(days=10)),
            dead_letter(2, task_name="t.other", exception_type="KeyError"),
            dead_letter(3, queue="other", reason="poison"),
        ])
    ids = [r.id for r in store.list_dead_letters(store.dead_letter_filter())]
    assert len(ids) == 3

    def matching(**criteria):
        return [r.message_id for r in store.list_dead_letters(store.dead_letter_filter(**criteria))]

    assert matching(task="t.other") == ["d2"]
    assert matching(exception="ValueError") == ["d1", "d3"]
    assert matching(queue="other") == ["d3"]
    assert matching(reason="poison") == ["d3"]
    assert matching(since=now - timedelta(days=1)) == ["d2", "d3"]
    assert matching(failed_before=now - timedelta(days=1)) == ["d1"]
    assert matching(ids=[ids[0], ids[2]], exception="ValueError") == ["d1", "d3"]
    with store.begin() as conn:
        store.mark_replayed(conn, [ids[0]], now)
        store.mark_replayed(conn, [ids[0]], now)
    replayed = store.get_dead_letter(ids[0])
    assert replayed.replay_count == 2 and replayed.replayed_at is not None
    with store.begin() as conn:
        locked = store.lock_dead_letters(conn, store.dead_letter_filter(failed_before=now), 10, full=False)
        assert store.delete_dead_letters(conn, [r.id for r in locked]) == 1
    assert store.count_matching_dead_letters(store.dead_letter_filter()) == 2


def test_cleanup_never_blocks_a_concurrent_writer(store: Store):
    """A writer keeps claiming while cleanup deletes 3000 expired rows in batches: every write lands."""
    now = utcnow()
    with store.begin() as conn:
        conn.execute(store.tables.incoming.insert(), [
            incoming_row(f"old{n}", status="handled", keep_until=now - timedelta(1)) for n in range(3000)])
    stop = threading.Event()
    written: list[str] = []
    errors: list[BaseException] = []

    def writer():
        n = 0
        try:
            while not stop.is_set() or n < 50:
                with store.begin() as conn:
                    claim = incoming_row(f"new{n}", status="handled", claimed_at=utcnow(),
                                         keep_until=utcnow() + timedelta(days=1))
                    assert store.claim_incoming(conn, claim)
                written.append(f"new{n}")
                n += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deleted = 0
        while True:
            with store.begin() as conn:
                count = store.delete_expired_incoming(conn, utcnow(), 200)
            deleted += count
            if count < 200:
                break
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert deleted == 3000
    with store.begin() as conn:
        left = set(conn.execute(select(store.tables.incoming.c.message_id)).scalars())
        assert conn.execute(select(func.count()).select_from(store.tables.incoming)).scalar_one() == len(written)
    assert left == set(written)


def test_acknowledging_deletes_the_rows_of_the_message_and_destination(store: Store):
    from .test_store_contract import outgoing_row

    now = utcnow()
    with store.begin() as conn:
        sent, not_yet_marked, other_queue, other = store.insert_outgoing(conn, [
            outgoing_row(1, message_id="m"), outgoing_row(2, message_id="m"),
            outgoing_row(3, message_id="m", destination="q2"), outgoing_row(4, message_id="x")])
        store.finish_sent(conn, [sent, other_queue, other], now, now + timedelta(minutes=10))
    with store.begin() as conn:
        assert store.acknowledge_outgoing(conn, "m", "q", (0, 0, 0)) == 2, "sent, or published but not yet marked"
    with store.begin() as conn:
        assert set(conn.execute(select(store.tables.outgoing.c.id)).scalars()) == {other_queue, other}
        assert store.acknowledge_outgoing(conn, "m", None, (0, 0, 0)) == 1
    with store.begin() as conn:
        assert set(conn.execute(select(store.tables.outgoing.c.id)).scalars()) == {other}


def test_acknowledging_an_attempt_keeps_later_attempts(store: Store):
    from .test_store_contract import outgoing_row

    with store.begin() as conn:
        store.insert_outgoing(conn, [
            outgoing_row(1, message_id="m", nesting=0, replays=0, retries=0),
            outgoing_row(2, message_id="m", nesting=0, replays=0, retries=1),
            outgoing_row(3, message_id="m", nesting=0, replays=1, retries=0),
            outgoing_row(4, message_id="m", nesting=1, replays=0, retries=0)])
    with store.begin() as conn:
        assert store.acknowledge_outgoing(conn, "m", None, (0, 0, 1)) == 2, "attempts 0 and 1 of the retries"
        left = conn.execute(select(store.tables.outgoing.c.replays, store.tables.outgoing.c.nesting)).all()
    assert sorted(map(tuple, left)) == [(0, 1), (1, 0)], "a replay and a replace are later attempts"


def test_an_acknowledgment_overtaking_its_publisher_waits_and_deletes(store: Store):
    """The consumer acknowledges while the publisher still holds the row it took, before its commit."""
    if not store.is_postgres:
        pytest.skip("SQLite serialises the two transactions: no overtaking")
    from .test_store_contract import outgoing_row

    now = utcnow()
    with store.begin() as conn:
        (row_id,) = store.insert_outgoing(conn, [outgoing_row(1, message_id="fast")])
    acknowledged: list[int] = []
    with store.engine.connect() as publisher:
        with publisher.begin():
            assert store.take_outgoing(publisher, [row_id], now, now + timedelta(minutes=10)) == [row_id]

            def consumer():
                with store.begin() as conn:
                    acknowledged.append(store.acknowledge_outgoing(conn, "fast", None, (0, 0, 0)))

            thread = threading.Thread(target=consumer)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive(), "the acknowledgment waits for the publisher's row lock"
        thread.join(10)
    assert acknowledged == [1]
    assert store.count_outgoing() == 0


def outgoing_state(store: Store) -> dict[int, tuple]:
    table = store.tables.outgoing
    with store.begin() as conn:
        return {row.id: (row.sent_at is not None, row.redeliver_at is not None)
                for row in conn.execute(select(table.c.id, table.c.sent_at, table.c.redeliver_at))}


def test_taking_rows_to_publish_locks_and_marks_them_in_one_statement(store: Store):
    from .test_store_contract import StatementLog, outgoing_row

    now = utcnow()
    with store.begin() as conn:
        taken, already_sent, not_asked = store.insert_outgoing(conn, [outgoing_row(n) for n in range(3)])
        store.finish_sent(conn, [already_sent], now, now + timedelta(minutes=10))
    log = StatementLog(store.engine)
    try:
        with store.begin() as conn:
            assert store.take_outgoing(conn, [taken, already_sent], now, now + timedelta(minutes=10)) == [taken]
    finally:
        log.close()
    assert len([s for s in log.statements if "outgoing" in s]) == 1
    assert outgoing_state(store) == {taken: (True, True), already_sent: (True, True), not_asked: (False, False)}
    with store.begin() as conn:
        assert store.lock_pending_outgoing(conn, 10, utcnow())[0].id == not_asked, "the relay sees only the unsent"


def test_rows_whose_publish_failed_are_unmarked_for_the_relay(store: Store):
    from .test_store_contract import outgoing_row

    now = utcnow()
    with store.begin() as conn:
        published, failed = store.insert_outgoing(conn, [outgoing_row(1), outgoing_row(2)])
        assert store.take_outgoing(conn, [published, failed], now, now + timedelta(minutes=10)) == [published, failed]
        store.unmark_sent(conn, [failed])
    assert outgoing_state(store) == {published: (True, True), failed: (False, False)}
    with store.begin() as conn:
        assert [row.id for row in store.lock_pending_outgoing(conn, 10, utcnow())] == [failed]


def test_a_row_a_relay_holds_is_not_taken(store: Store):
    if not store.is_postgres:
        pytest.skip("SQLite's write lock lets one transaction in at a time: nothing to skip")
    from .test_store_contract import outgoing_row

    now = utcnow()
    with store.begin() as conn:
        held, free = store.insert_outgoing(conn, [outgoing_row(1), outgoing_row(2)])
    with store.engine.connect() as relay, relay.begin():
        assert [row.id for row in store.lock_pending_outgoing(relay, 1, now)] == [held]
        with store.begin() as conn:
            assert store.take_outgoing(conn, [held, free], now, now + timedelta(minutes=10)) == [free]
    assert outgoing_state(store) == {held: (False, False), free: (True, True)}


def test_the_publishers_transaction_opens_by_taking_its_rows_and_commits_their_marks(store: Store):
    """``taking_outgoing``: a transaction of its own that starts by taking the rows (the unsent
    ones no relay holds), commits without waiting for the WAL flush, and keeps the marks only if
    its block ends without an error; on PostgreSQL with psycopg, BEGIN, SET LOCAL and the UPDATE
    go in one message (no statement through the cursor), prepared statement or not."""
    from .test_store_contract import StatementLog, outgoing_row

    now, later = utcnow(), utcnow() + timedelta(minutes=10)
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, [outgoing_row(n) for n in range(6)])
        store.finish_sent(conn, [ids[1]], now, later)
    with ExitStack() as relay_holds:
        if store.is_postgres:  # a relay holds one row (SQLite lets one writer in at a time: no skipping)
            relay = relay_holds.enter_context(store.engine.connect())
            relay_holds.enter_context(relay.begin())
            assert [row.id for row in store.lock_pending_outgoing(relay, 1, now, after_id=ids[1])] == [ids[2]]
        log = StatementLog(store.engine)
        try:
            with store.taking_outgoing(ids[:3], now, later) as (conn, taken):
                assert taken == ([ids[0]] if store.is_postgres else [ids[0], ids[2]])
                if store.is_postgres:
                    assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
            with pytest.raises(RuntimeError), store.taking_outgoing([ids[3]], now, later) as (conn, taken):
                assert taken == [ids[3]]
                raise RuntimeError("the publish went wrong before the commit")
            for row_id in ids[4:]:  # again on the same pooled connection: the statement prepared
                with store.taking_outgoing([row_id], now, later) as (conn, taken):
                    assert taken == [row_id]
        finally:
            log.close()
    if store.is_postgres:
        assert not [s for s in log.statements if "outgoing" in s], "the UPDATE went in one message"
    state = outgoing_state(store)
    assert [state[row_id] for row_id in ids] == [
        (True, True), (True, True), (not store.is_postgres,) * 2, (False, False), (True, True), (True, True)]


def test_taking_rows_to_delete_them_is_one_statement_that_skips_sent_and_held_rows(store: Store):
    """With delivery tracking off the publisher deletes the rows it takes, before the publish."""
    from .test_store_contract import StatementLog, outgoing_row

    now = utcnow()
    with store.begin() as conn:
        taken, already_sent, held, not_asked = store.insert_outgoing(conn, [outgoing_row(n) for n in range(4)])
        store.finish_sent(conn, [already_sent], now, now + timedelta(minutes=10))
    with ExitStack() as relay_holds:
        if store.is_postgres:  # a relay holds one row (SQLite lets one writer in at a time: no skipping)
            relay = relay_holds.enter_context(store.engine.connect())
            relay_holds.enter_context(relay.begin())
            assert [row.id for row in store.lock_pending_outgoing(relay, 1, now, after_id=taken)] == [held]
        log = StatementLog(store.engine)
        try:
            with store.begin() as conn:
                assert [row.id for row in store.take_outgoing_to_delete(conn, [taken, already_sent, held])] == \
                    ([taken] if store.is_postgres else [taken, held])
        finally:
            log.close()
    assert len(log.of("DELETE")) == 1
    assert [s for s in log.statements if "outgoing" in s] == log.of("DELETE"), "one statement takes them"
    left = [already_sent, held, not_asked] if store.is_postgres else [already_sent, not_asked]
    assert sorted(outgoing_state(store)) == left


def test_rows_taken_to_delete_keep_what_records_their_sends(store: Store):
    """With an archive, the DELETE that takes the rows returns what the ``sent`` table keeps of
    them: their sends are recorded after the publish, though the rows are gone."""
    from .test_store_contract import outgoing_row

    now = utcnow()
    with store.begin() as conn:
        first, second = store.insert_outgoing(conn, [outgoing_row(n, destination=f"q{n}") for n in (1, 2)])
    with store.begin() as conn:
        taken = store.take_outgoing_to_delete(conn, [first, second], record=True)
        store.record_sends(conn, taken, now)
    assert [(row.id, row.message_id, row.destination, row.task_name) for row in taken] == \
        [(first, "m1", "q1", "t.add"), (second, "m2", "q2", "t.add")]
    assert store.count_outgoing() == 0
    sent = store.tables.sent
    with store.begin() as conn:
        recorded = conn.execute(select(sent.c.message_id, sent.c.destination, sent.c.task_name, sent.c.created_at,
                                       sent.c.sent_at).order_by(sent.c.message_id)).all()
    assert [tuple(row[:3]) for row in recorded] == [("m1", "q1", "t.add"), ("m2", "q2", "t.add")]
    assert all(row.created_at is not None and row.sent_at is not None for row in recorded)


def test_a_running_claim_of_a_heartbeating_node_is_in_flight_not_taken_over(store: Store):
    """A copy of the same attempt meets the running claim of a node that heartbeats: not claimable,
    and ``claim_in_flight`` says so (the copy goes back to the broker), even when the node's
    liveness lock is free (its liveness connection dropped). Once the node is also silent, on
    PostgreSQL, its process is gone: the copy takes the claim over."""
    node = LiveNode(store, "owner")
    try:
        now = utcnow()
        with store.begin() as conn:
            store.insert_incoming(conn, incoming_row("busy", owner=node.id, claimed_at=now))
        node.die()  # the liveness lock is free; the heartbeat is fresh
        copy = incoming_row("busy", owner=node.id + 1000, claimed_at=now)
        silent_before = now - timedelta(seconds=3)
        with store.begin() as conn:
            assert store.claim_incoming(conn, dict(copy), silent_before=silent_before) is False
            assert store.claim_in_flight(conn, "busy", "", (0, 0, 0)) is True
            assert store.claim_in_flight(conn, "busy", "", (0, 0, 1)) is False, "another attempt"
            assert store.claim_in_flight(conn, "nothing", "", (0, 0, 0)) is False
        assert store.get_incoming("busy").owner == node.id
        set_heartbeat(store, node.id, now - timedelta(seconds=10))
        with store.begin() as conn:
            taken = store.claim_incoming(conn, dict(copy), silent_before=utcnow() - timedelta(seconds=3))
        assert taken is store.is_postgres, "PostgreSQL knows the process is gone; SQLite waits for recovery"
    finally:
        node.die()


def test_a_claim_is_judged_by_its_own_owner_not_by_other_nodes(store: Store):
    """Whether a running claim may be taken over is decided by the node that owns that row: a
    heartbeating owner whose liveness lock is free keeps its claim while another node, silent
    and unlocked, owns other rows; a gone owner's claim is taken over while live nodes own other
    rows."""
    owner, ghost, busy = LiveNode(store, "owner"), LiveNode(store, "ghost"), LiveNode(store, "busy")
    try:
        now = utcnow()
        with store.begin() as conn:
            store.insert_incoming(conn, incoming_row("mine", owner=owner.id, claimed_at=now))
            store.insert_incoming(conn, incoming_row("ghosts", owner=ghost.id, claimed_at=now))
            store.insert_incoming(conn, incoming_row("busy", owner=busy.id, claimed_at=now))
            store.insert_incoming(conn, incoming_row("orphan", owner=busy.id + 1000, claimed_at=now))
        owner.die()  # its liveness lock is free; it still heartbeats
        ghost.die()
        set_heartbeat(store, ghost.id, now - timedelta(seconds=60))  # silent and unlocked: its process is gone
        silent_before = now - timedelta(seconds=3)
        with store.begin() as conn:
            copy = incoming_row("mine", owner=busy.id, claimed_at=now)
            assert store.claim_incoming(conn, copy, silent_before=silent_before) is False
        assert store.get_incoming("mine").owner == owner.id
        with store.begin() as conn:  # no node row at all: gone, though "busy" owns a row and is alive
            copy = incoming_row("orphan", owner=busy.id, claimed_at=now)
            assert store.claim_incoming(conn, copy, silent_before=silent_before) is True
        assert store.get_incoming("orphan").owner == busy.id
    finally:
        for node in (owner, ghost, busy):
            node.die()


def test_a_handled_row_is_not_in_flight(store: Store):
    with store.begin() as conn:
        store.insert_incoming(conn, incoming_row("done", status="handled", keep_until=utcnow()))
        assert store.claim_in_flight(conn, "done", "", (0, 0, 0)) is False


@pytest.mark.parametrize("one_message", [True, False], ids=["in one message", "through SQLAlchemy"])
def test_a_held_envelope_claim_counts_this_attempts_tracked_rows_and_rolls_back_whole(store: Store, one_message):
    """The optimistic attempt's claim from a durable queue: the inbox row goes in with its envelope
    and the sender's rows up to this attempt are acknowledged, in the attempt's transaction. Only a
    tracked row (``redeliver_at`` set) of this very attempt counts as holding the message; a
    rollback puts back every row it deleted and takes the inbox row away."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL: SQLite stores the envelope in a transaction of its own")
    from .test_store_contract import outgoing_row

    now = utcnow()
    outgoing = store.tables.outgoing
    with store.begin() as conn:
        tracked, pending, earlier, later, other_send = store.insert_outgoing(conn, [
            outgoing_row(1, message_id="m", send_id="s", retries=1),
            outgoing_row(2, message_id="m", send_id="s", retries=1),  # not yet marked sent: not tracked
            outgoing_row(3, message_id="m", send_id="s", retries=0),
            outgoing_row(4, message_id="m", send_id="s", retries=2),
            outgoing_row(5, message_id="m", send_id="other", retries=1)])
        store.finish_sent(conn, [tracked, earlier, later, other_send], now, now + timedelta(minutes=10))
    envelope = dict(exchange="", routing_key="q", body=b"[[1], {}, {}]", content_type="application/json",
                    content_encoding="utf-8", headers="{}", properties="{}")
    row = incoming_row("m", send_id="s", status="handled", retries=1, handled_at=now, keep_until=now, **envelope)

    def claim(conn):
        return store.claim_held_envelope(conn, row, "m", None, (0, 0, 1), "s")

    def left():
        with store.engine.connect() as conn:
            return set(conn.execute(select(outgoing.c.id)).scalars())

    with store.engine.connect() as conn:
        if not one_message:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin() as transaction:
            assert claim(conn) == 1, "one tracked row of this attempt; the pending and the earlier do not count"
            assert left() == {tracked, pending, earlier, later, other_send}, "nothing is gone before the commit"
            transaction.rollback()
        assert store.get_incoming("m") is None and left() == {tracked, pending, earlier, later, other_send}
        with conn.begin():
            assert claim(conn) == 1
        assert store.get_incoming("m").status == "handled" and store.get_incoming("m").body == envelope["body"]
        assert left() == {later, other_send}, "a later attempt and another send stay"
        with conn.begin():
            assert claim(conn) is None, "the key has its row: nothing is written"
        assert left() == {later, other_send}
        with store.begin() as other:
            store.insert_outgoing(other, [outgoing_row(6, message_id="n", send_id="s")])
        with conn.begin():
            assert store.claim_held_envelope(conn, {**row, "message_id": "n", "retries": 0}, "n", None, (0, 0, 0),
                                             "s") == 0, "an untracked row does not hold the message"
