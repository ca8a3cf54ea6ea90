"""Recover, cleanup, durable scheduling and dead-letter replay: fast checks on SQLite and kombu's
in-memory transport. The same claims run against PostgreSQL, Redis and real workers in
tests/integration/test_durability_workers.py."""

from __future__ import annotations

from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
from kombu.utils import json as kombu_json
from sqlalchemy import select, update

from celery_outbox.maintenance.dead_letters import DeadLetterFilter, purge, replay
from celery_outbox.store import as_utc, utcnow
from celery_outbox.vocabulary import SEND_HEADER, ArchiveKind

from ..apps.factory import make_shop, strand
from ..brokers import nothing_more, receive
from ..conftest import unsent_rows


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_relay_max_attempts=3)
    shop.outbox.ready()
    return shop


def outgoing(shop):
    with shop.outbox.store.begin() as conn:
        return conn.execute(select(shop.outbox.store.tables.outgoing)).all()


def make_due(shop):
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).values(deliver_at=utcnow() - timedelta(seconds=1)))


def test_both_beat_tasks_are_scheduled_with_expiry(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_maintenance_queue="maintenance",
                     outbox_cleanup_interval=120)
    schedule = shop.app.conf.beat_schedule
    assert schedule["celery_outbox.recover"]["schedule"] == 5.0
    assert schedule["celery_outbox.cleanup"]["schedule"] == 120
    for name in ("celery_outbox.recover", "celery_outbox.cleanup"):
        assert schedule[name]["task"] == name
        assert schedule[name]["options"] == {"expires": schedule[name]["schedule"], "queue": "maintenance"}
        assert name in shop.app.tasks


@pytest.mark.parametrize("timing", ["countdown", "eta"])
def test_a_long_durable_countdown_is_held_in_the_database_with_its_eta(shop, timing):
    """Beyond the release window (``release_ahead``, 15 s by default) the message waits in the
    outgoing table, its eta header intact; once released it reaches the broker with that eta,
    once, so the worker holds it until then as in Celery."""
    options = {"countdown": 60} if timing == "countdown" else {"eta": utcnow() + timedelta(seconds=60)}
    with shop.outbox.transaction():
        result = shop.durable.apply_async(("later",), **options)
    (row,) = outgoing(shop)
    eta = kombu_json.loads(row.headers)["eta"]
    assert as_utc(row.deliver_at) == datetime.fromisoformat(eta), "deliver_at is the eta the sender set"
    assert as_utc(row.deliver_at) == pytest.approx(utcnow() + timedelta(seconds=60), abs=timedelta(seconds=5))
    assert nothing_more(shop.app, shop.durable_queue), "not published at the commit: it is not in the window"
    assert shop.outbox.recover().relay.published == 0, "not published before its window"
    make_due(shop)
    assert shop.outbox.recover().relay.published == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args, message.headers["eta"]) == (result.id, ["later"], eta)
    assert shop.outbox.recover().relay.published == 0
    assert nothing_more(shop.app, shop.durable_queue), "published once"


def test_a_short_durable_countdown_is_published_at_the_commit_with_its_eta(shop):
    """Inside the release window the message goes out with the commit, eta kept; its redelivery
    counts from its eta, so it is not published again while the worker holds it."""
    with shop.outbox.transaction():
        result = shop.durable.apply_async(("soon",), countdown=10)
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (result.id, ["soon"])
    (row,) = outgoing(shop)
    eta = datetime.fromisoformat(message.headers["eta"])
    assert as_utc(row.deliver_at) == eta and row.sent_at is not None
    assert as_utc(row.redeliver_at) == eta + timedelta(seconds=shop.outbox.settings.redeliver_after)


def test_a_durable_countdown_outside_a_unit_of_work_is_held_too(shop):
    shop.durable.apply_async(("later",), countdown=60)
    assert len(outgoing(shop)) == 1
    assert nothing_more(shop.app, shop.durable_queue)


def test_a_countdown_to_a_plain_queue_keeps_celerys_broker_eta(shop):
    with shop.outbox.transaction():
        shop.plain.apply_async(("later",), countdown=60)
    (message,) = receive(shop.app, shop.plain_queue, 1)
    assert message.headers["eta"] is not None
    assert outgoing(shop) == []


def test_an_expired_outgoing_row_is_dead_lettered_not_published(shop):
    (expired,) = strand(shop, "too late", expires=utcnow() + timedelta(seconds=30))
    (fresh,) = strand(shop, "fine", expires=utcnow() + timedelta(hours=1))
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).where(table.c.message_id == expired.id)
                     .values(expires_at=utcnow() - timedelta(seconds=1)))
    result = shop.outbox.recover()
    assert (result.relay.published, result.relay.expired) == (1, 1)
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert message.id == fresh.id
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason) == (expired.id, "expired")
    assert [row.message_id for row in outgoing(shop)] == [fresh.id], "only the sent one is left, for its inbox"
    assert unsent_rows(shop.outbox.store) == 0


def envelope_row(shop, message_id, **extra):
    """An inbox row as a worker of a durable queue leaves it when it dies mid-task."""
    strand(shop, message_id)
    (task_id,) = lost_envelopes(shop, **extra)
    return task_id


def lost_envelopes(shop, **extra) -> list[str]:
    """Every outgoing row turned into the inbox row a worker of its durable queue leaves when it
    dies mid-task (the sender's row gone, the envelope running, unowned, due for recovery); their
    message ids."""
    rows = outgoing(shop)
    with shop.outbox.store.begin() as conn:
        shop.outbox.store.delete_outgoing(conn, [row.id for row in rows])
    now = utcnow()
    for row in rows:
        values = dict(message_id=row.message_id, destination="", task_name=row.task_name, queue=shop.durable_queue,
                      status="running", owner=0, received_at=now, recover_after=now - timedelta(seconds=1),
                      exchange=row.exchange, routing_key=row.routing_key, body=row.body,
                      content_type=row.content_type, content_encoding=row.content_encoding, headers=row.headers,
                      properties=row.properties)
        values.update(extra)
        with shop.outbox.store.begin() as conn:
            shop.outbox.store.insert_incoming(conn, values)
    return [row.message_id for row in rows]


def test_a_stranded_envelope_is_republished_then_backs_off(shop):
    task_id = envelope_row(shop, "stranded")
    first = shop.outbox.recover()
    assert first.envelopes_republished == 1
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args) == (task_id, ["stranded"])
    row = shop.outbox.store.get_incoming(task_id)
    assert row.recoveries == 1 and as_utc(row.recover_after) > utcnow(), "backed off"
    assert shop.outbox.recover().envelopes_republished == 0
    assert nothing_more(shop.app, shop.durable_queue)


def test_an_envelope_recovered_too_often_is_dead_lettered(shop):
    task_id = envelope_row(shop, "kills its worker", recoveries=3)
    result = shop.outbox.recover()
    assert (result.envelopes_republished, result.envelopes_dead_lettered) == (0, 1)
    assert shop.outbox.store.get_incoming(task_id).status == "dead"
    (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.message_id, letter.reason) == (task_id, "worker_lost")
    assert nothing_more(shop.app, shop.durable_queue)


def expired_inbox_rows(store, count: int) -> None:
    """``count`` handled inbox rows ``old0``.. whose ``keep_until`` has just passed."""
    now = utcnow()
    with store.begin() as conn:
        for n in range(count):
            store.insert_incoming(conn, dict(message_id=f"old{n}", destination="", status="handled",
                                             received_at=now, keep_until=now - timedelta(seconds=1)))


def test_cleanup_deletes_expired_rows_and_hands_them_to_the_archiver_first(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_cleanup_batch_size=4,
                     outbox_dead_letter_retention=3600)
    shop.outbox.ready()
    store = shop.outbox.store
    now = utcnow()
    expired_inbox_rows(store, 10)
    with store.begin() as conn:
        store.insert_incoming(conn, dict(message_id="kept", destination="", status="handled", received_at=now,
                                         keep_until=now + timedelta(days=1)))
        store.insert_dead_letters(conn, [
            dict(message_id="old-letter", reason="failed", failed_at=now - timedelta(hours=2)),
            dict(message_id="new-letter", reason="failed", failed_at=now)])
    archived: list[tuple[str, str]] = []
    kinds: list[object] = []

    class Recorder:
        def archive(self, kind, rows):
            kinds.append(kind)
            archived.extend((f"{kind}", row.message_id) for row in rows)  # as an archiver names a folder

    shop.outbox.archiver = Recorder()
    result = shop.outbox.cleanup()
    assert (result.incoming_deleted, result.dead_letters_deleted, result.archived) == (10, 1, 11)
    assert set(kinds) == {ArchiveKind.INCOMING, ArchiveKind.DEAD_LETTERS}
    assert all(isinstance(kind, ArchiveKind) for kind in kinds), "a kind is an ArchiveKind, formatted as its value"
    assert result.batches == 4, "10 rows in batches of 4, then one batch of dead letters"
    assert sorted(m for kind, m in archived if kind == "incoming") == sorted(f"old{n}" for n in range(10))
    assert [m for kind, m in archived if kind == "dead_letters"] == ["old-letter"]
    assert store.count_incoming() == 1 and store.get_incoming("kept") is not None
    assert [r.message_id for r in store.list_dead_letters(store.dead_letter_filter())] == ["new-letter"]


@pytest.mark.parametrize("rest", [0, 2.5])
def test_cleanup_rests_between_batches_in_proportion_to_each_batch(sqlite_url, table_prefix, monkeypatch, rest):
    """``outbox_cleanup_rest`` sleeps ``rest`` times each batch's own duration before the next batch."""
    from celery_outbox.maintenance import batches

    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_cleanup_batch_size=4, outbox_cleanup_rest=rest)
    shop.outbox.ready()
    expired_inbox_rows(shop.outbox.store, 10)
    clock = iter(range(0, 1000, 2))  # every batch takes 2 s on cleanup's clock
    slept: list[float] = []
    monkeypatch.setattr(batches, "time", SimpleNamespace(monotonic=lambda: float(next(clock)),
                                                            sleep=slept.append))
    result = shop.outbox.cleanup()
    assert (result.incoming_deleted, result.batches) == (10, 3)
    assert slept == ([] if rest == 0 else [rest * 2, rest * 2]), "a rest before each batch after the first"


def test_a_failing_archiver_deletes_nothing(shop):
    """The archive comes first: rows it could not take stay for the next cleanup."""
    store = shop.outbox.store
    with store.begin() as conn:
        store.insert_incoming(conn, dict(message_id="old", destination="", status="handled", received_at=utcnow(),
                                         keep_until=utcnow() - timedelta(seconds=1)))

    class Broken:
        def archive(self, kind, rows):
            raise OSError("archive volume is full")

    shop.outbox.archiver = Broken()
    with pytest.raises(OSError, match="volume is full"):
        shop.outbox.cleanup()
    assert store.get_incoming("old") is not None


def dead_letter_of(shop, *args):
    ids = []
    for arg in args:
        (sent,) = strand(shop, arg)
        (row,) = outgoing(shop)
        store = shop.outbox.store
        with store.begin() as conn:
            store.delete_outgoing(conn, [row.id])
            store.insert_dead_letters(conn, [dict(
                message_id=sent.id, task_name=row.task_name, queue=shop.durable_queue, reason="failed",
                exception_type="ValueError", failed_at=utcnow(), exchange=row.exchange, routing_key=row.routing_key,
                body=row.body, content_type=row.content_type, content_encoding=row.content_encoding,
                headers=row.headers, properties=row.properties)])
        ids.append(sent.id)
    return ids


def test_replay_republishes_through_the_outbox_as_a_new_attempt(shop):
    (task_id,) = dead_letter_of(shop, "again")
    store = shop.outbox.store
    (letter,) = store.list_dead_letters(store.dead_letter_filter())
    progress = []
    replayed = replay(shop.outbox.publisher, DeadLetterFilter(ids=(letter.id,)), progress=progress.append)
    assert replayed.message_ids == [task_id]
    assert progress == [1]
    (message,) = receive(shop.app, shop.durable_queue, 1)
    assert (message.id, message.args, message.headers["celery_outbox_replay"]) == (task_id, ["again"], 1)
    letter = store.get_dead_letter(letter.id)
    assert letter.replay_count == 1 and letter.replayed_at is not None
    assert unsent_rows(shop.outbox.store) == 0, "the outgoing row was published"
    replay(shop.outbox.publisher, DeadLetterFilter(ids=(letter.id,)))
    (second,) = receive(shop.app, shop.durable_queue, 1)
    assert second.headers["celery_outbox_replay"] == 2, "each replay is a later attempt"


def test_purge_deletes_only_the_old_matching_letters(shop):
    dead_letter_of(shop, "a", "b", "c")
    store = shop.outbox.store
    table = store.tables.dead_letters
    first = store.list_dead_letters(store.dead_letter_filter())[0]
    with store.begin() as conn:
        conn.execute(update(table).where(table.c.id == first.id).values(failed_at=utcnow() - timedelta(days=30)))
    counted = []
    old = DeadLetterFilter(failed_before=utcnow() - timedelta(days=7))
    deleted = purge(shop.outbox.runtime, old, progress=counted.append)
    assert (deleted, counted) == (1, [1])
    assert first.id not in [r.id for r in store.list_dead_letters(store.dead_letter_filter())]
    assert store.count_dead_letters() == 2


def test_a_sent_durable_message_is_redelivered_until_an_inbox_acknowledges_it(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_redeliver_after=60)
    shop.outbox.ready()
    result = shop.durable.delay("lost by the broker")
    (row,) = outgoing(shop)
    assert row.sent_at is not None and unsent_rows(shop.outbox.store) == 0
    assert as_utc(row.redeliver_at) == pytest.approx(utcnow() + timedelta(seconds=60), abs=timedelta(seconds=5))
    assert receive(shop.app, shop.durable_queue, 1)[0].id == result.id  # then the broker loses it
    assert shop.outbox.recover().redelivered == 0, "not before redeliver_after"
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        conn.execute(update(table).values(redeliver_at=utcnow() - timedelta(seconds=1)))
    assert shop.outbox.recover().redelivered == 1
    (again,) = receive(shop.app, shop.durable_queue, 1)
    assert (again.id, again.args) == (result.id, ["lost by the broker"])
    (row,) = outgoing(shop)
    assert row.redeliveries == 1
    assert again.headers[SEND_HEADER] == row.send_id, "the copy carries the identity of its send"
    assert as_utc(row.redeliver_at) == pytest.approx(utcnow() + timedelta(seconds=120), abs=timedelta(seconds=5)), \
        "the wait doubles"
    assert shop.outbox.recover().redelivered == 0
    with shop.outbox.store.begin() as conn:
        assert shop.outbox.store.acknowledge_outgoing(conn, result.id, None, (0, 0, 0), row.send_id) == 1, \
            "an inbox took it"
    assert outgoing(shop) == []


def test_without_delivery_tracking_sent_rows_are_deleted(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_redeliver_after=None)
    shop.outbox.ready()
    result = shop.durable.delay(1)
    assert outgoing(shop) == []
    assert receive(shop.app, shop.durable_queue, 1)[0].id == result.id
    assert shop.outbox.recover().redelivered == 0


@pytest.mark.parametrize("error, said", [
    (ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow"), "which is not installed"),
    (ImportError("numpy.core.multiarray failed to import"),
     "which is installed but cannot be imported: numpy.core.multiarray failed to import"),
])
def test_an_archive_without_a_working_pyarrow_says_which(monkeypatch, tmp_path, error, said):
    import builtins

    from celery_outbox.audit.archive import ParquetArchiver
    from celery_outbox.errors import ConfigurationError

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(ConfigurationError, match=f"outbox_archive_path needs pyarrow, {said}"):
        ParquetArchiver(str(tmp_path / "archive"))


def test_the_archive_refuses_a_kind_it_does_not_keep_naming_the_kinds(tmp_path):
    """A kind outside ``ArchiveKind`` is an error that names the kinds; nothing is written."""
    from celery_outbox.audit.archive import ParquetArchiver

    archiver = ParquetArchiver(str(tmp_path / "archive"))
    with pytest.raises(ValueError, match="^unknown archive kind 'outgoing'; expected one of 'incoming', "
                                         "'dead_letters', 'sent'$"):
        archiver.archive("outgoing", [SimpleNamespace(message_id="m1")])
    assert not (tmp_path / "archive").exists()
    archiver.archive("sent", [SimpleNamespace(message_id="m1", destination="", task_name="t", created_at=None,
                                              sent_at=datetime(2026, 11, 22, 12, 0))])
    assert [p.name for p in (tmp_path / "archive").iterdir()] == ["sent"], "a kind given as its string is kept"
