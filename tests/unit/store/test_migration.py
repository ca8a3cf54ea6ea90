"""Migrations (``celery_outbox.store.migration``) on SQLite: a schema of version 5 gains the eta of sends."""

from __future__ import annotations

from sqlalchemy import inspect

from celery_outbox.store import SCHEMA_VERSION, Store, build_engine


def test_a_schema_of_version_5_gains_the_eta_of_sends(tmp_path):
    store = Store(build_engine(f"sqlite:///{tmp_path / 'store.db'}"))
    store.migrate()
    sent = store.tables.sent
    with store.begin() as conn:
        conn.exec_driver_sql(f'ALTER TABLE "{sent.name}" DROP COLUMN deliver_at')
        conn.execute(store.tables.schema.update().values(version=5))

    result = store.migrate()

    assert (result.version_before, result.version_after) == (5, SCHEMA_VERSION)
    assert "deliver_at" in {column["name"] for column in inspect(store.engine).get_columns(sent.name)}
