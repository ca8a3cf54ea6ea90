"""``Outbox(app)``: the entry point, its engine, start-up errors that name what is wrong."""

from __future__ import annotations

import importlib.util
import re

import pytest
from celery import Celery
from sqlalchemy import create_engine

import celery_outbox
from celery_outbox import ConfigurationError, Outbox, StoreUnavailable
from celery_outbox.store import build_engine


def make_app(**conf) -> Celery:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def test_public_api():
    assert {"Outbox", "metadata", "ConfigurationError", "StoreUnavailable"} <= set(celery_outbox.__all__)
    assert {t.name for t in celery_outbox.metadata.sorted_tables} == {
        "celery_outbox_incoming", "celery_outbox_outgoing", "celery_outbox_dead_letters",
        "celery_outbox_nodes", "celery_outbox_schema", "celery_outbox_sent",
    }


def test_outbox_reads_settings_and_builds_the_store(sqlite_url):
    outbox = Outbox(make_app(outbox_database_url=sqlite_url, outbox_table_prefix="shop_"))
    assert outbox.settings.table_prefix == "shop_"
    assert outbox.store.tables.outgoing.name == "shop_outgoing"
    assert outbox.ready().store.missing_tables() == []


def test_calling_outbox_twice_on_one_app_is_harmless(sqlite_url):
    app = make_app(outbox_database_url=sqlite_url)
    first = Outbox(app)
    assert Outbox(app) is first
    assert first.ready() is Outbox(app).ready()
    with pytest.raises(ConfigurationError, match="already called"):
        Outbox(app, engine=create_engine("sqlite://"))


def test_an_existing_engine_is_used_instead_of_the_url(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'given.sqlite3'}")
    outbox = Outbox(make_app(outbox_database_url="postgresql+psycopg://nobody@127.0.0.1:1/none"), engine=engine)
    assert outbox.engine is engine
    assert outbox.ready().store.missing_tables() == []


def test_settings_are_read_when_the_app_is_configured_not_at_import(sqlite_url):
    app = Celery("t", set_as_current=False)
    outbox = Outbox(app)
    app.config_from_object({"broker_url": "memory://", "outbox_database_url": sqlite_url,
                            "outbox_relay_batch_size": 3})
    assert outbox.settings.relay_batch_size == 3


def test_bad_setting_fails_at_start_up_with_one_clear_error():
    outbox = Outbox(make_app(outbox_table_prefix="x-y"))
    with pytest.raises(ConfigurationError, match="outbox_table_prefix"):
        outbox.ready()


@pytest.mark.parametrize(
    "url, message",
    [
        ("not a url", "is not a database URL"),
        ("mysql://root@localhost/test", "supports postgresql (production) and sqlite"),
        ("postgresql+psycopg2://u@h/d", "names the driver 'psycopg2': celery-outbox uses psycopg 3"),
        ("postgresql+pg8000://u@h/d", "names the driver 'pg8000': celery-outbox uses psycopg 3"),
    ],
)
def test_bad_database_urls(url, message):
    outbox = Outbox(make_app(outbox_database_url=url))
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        outbox.ready()


def test_a_postgresql_url_naming_no_driver_gets_psycopg_3():
    """SQLAlchemy before 2.1 takes psycopg2 for a URL that names no driver: the store takes psycopg 3
    on every version, and does not refuse the URL for a driver it does not name."""
    engine = build_engine("postgresql://u@h/d")
    try:
        assert engine.url.drivername == "postgresql+psycopg"
    finally:
        engine.dispose()


def test_missing_psycopg_is_reported_with_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "psycopg" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigurationError, match=r"needs psycopg 3.*celery-outbox\[postgres\]"):
        build_engine("postgresql://u@h/d")


def test_unreachable_database_names_the_store_and_hides_the_password():
    outbox = Outbox(make_app(outbox_database_url="postgresql+psycopg://app:s3cret-pw@127.0.0.1:1/shop"))
    with pytest.raises(StoreUnavailable) as error:
        outbox.ready()
    message = str(error.value)
    assert "cannot use the message store at postgresql+psycopg://app:***@127.0.0.1:1/shop" in message
    assert "s3cret-pw" not in message
    assert "\n" not in message


def test_auto_create_schema_off_names_the_migrate_command(sqlite_url):
    outbox = Outbox(make_app(outbox_database_url=sqlite_url, outbox_auto_create_schema=False))
    with pytest.raises(ConfigurationError, match="outbox migrate"):
        outbox.ready()
    outbox.migrate()
    assert outbox.ready().store.missing_tables() == []


@pytest.mark.parametrize("pool", ["threads", "celery.concurrency.thread:TaskPool", "gevent", "eventlet"])
def test_a_worker_running_tasks_in_one_process_sizes_the_engine_pool_from_its_concurrency(sqlite_url, pool):
    """Threads, gevent and eventlet share one engine among the worker's tasks: at worker start its
    pool holds a connection per task beside the node's heartbeat's (its liveness connection is
    outside the pool), and each task may take one more."""
    from types import SimpleNamespace

    app = make_app(outbox_database_url=sqlite_url)
    outbox = Outbox(app)
    assert outbox.engine.pool.size() == 5, "SQLAlchemy's default before the worker starts"
    outbox._on_worker_init(sender=SimpleNamespace(app=app, pool_cls=pool, concurrency=20))
    assert (outbox.engine.pool.size(), outbox.engine.pool._max_overflow) == (21, 20)
    assert outbox.ready().store.missing_tables() == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_worker_of_processes_keeps_the_engine_pool(sqlite_url, pool):
    app = make_app(outbox_database_url=sqlite_url)
    outbox = Outbox(app)
    engine = outbox.engine
    outbox._on_worker_init(sender=type("Worker", (), {"app": app, "pool_cls": pool, "concurrency": 20})())
    assert outbox.engine is engine and engine.pool.size() == 5


def test_a_pool_size_the_user_gave_is_kept_with_a_warning_when_too_small(sqlite_url, caplog):
    from types import SimpleNamespace

    app = make_app(outbox_database_url=sqlite_url, outbox_engine_options={"pool_size": 3})
    outbox = Outbox(app)
    with caplog.at_level("WARNING", logger="celery_outbox"):
        outbox._on_worker_init(sender=SimpleNamespace(app=app, pool_cls="threads", concurrency=8))
    assert outbox.engine.pool.size() == 3
    assert "give it pool_size=9 or more" in caplog.text
