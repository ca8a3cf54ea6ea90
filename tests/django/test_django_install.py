"""Installing the Django app: ``manage.py migrate`` creates the outbox's tables, the very tables
and indexes ``celery outbox migrate`` creates, in each Django database it migrates; the outbox
reads its settings from Django's settings and stores its messages in Django's database."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connections
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from celery_outbox.django.settings import database_url
from celery_outbox.store import Store

from ..conftest import drop_store, unique_prefix
from ..integration.test_engine_and_commits import tcp_options

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)

DJANGO_PREFIX = "dj_outbox_"


def schema(engine, prefix: str) -> dict:
    """Every table of ``prefix``: its columns, primary key, indexes (with their predicates) and
    foreign keys, with the prefix taken out of every name."""
    inspector = inspect(engine)

    def bare(name: str) -> str:
        return name.replace(prefix, "<prefix>")

    tables = {}
    for table in sorted(name for name in inspector.get_table_names() if name.startswith(prefix)):
        tables[bare(table)] = {
            "columns": [(c["name"], str(c["type"]), c["nullable"], bare(str(c.get("default"))))
                        for c in inspector.get_columns(table)],
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "indexes": sorted((bare(i["name"]), tuple(i["column_names"]), bool(i["unique"]),
                               str(i.get("dialect_options", {}).get("postgresql_where")))
                              for i in inspector.get_indexes(table)),
            "foreign_keys": sorted((bare(f["referred_table"]), tuple(f["constrained_columns"]))
                                   for f in inspector.get_foreign_keys(table)),
        }
    return tables


@pytest.mark.parametrize("using", ["default", "pg"], indirect=True)
def test_migrate_creates_the_tables_the_cli_creates(using):
    engine = create_engine(database_url(using))
    prefix = unique_prefix()
    cli = Store(engine, prefix)
    cli.migrate()  # what `celery outbox migrate` runs
    try:
        migrated = schema(engine, DJANGO_PREFIX)
        assert migrated, "manage.py migrate created no outbox table"
        assert migrated == schema(engine, prefix)
    finally:
        drop_store(cli)
        engine.dispose()


@pytest.mark.parametrize("using", ["pg"], indirect=True)
def test_migrate_follows_the_database_it_is_given(using):
    """``migrate --database`` creates (and, reversed, drops) the tables in that database only."""
    def tables(alias: str) -> set[str]:
        return {name for name in connections[alias].introspection.table_names() if name.startswith(DJANGO_PREFIX)}

    created = tables("pg")
    assert created and tables("default") == created
    call_command("migrate", "celery_outbox", "zero", database="pg", verbosity=0)
    assert tables("pg") == set() and tables("default") == created
    call_command("migrate", "celery_outbox", database="pg", verbosity=0)
    assert tables("pg") == created and tables("default") == created


def test_the_outbox_reads_django_settings_and_stores_in_django_database(shop):
    from django.conf import settings

    outbox_settings = shop.outbox.settings
    assert outbox_settings.table_prefix == settings.CELERY_OUTBOX_TABLE_PREFIX == DJANGO_PREFIX
    assert outbox_settings.django_database == shop.using
    expected = make_comparable(database_url(shop.using))
    assert make_comparable(str(shop.outbox.engine.url.render_as_string(hide_password=False))) == expected
    assert shop.outbox.ready().store.missing_tables() == []  # the tables manage.py migrate made


def make_comparable(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_only_an_outbox_whose_store_is_the_django_database_joins_its_transactions(tmp_path):
    """``celery_outbox.django`` installed: an outbox on Django's database (by default, or named by
    its URL) joins Django's transactions; one whose URL names another database does not."""
    from celery import Celery

    from celery_outbox import Outbox

    def outbox(**overrides):
        return Outbox(Celery(f"dj_{unique_prefix()}", broker="memory://", set_as_current=False), **overrides)

    assert outbox().runtime.joined.name == "django"
    assert outbox(database_url=database_url("default")).runtime.joined.name == "django"
    assert outbox(database_url=f"sqlite:///{tmp_path / 'other.sqlite3'}").runtime.joined is None


@pytest.mark.parametrize("using", ["pg"], indirect=True)
def test_the_outbox_engine_connects_with_the_libpq_options_of_django(using, monkeypatch):
    """The entries of the database's ``OPTIONS`` that are libpq connection parameters reach the
    outbox's own engine, read off its real connection (a keepalive and the user timeout on the
    socket, a ``search_path``); Django's own entries do not, and the library's keepalive options
    fill in the rest."""
    from celery import Celery
    from psycopg import IsolationLevel

    from celery_outbox import Outbox

    options = {"keepalives_idle": 7, "tcp_user_timeout": 12_000, "options": "-c search_path=outbox_schema,public",
               "isolation_level": IsolationLevel.SERIALIZABLE, "server_side_binding": True, "pool": False}
    monkeypatch.setitem(connections[using].settings_dict, "OPTIONS", options)
    assert set(make_url(database_url(using)).query) == {"keepalives_idle", "tcp_user_timeout", "options"}
    outbox = Outbox(Celery(f"dj_{unique_prefix()}", broker="memory://", set_as_current=False), django_database=using)
    try:
        with outbox.engine.connect() as conn:
            assert conn.execute(text("SHOW search_path")).scalar_one() == "outbox_schema,public"
            assert tcp_options(conn) == {"keepalive": 1, "idle": 7, "interval": 10, "count": 3,
                                         "user_timeout_ms": 12_000}
            assert conn.execute(text("SHOW transaction_isolation")).scalar_one() == "read committed"
    finally:
        outbox.engine.dispose()


def test_the_apps_migrations_hold_every_model_it_has():
    """``makemigrations --check`` finds nothing to make: the admin's models (and the status page's
    proxy) are in the app's migrations."""
    call_command("makemigrations", "celery_outbox", check=True, dry_run=True, verbosity=0)  # SystemExit(1) if not
