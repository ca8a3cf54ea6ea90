"""The outgoing rows' statements (``celery_outbox.store.outgoing``) on SQLite: the record of sends (the
audit's ``sent`` table) keeps a scheduled message's eta."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from celery_outbox.store import Store, as_utc, build_engine, utcnow


def outgoing_row(n: int, **extra) -> dict:
    return dict(message_id=f"m{n}", task_name="t.add", destination="q", exchange="", routing_key="q",
                body=b"[[1, 2], {}, {}]", content_type="application/json", content_encoding="utf-8",
                headers="{}", properties="{}", created_at=utcnow(), **extra)


def test_a_scheduled_send_is_recorded_with_its_eta_and_an_immediate_one_without(tmp_path):
    store = Store(build_engine(f"sqlite:///{tmp_path / 'store.db'}"))
    store.migrate()
    due = utcnow().replace(microsecond=0) + timedelta(minutes=10)
    with store.begin() as conn:
        ids = store.insert_outgoing(conn, [outgoing_row(0), outgoing_row(1, deliver_at=due)])
        store.finish_sent(conn, ids, utcnow(), None, record=True)
    with store.begin() as conn:
        sent = store.tables.sent
        recorded = dict(conn.execute(select(sent.c.message_id, sent.c.deliver_at).order_by(sent.c.message_id)).all())
    assert recorded["m0"] is None and as_utc(recorded["m1"]) == due
