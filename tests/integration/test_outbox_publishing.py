"""Publish after commit against real services: every test runs on SQLite and PostgreSQL,
with Redis and with RabbitMQ as the broker."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from celery_outbox.core.crashpoints import EXIT_CODE
from celery_outbox.signals import message_published

from ..apps.factory import make_shop
from ..brokers import counted_acquires, nothing_more, purge, receive, receive_until_marker
from ..conftest import drop_store, outgoing_rows, unsent_rows
from ..services import require, wait_until
from ..throwaway import ThrowawayRedis

ROOT = Path(__file__).parents[2]


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request) -> str:
    return require(request.param)


@pytest.fixture(params=["session", "connection"])
def unit_of_work(request):
    """Opens a unit of work on ``shop``'s outbox: ``outbox.transaction()`` (a Session) or
    ``outbox.begin()`` (a Core connection)."""
    return lambda shop: shop.outbox.transaction() if request.param == "session" else shop.outbox.begin()


@contextmanager
def own_shop(broker_url, database_url, table_prefix, **conf):
    """A shop with its tables, emptied and dropped after the block."""
    shop = make_shop(broker_url, database_url, table_prefix, **conf)
    shop.outbox.ready()
    try:
        yield shop
    finally:
        purge(shop.app, shop.plain_queue, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()


class Interrupted(BaseException):
    """What a signal handler raises mid-exchange, as Celery's soft time limit does."""


def interrupted_exchange(driver, send):
    """A stand-in for the store's exchange with PostgreSQL (``pipeline.pipeline_exchange``) that a signal
    interrupts before any answer comes."""
    raise Interrupted("a soft time limit")


def pool_of_one_shop(broker_url, database_url, table_prefix):
    """``own_shop`` whose store pool holds one connection: every unit of work runs on the same one
    (its node's liveness connection is outside the pool, and its heartbeat, which takes a pooled
    one, waits past the test)."""
    return own_shop(broker_url, database_url, table_prefix,
                    outbox_engine_options={"pool_size": 1, "max_overflow": 0, "pool_timeout": 5},
                    outbox_node_heartbeat_interval=3600)


def unit_opened_by_a_statement(shop, n: int) -> int:
    """A unit of work whose own statement opens the transaction (as a web request's row does), then
    sends ``durable.delay(n)``; the server process id of the connection it ran on."""
    from sqlalchemy import text

    with shop.outbox.begin() as conn:
        conn.execute(text("SELECT 1"))
        shop.durable.delay(n)
        return conn.execute(text("SELECT pg_backend_pid()")).scalar_one()


@pytest.fixture
def shop(broker_url, database_url, table_prefix):
    with own_shop(broker_url, database_url, table_prefix) as shop:
        yield shop


def test_captured_sends_take_no_producer_and_the_publish_takes_one(shop, unit_of_work, monkeypatch):
    """Inside a unit of work a send is captured, not published: it takes no producer from the
    app's pool (Celery's ``send_task`` is given a stand-in); the publish after the commit takes
    one for all the unit's messages, which arrive. Outside one, a send takes one, as in Celery."""
    acquired = counted_acquires(shop.app, monkeypatch)
    with unit_of_work(shop):
        first, stored, last = shop.plain.delay(1), shop.durable.delay(2), shop.plain.delay(3)
        assert acquired == [], "the captures took no producer from the pool"
    assert acquired == [1], "one producer published the unit's three messages"
    assert [m.id for m in receive(shop.app, shop.plain_queue, 2)] == [first.id, last.id]
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [stored.id]
    outside = shop.plain.delay(4)
    assert acquired == [1, 1]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [outside.id]


def test_with_the_rpc_backend_a_captured_send_takes_a_pooled_producer(broker_url, database_url, table_prefix,
                                                                      monkeypatch):
    """The rpc result backend declares its reply queue on the producer of each send, so there a
    captured send takes a pooled producer, as in Celery; the message is published after the
    commit and its result comes back to the caller through the reply queue."""
    if not broker_url.startswith("amqp"):
        pytest.skip("the rpc backend replies through AMQP queues")
    with own_shop(broker_url, database_url, table_prefix, result_backend="rpc://") as shop:
        acquired = counted_acquires(shop.app, monkeypatch)
        with shop.outbox.transaction():
            result = shop.plain.delay(5)
            assert acquired == [1], "the capture took a pooled producer for the backend"
        assert acquired == [1, 1]
        (message,) = receive(shop.app, shop.plain_queue, 1)
        assert message.id == result.id
        # the worker's reply, to the queue the capture declared (Celery's rpc replies go to the
        # sending thread's queue, with the task id as the correlation id)
        replying = SimpleNamespace(reply_to=shop.app.thread_oid, correlation_id=message.id, chord=None,
                                   ignore_result=False, group=None, parent_id=None, delivery_info={})
        shop.app.backend.mark_as_done(message.id, 10, request=replying)
        assert result.get(timeout=10) == 10


def test_rollback_publishes_nothing(shop, unit_of_work):
    with pytest.raises(RuntimeError):
        with unit_of_work(shop):
            shop.plain.delay(1)
            shop.durable.delay(2)
            raise RuntimeError("rolled back")
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0


def test_a_unit_whose_transaction_the_database_aborted_commits_and_publishes_nothing(shop, unit_of_work):
    """A statement that fails in the block, caught without a savepoint: on PostgreSQL the
    transaction is aborted and its COMMIT would be a ROLLBACK while the block's messages went out.
    The block raises ``TransactionAborted`` naming the caught error; nothing is published. On
    SQLite only the failed statement is undone, and the block commits."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from celery_outbox.errors import TransactionAborted

    aborts = shop.outbox.store.is_postgres
    with pytest.raises(TransactionAborted, match="ProgrammingError.*no_such_table") if aborts else nullcontext():
        with unit_of_work(shop) as unit:
            plain, durable = shop.plain.delay(1), shop.durable.delay(2)
            try:  # a Session or a Connection: both execute
                unit.execute(text("SELECT * FROM no_such_table"))
            except DBAPIError:
                pass
    if aborts:
        assert nothing_more(shop.app, shop.plain_queue) and nothing_more(shop.app, shop.durable_queue)
        assert outgoing_rows(shop.outbox.store) == (0, 0)
    else:
        assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [plain.id]
        assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable.id]


def test_commit_publishes_exactly_once(shop, unit_of_work):
    with unit_of_work(shop):
        plain = shop.plain.delay(1)
        durable = shop.durable.delay(2)
        assert nothing_more(shop.app, shop.plain_queue), "nothing reaches the broker before the commit"
    assert [m.id for m in receive(shop.app, shop.plain_queue, 1)] == [plain.id]
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable.id]
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)


def test_order_is_kept(shop, unit_of_work):
    with unit_of_work(shop):
        plain_ids = [shop.plain.delay(n).id for n in range(30)]
        durable_ids = [shop.durable.delay(n).id for n in range(30)]
    assert [m.id for m in receive(shop.app, shop.plain_queue, 30)] == plain_ids
    assert [m.id for m in receive(shop.app, shop.durable_queue, 30)] == durable_ids


def test_durable_row_is_stored_marked_sent_and_published_after_the_commit(shop, unit_of_work):
    rows_when_published = []

    def on_published(sender, message, relayed, **_):
        rows_when_published.append(outgoing_rows(shop.outbox.store))

    message_published.connect(on_published)
    try:
        with unit_of_work(shop):
            shop.durable.delay(1)
            assert outgoing_rows(shop.outbox.store) == (0, 0), "uncommitted rows are invisible to others"
    finally:
        message_published.disconnect(on_published)
    assert rows_when_published == [(1, 0)], "committed, marked sent: the relay leaves it to the publisher"
    assert unsent_rows(shop.outbox.store) == 0
    assert len(receive(shop.app, shop.durable_queue, 1)) == 1


def test_two_relays_at_once_publish_each_row_once(shop, monkeypatch):
    import threading

    from kombu.messaging import Producer

    real_publish = Producer.publish
    refuse = threading.Event()
    refuse.set()

    def publish(self, body, *args, **kwargs):
        if refuse.is_set():
            raise ConnectionRefusedError("broker is down")
        return real_publish(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", publish)
    with shop.outbox.transaction():
        ids = [shop.durable.delay(n).id for n in range(120)]
    assert unsent_rows(shop.outbox.store) == 120
    refuse.clear()
    results = []
    threads = [threading.Thread(target=lambda: results.append(shop.outbox.relay())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.published for r in results) == 120
    assert sorted(m.id for m in receive(shop.app, shop.durable_queue, 120)) == sorted(ids)
    assert nothing_more(shop.app, shop.durable_queue)
    assert unsent_rows(shop.outbox.store) == 0


@pytest.mark.parametrize("redeliver_after", [600.0, None], ids=["tracked", "tracking-off"])
def test_broker_stopped_during_commit_then_relay_delivers(database_url, table_prefix, tmp_path, redeliver_after):
    """A real Redis broker is stopped: the commit succeeds, the row waits, the relay delivers it."""
    broker = ThrowawayRedis(tmp_path).start()
    shop = make_shop(broker.url, database_url, table_prefix, outbox_redeliver_after=redeliver_after)
    try:
        shop.outbox.ready()
        broker.stop()
        with shop.outbox.transaction():
            result = shop.durable.delay("survives the outage")
        assert unsent_rows(shop.outbox.store) == 1
        assert shop.outbox.relay().broker_error is not None, "the relay reports the broker is down"
        assert unsent_rows(shop.outbox.store) == 1
        broker.start()
        relayed = shop.outbox.relay()
        assert relayed.published == 1 and relayed.broker_error is None
        (message,) = receive(shop.app, shop.durable_queue, 1)
        assert (message.id, message.args) == (result.id, ["survives the outage"])
        assert unsent_rows(shop.outbox.store) == 0
    finally:
        broker.stop()
        drop_store(shop.outbox.store)


def test_store_and_forward_outside_a_unit_of_work_survives_a_broker_outage(database_url, table_prefix, tmp_path):
    broker = ThrowawayRedis(tmp_path).start()
    shop = make_shop(broker.url, database_url, table_prefix)
    try:
        shop.outbox.ready()
        broker.stop()
        result = shop.durable.delay("sent while the broker is down")
        assert result.id
        assert unsent_rows(shop.outbox.store) == 1
        broker.start()
        assert shop.outbox.relay().published == 1
        (message,) = receive(shop.app, shop.durable_queue, 1)
        assert message.id == result.id
        assert unsent_rows(shop.outbox.store) == 0
    finally:
        broker.stop()
        drop_store(shop.outbox.store)


def test_rabbitmq_unreachable_during_commit_then_relay_delivers(rabbitmq_url, database_url, table_prefix):
    """The writer's broker connection is refused; a relay connected to RabbitMQ delivers the stored row."""
    from ..services import free_port

    writer = make_shop(f"amqp://guest:guest@127.0.0.1:{free_port()}//", database_url, table_prefix)
    relay_app = make_shop(rabbitmq_url, database_url, table_prefix)
    relay_app.app.conf.outbox_durable_queues = [writer.durable_queue]
    try:
        writer.outbox.ready()
        with writer.outbox.transaction():
            result = writer.durable.delay("stored")
        assert unsent_rows(writer.outbox.store) == 1
        assert relay_app.outbox.relay().published == 1
        (message,) = receive(relay_app.app, writer.durable_queue, 1)
        assert (message.id, message.args) == (result.id, ["stored"])
    finally:
        purge(relay_app.app, writer.durable_queue)
        drop_store(writer.outbox.store)


def run_writer(broker_url, database_url, table_prefix, crashpoint, durable_queue, tracking="on", unit="session"):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CELERY_OUTBOX_CRASHPOINT=crashpoint)
    script = (
        "import sys; from tests.apps.crashing_writer import main; "
        "main(*sys.argv[1:])"
    )
    return subprocess.run(
        [sys.executable, "-c", script, broker_url, database_url, table_prefix, durable_queue, tracking, unit],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(("crashpoint", "tracking", "unit"), [
    ("after_commit", "on", "session"), ("after_publish", "on", "session"), ("after_publish", "off", "session"),
    ("after_commit", "on", "connection"), ("after_publish", "on", "connection"), ("after_commit", "off", "session"),
], ids=["after_commit", "after_publish", "after_publish-tracking-off", "after_commit-begin", "after_publish-begin",
        "after_commit-tracking-off"])
def test_process_dying_after_commit_loses_nothing(shop, crashpoint, tracking, unit):
    """The writer (its unit of work ``outbox.transaction()``, or ``outbox.begin()``) exits with
    os._exit right after the commit (nothing published) or right after the publish (with delivery
    tracking off, the DELETE not committed). With delivery tracking the row was stored marked
    sent: the relay leaves it, and redelivery publishes it once due (the writer's
    ``outbox_redeliver_after`` is one second), as for a message the broker lost; without
    tracking the relay delivers it. Nothing is lost."""
    done = run_writer(shop.app.conf.broker_url, shop.outbox.store.engine.url.render_as_string(False),
                      shop.outbox.settings.table_prefix, crashpoint, shop.durable_queue, tracking, unit)
    assert done.returncode == EXIT_CODE, done.stderr
    message_id = done.stdout.strip().splitlines()[-1]
    store = shop.outbox.store
    if tracking == "on":
        assert outgoing_rows(store) == (1, 0), "the committed row survived, marked sent"
        assert shop.outbox.relay().published == 0, "the relay leaves a row marked sent"
        wait_until(lambda: shop.outbox.recover().redelivered == 1, timeout=30,
                   message="redelivery to publish the row once due")
    else:
        assert unsent_rows(store) == 1, "the committed row survived the crash"
        assert shop.outbox.relay().published == 1
    received = receive(shop.app, shop.durable_queue, 1)
    received += receive_until_marker(shop.app, shop.durable_queue, f"marker-{message_id}")
    # after_publish: the writer's own publish arrives too, unless the broker dropped it with the
    # connection the dying process reset (RabbitMQ without publisher confirms may)
    assert 1 <= len(received) <= (1 if crashpoint == "after_commit" else 2), received
    assert {m.id for m in received} == {message_id}, "delivered; after_publish may deliver a copy"
    assert unsent_rows(store) == 0


@pytest.mark.parametrize("redeliver_after", [600.0, None], ids=["tracked", "tracking-off"])
def test_with_an_archive_each_publish_after_commit_is_recorded_as_sent(broker_url, database_url, table_prefix,
                                                                        tmp_path, redeliver_after):
    shop = make_shop(broker_url, database_url, table_prefix, outbox_archive_path=str(tmp_path / "archive"),
                     outbox_redeliver_after=redeliver_after)
    shop.outbox.ready()
    try:
        with shop.outbox.transaction():
            result = shop.durable.delay(7)
        store = shop.outbox.store
        with store.begin() as conn:
            recorded = conn.execute(select(store.tables.sent.c.message_id, store.tables.sent.c.sent_at)).all()
        assert [message_id for message_id, _ in recorded] == [result.id]
        assert recorded[0].sent_at is not None
        assert store.count_outgoing() == (1 if redeliver_after else 0), "kept until acknowledged, or deleted"
        (message,) = receive(shop.app, shop.durable_queue, 1)
        assert message.id == result.id
    finally:
        purge(shop.app, shop.plain_queue, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()


@pytest.mark.parametrize("archived", [False, True], ids=["no-archive", "archive"])
def test_with_delivery_tracking_off_a_failed_publish_keeps_only_its_row(broker_url, database_url, table_prefix,
                                                                         monkeypatch, tmp_path, archived):
    """The rows are deleted by the statement that takes them; when one publish fails, its row
    comes back for the relay and the published ones stay deleted. With an archive, each
    published message is recorded as sent once: the relay records the failed one when it
    sends it."""
    from kombu.messaging import Producer

    archive = {"outbox_archive_path": str(tmp_path / "archive")} if archived else {}
    shop = make_shop(broker_url, database_url, table_prefix, outbox_redeliver_after=None, **archive)
    shop.outbox.ready()
    store = shop.outbox.store
    real_publish = Producer.publish

    def publish(self, body, *args, **kwargs):
        if kwargs.get("headers", {}).get("argsrepr") == "(2,)":
            raise ValueError("this message cannot be encoded by the broker")
        return real_publish(self, body, *args, **kwargs)

    def recorded() -> list[str]:
        with store.begin() as conn:
            return sorted(conn.execute(select(store.tables.sent.c.message_id)).scalars())

    try:
        with monkeypatch.context() as patch:
            patch.setattr(Producer, "publish", publish)
            with shop.outbox.transaction():
                sent = [shop.durable.delay(n).id for n in (1, 2, 3)]
            assert store.count_outgoing() == 1
            assert unsent_rows(store) == 1, "the failed one, for the relay"
            assert {m.id for m in receive(shop.app, shop.durable_queue, 2)} == {sent[0], sent[2]}
            assert recorded() == (sorted([sent[0], sent[2]]) if archived else [])
        assert shop.outbox.relay().published == 1
        (message,) = receive(shop.app, shop.durable_queue, 1)
        assert (message.id, message.args) == (sent[1], [2])
        assert nothing_more(shop.app, shop.durable_queue)
        assert store.count_outgoing() == 0
        assert recorded() == (sorted(sent) if archived else [])
    finally:
        purge(shop.app, shop.plain_queue, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()


def test_a_row_stored_marked_sent_names_this_processs_node_as_its_sender(shop, unit_of_work):
    """On PostgreSQL the unit of work registers this process's node before it begins, and its row,
    stored marked sent, names that node: recovery redelivers it at once if the node dies. On
    SQLite a sender registers no node (a heartbeat beside a web process's own transactions could
    make them fail) and the row names none: delivery tracking alone redelivers it."""
    with unit_of_work(shop):
        shop.durable.delay(1)
    outgoing = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        (row,) = conn.execute(select(outgoing.c.sent_at, outgoing.c.sender)).all()
    assert row.sent_at is not None, "stored marked sent"
    if shop.outbox.store.is_postgres:
        assert shop.outbox.node.registered()
        assert row.sender == shop.outbox.node.id
    else:
        assert not shop.outbox.node.registered()
        assert row.sender is None


def test_begin_sends_its_commit_with_the_messages_insert(broker_url, database_url, table_prefix):
    """On PostgreSQL ``outbox.begin()`` sends the durable messages' INSERT and the COMMIT in one
    round trip, the rows stored marked sent: after it, the publisher only publishes, with no
    round trip to the store (a pool of one is enough)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no round trips")
    from sqlalchemy import text

    from .test_store_contract import ProtocolTrace

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop:
        trace = ProtocolTrace(shop.outbox.store)
        try:
            with shop.outbox.begin():  # prepares the statements on the new connection
                shop.durable.delay(0)

            def unit() -> None:
                with shop.outbox.begin() as conn:
                    conn.execute(text("SELECT 1"))
                    shop.durable.delay(1)

            trips = trace.trips_of(unit)
        finally:
            trace.close()
        begin, select_one, insert = trips
        assert (begin, select_one) == (["BEGIN"], ["SELECT 1"]), trips
        assert insert[0].startswith("EXECUTE celery_outbox_insert_outgoing_") and insert[1:] == ["COMMIT"], trips
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 2)) == [0, 1]
        assert unsent_rows(shop.outbox.store) == 0


def test_a_message_after_the_users_statements_goes_prepared_from_the_connections_next_unit(
        broker_url, database_url, table_prefix):
    """On PostgreSQL a unit of work whose own statement opens the transaction sends its messages'
    INSERT unnamed (parsed) on a connection that has not prepared it: a Parse that failed there
    would end the user's transaction. The pool prepares it when it next hands the connection
    out, between transactions, in one round trip of its own; from then on every unit of work
    on that connection sends it prepared, with no round trip more than plain Celery's (a pool
    of one: every unit has the same connection)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no prepared statements")

    from .test_store_contract import ProtocolTrace

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop:
        trace = ProtocolTrace(shop.outbox.store)
        try:
            units = [trace.trips_of(partial(unit_opened_by_a_statement, shop, n)) for n in range(3)]
        finally:
            trace.close()
        first, second, third = units
        users = [["BEGIN"], ["SELECT 1"], ["SELECT pg_backend_pid()"]]
        assert first[:3] == users and len(first) == 4, first
        insert = first[3]
        assert insert[0].startswith("INSERT INTO") and insert[1:] == ["COMMIT"], "sent unnamed, parsed"
        (prepare,), *rest = second
        name = prepare.split(":")[0].removeprefix("PREPARE ")
        assert name.startswith("celery_outbox_insert_outgoing_"), prepare
        assert rest == third == [*users, [f"EXECUTE {name}", "COMMIT"]], (second, third)
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 3)) == [0, 1, 2]
        assert outgoing_rows(shop.outbox.store) == (3, 0)


@contextmanager
def notes_of(shop):
    """An ORM class ``Note`` (a user's data: ``id``, ``text``) mapped to a table of its own in the
    shop's store, dropped after the block."""
    from sqlalchemy import Column, MetaData, String, Table
    from sqlalchemy.orm import registry

    class Note:
        def __init__(self, id: str, text: str = ""):
            self.id, self.text = id, text

    metadata = MetaData()
    table = Table(f"{shop.outbox.store.tables.outgoing.name}_notes", metadata,
                  Column("id", String(32), primary_key=True), Column("text", String(200)))
    mapper = registry(metadata=metadata)
    mapper.map_imperatively(Note, table)
    metadata.create_all(shop.outbox.engine)
    try:
        yield Note
    finally:
        metadata.drop_all(shop.outbox.engine)
        mapper.dispose()


def test_a_sessions_messages_go_with_its_commit_after_its_flush(broker_url, database_url, table_prefix):
    """On PostgreSQL ``outbox.transaction()`` flushes the user's rows first, then sends the durable
    messages' INSERT with the COMMIT in one round trip (the connection's ``commit`` event): as many
    round trips as the user's own unit of work. The rows are the Session's data and the messages,
    committed together. The event is listened to on that connection alone: the engine carries no
    connection listener, so its other connections dispatch no events."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no round trips")
    from .test_store_contract import ProtocolTrace

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop, notes_of(shop) as Note:
        trace = ProtocolTrace(shop.outbox.store)

        def unit(n: int) -> None:
            with shop.outbox.transaction() as session:
                session.add(Note(f"note-{n}"))
                shop.durable.delay(n)

        try:
            units = [trace.trips_of(partial(unit, n)) for n in range(3)]
        finally:
            trace.close()
        third = units[2]
        assert len(third) == 3 and third[0] == ["BEGIN"], units
        assert len(third[1]) == 1 and third[1][0].startswith("INSERT INTO") and "_notes" in third[1][0], third
        assert third[2][0].startswith("EXECUTE celery_outbox_insert_outgoing_") and third[2][1:] == ["COMMIT"], third
        with shop.outbox.transaction() as session:
            assert sorted(note.id for note in session.query(Note)) == ["note-0", "note-1", "note-2"]
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 3)) == [0, 1, 2]
        assert outgoing_rows(shop.outbox.store) == (3, 0)
        engine = shop.outbox.engine
        assert not engine.dispatch.commit and not engine.dispatch.rollback, "no listener on the engine"


def test_a_session_whose_flush_fails_at_its_commit_stores_and_sends_nothing(broker_url, database_url,
                                                                           table_prefix):
    """The Session's flush fails at the commit (a duplicate key), after the unit of work chose to
    store its messages with the COMMIT: the commit raises the flush's error, nothing is stored or
    published, and the next unit of work on the same connection (a pool of one) stores and sends
    only its own message."""
    from sqlalchemy.exc import IntegrityError

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop, notes_of(shop) as Note:
        with shop.outbox.transaction() as session:
            session.add(Note("taken"))
        with pytest.raises(IntegrityError):
            with shop.outbox.transaction() as session:
                session.add(Note("taken"))
                shop.durable.delay(1)
                shop.plain.delay(1)
        assert nothing_more(shop.app, shop.durable_queue) and nothing_more(shop.app, shop.plain_queue)
        assert outgoing_rows(shop.outbox.store) == (0, 0)
        with shop.outbox.transaction() as session:
            session.add(Note("free"))
            shop.durable.delay(2)
        assert [m.args[0] for m in receive(shop.app, shop.durable_queue, 1)] == [2]
        assert nothing_more(shop.app, shop.durable_queue)
        assert outgoing_rows(shop.outbox.store) == (1, 0)


def test_a_session_commit_interrupted_under_its_insert_drops_the_unit_and_its_connection(
        broker_url, database_url, table_prefix, monkeypatch):
    """A signal (a soft time limit) interrupts the Session's commit while the messages' INSERT and
    the COMMIT are on the wire: the block raises it, the connection is dropped (its protocol
    state is unknown), the user's row and the messages are neither committed nor published, and
    the next unit of work runs on a new connection (a pool of one)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: the INSERT goes with the COMMIT there")
    from sqlalchemy import text

    from celery_outbox.store import pipeline

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop, notes_of(shop) as Note:
        with shop.outbox.transaction() as session:
            session.add(Note("first"))
            shop.durable.delay(0)
            first = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with monkeypatch.context() as patch:
            patch.setattr(pipeline, "pipeline_exchange", interrupted_exchange)
            with pytest.raises(Interrupted):
                with shop.outbox.transaction() as session:
                    session.add(Note("interrupted"))
                    shop.durable.delay(1)
                    shop.plain.delay(1)
        with shop.outbox.transaction() as session:
            session.add(Note("after"))
            shop.durable.delay(2)
            assert session.execute(text("SELECT pg_backend_pid()")).scalar_one() != first
        with shop.outbox.transaction() as session:
            assert sorted(note.id for note in session.query(Note)) == ["after", "first"]
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 2)) == [0, 2]
        assert nothing_more(shop.app, shop.plain_queue)
        assert outgoing_rows(shop.outbox.store) == (2, 0), "the interrupted unit stored nothing"


def test_a_connection_lost_before_the_pool_prepares_on_it_is_replaced(broker_url, database_url, table_prefix):
    """The pool hands out a connection whose messages' INSERT is to be prepared, and finds it
    lost (its server process ended between two units of work): it connects afresh, and the unit
    of work runs on the new connection as if nothing happened; nothing is lost."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no prepared statements")
    from .test_engine_and_commits import count_pings, terminate

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop:
        lost = unit_opened_by_a_statement(shop, 0)
        terminate(database_url, lost, wait=True)
        pings = count_pings(shop.outbox.engine)
        assert unit_opened_by_a_statement(shop, 1) != lost
        assert pings == [], "the preparing checkout found the connection lost, not the idle ping"
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 2)) == [0, 1]
        assert outgoing_rows(shop.outbox.store) == (2, 0)


def test_a_checkout_interrupted_while_it_prepares_drops_the_connection(broker_url, database_url, table_prefix,
                                                                     monkeypatch):
    """A signal (a soft time limit) interrupts the pool's prepare on the connection it hands out:
    the checkout fails with that error, the pool drops the connection (its protocol state is
    unknown), and the next unit of work runs on a new one; nothing is lost."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no prepared statements")

    from celery_outbox.store import pipeline

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop:
        first = unit_opened_by_a_statement(shop, 0)
        with monkeypatch.context() as patch:
            patch.setattr(pipeline, "pipeline_exchange", interrupted_exchange)
            with pytest.raises(Interrupted):
                with shop.outbox.begin():
                    shop.durable.delay(1)
        assert unit_opened_by_a_statement(shop, 2) != first
        assert sorted(m.args[0] for m in receive(shop.app, shop.durable_queue, 2)) == [0, 2]
        assert outgoing_rows(shop.outbox.store) == (2, 0), "the interrupted unit stored nothing"


def test_a_durable_message_outside_a_unit_of_work_is_stored_in_one_round_trip(broker_url, database_url,
                                                                             table_prefix):
    """On PostgreSQL a durable ``delay()`` outside a unit of work stores its row in one round trip
    (BEGIN, the INSERT, COMMIT), then the publisher takes it after the publish."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no round trips")
    from .test_store_contract import ProtocolTrace

    with own_shop(broker_url, database_url, table_prefix) as shop:
        trace = ProtocolTrace(shop.outbox.store)
        try:
            sent = [shop.durable.delay(n).id for n in range(2)]
            trips = trace.statement_trips()
        finally:
            trace.close()
        stores = [trip for trip in trips if any("insert_outgoing" in s for s in trip)]
        assert len(stores) == 2, trips
        for trip in stores:
            statements = [s for s in trip if not s.startswith("PREPARE")]
            assert statements[0] == "BEGIN" and statements[1].startswith("EXECUTE celery_outbox_insert_outgoing_") \
                and statements[2:] == ["COMMIT"], trip
        assert sorted(m.id for m in receive(shop.app, shop.durable_queue, 2)) == sorted(sent)
        assert unsent_rows(shop.outbox.store) == 0


def test_a_connection_lost_before_the_commit_raises_what_engine_begin_raises(shop, database_url, unit_of_work):
    """The server ends the unit of work's session before its block ends: the block raises
    SQLAlchemy's ``OperationalError`` with ``connection_invalidated`` set, as ``engine.begin()``
    does (a caller's retry of its database work catches it); nothing is stored or published, and
    the next unit of work commits and publishes."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no server to end a session")
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from .test_engine_and_commits import terminate

    with pytest.raises(OperationalError) as raised:
        with unit_of_work(shop) as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            shop.plain.delay(1)
            shop.durable.delay(2)
            terminate(database_url, pid)
    assert raised.value.connection_invalidated, raised.value
    assert nothing_more(shop.app, shop.plain_queue)
    assert nothing_more(shop.app, shop.durable_queue)
    assert shop.outbox.store.count_outgoing() == 0
    with unit_of_work(shop):
        durable = shop.durable.delay(3)
    assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [durable.id]


def test_a_connection_lost_under_a_durable_message_stored_alone_raises_store_unavailable(
        broker_url, database_url, table_prefix, monkeypatch):
    """Outside a unit of work, the server ends the session just as a durable ``delay()`` sends its
    row's BEGIN, INSERT and COMMIT: ``delay()`` raises ``StoreUnavailable`` naming the store, as it
    does with the database down; nothing is stored or published, and the next ``delay()`` runs on
    a new connection (a pool of one)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: SQLite has no server to end a session")
    from celery_outbox import StoreUnavailable
    from celery_outbox.store import pipeline

    from .test_engine_and_commits import terminate

    real_exchange = pipeline.pipeline_exchange
    ended: list[int] = []

    def exchange_on_an_ended_session(driver, send):
        if not ended:
            ended.append(driver.info.backend_pid)
            terminate(database_url, ended[0], wait=True)
        return real_exchange(driver, send)

    with pool_of_one_shop(broker_url, database_url, table_prefix) as shop:
        with monkeypatch.context() as patch:
            patch.setattr(pipeline, "pipeline_exchange", exchange_on_an_ended_session)
            with pytest.raises(StoreUnavailable, match="cannot use the message store") as raised:
                shop.durable.delay(1)
        assert ended and raised.value.__cause__ is not None, "the session ended under the exchange"
        assert nothing_more(shop.app, shop.durable_queue)
        assert outgoing_rows(shop.outbox.store) == (0, 0)
        sent = shop.durable.delay(2).id
        assert [m.id for m in receive(shop.app, shop.durable_queue, 1)] == [sent]


def test_a_retry_surviving_a_rolled_back_block_is_stored_once_the_block_gave_its_connection_back(
        broker_url, database_url, table_prefix, unit_of_work):
    """A plain task on a durable queue raises ``self.retry()`` inside a unit of work: the block
    rolls back, and the retry (Celery decided on it) is stored and sent after the block's connection
    is back in the pool: a pool of three is enough (the worker's liveness lock and the attempt's
    claim hold the others; storing the retry while the block held its connection waited for a
    fourth until the pool timed out, and the retry was lost)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: the drill counts a PostgreSQL store's pooled connections")
    import uuid

    from celery.contrib.testing.worker import start_worker

    with own_shop(broker_url, database_url, table_prefix,
                  outbox_engine_options={"pool_size": 3, "max_overflow": 0, "pool_timeout": 3}) as shop:
        app = shop.app
        attempts = []

        @app.task(name=f"shop.flaky_{uuid.uuid4().hex[:8]}", bind=True, shared=False, max_retries=3,
                  queue=shop.durable_queue)
        def flaky(self):
            attempts.append(self.request.retries)
            with unit_of_work(shop):
                if self.request.retries == 0:
                    raise self.retry(countdown=0)
            return "done"

        app.conf.result_backend = "cache+memory://"
        with start_worker(app, pool="solo", queues=[shop.durable_queue], perform_ping_check=False,
                          shutdown_timeout=30):
            result = flaky.delay()
            assert result.get(timeout=20) == "done"
        assert attempts == [0, 1]
        assert unsent_rows(shop.outbox.store) == 0
