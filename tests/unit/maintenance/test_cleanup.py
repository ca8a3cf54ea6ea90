"""Cleanup (``celery_outbox.maintenance.cleanup``) on SQLite: expired rows deleted in batches, handed
to the archiver first, with rests between batches; nothing deleted when the archiver fails."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from celery_outbox.store import utcnow
from celery_outbox.vocabulary import ArchiveKind

from ...apps.factory import make_shop


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


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
