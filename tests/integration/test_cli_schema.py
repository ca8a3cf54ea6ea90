"""``celery -A proj outbox migrate|status`` run as real subprocesses, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from celery_outbox.store import SCHEMA_VERSION, Store, build_engine

from ..conftest import drop_store

ROOT = Path(__file__).parents[2]


def celery(*args: str, url: str, prefix: str) -> subprocess.Popen:
    env = dict(os.environ, TEST_DATABASE_URL=url, TEST_TABLE_PREFIX=prefix, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", *args],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def run(*args: str, url: str, prefix: str) -> subprocess.CompletedProcess:
    process = celery(*args, url=url, prefix=prefix)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_migrate_creates_then_reports_nothing_to_do(database_url, table_prefix):
    store = Store(build_engine(database_url), table_prefix)
    try:
        first = run("migrate", url=database_url, prefix=table_prefix)
        assert first.returncode == 0, first.stderr
        assert f"{table_prefix}outgoing" in first.stdout
        assert f"schema version: None -> {SCHEMA_VERSION}" in first.stdout
        second = run("migrate", url=database_url, prefix=table_prefix)
        assert second.returncode == 0, second.stderr
        assert "created tables: none" in second.stdout
        assert store.missing_tables() == []
    finally:
        drop_store(store)


def test_two_migrations_at_once_both_succeed(database_url, table_prefix):
    store = Store(build_engine(database_url), table_prefix)
    try:
        processes = [celery("migrate", url=database_url, prefix=table_prefix) for _ in range(2)]
        results = [p.communicate(timeout=120) + (p.returncode,) for p in processes]
        assert [code for _, _, code in results] == [0, 0], results
        created = [out for out, _, _ in results if f"{table_prefix}outgoing" in out]
        assert len(created) == 1, "exactly one of the two runs creates the tables"
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        drop_store(store)


def test_status_prints_counts_and_json(database_url, table_prefix):
    store = Store(build_engine(database_url), table_prefix)
    store.migrate()
    try:
        with store.begin() as conn:
            from .test_store_contract import outgoing_row

            store.insert_outgoing(conn, [outgoing_row(1), outgoing_row(2)])
        store.register_node("worker-1:abc", "worker-1", 42)
        text = run("status", url=database_url, prefix=table_prefix)
        assert text.returncode == 0, text.stderr
        assert "outgoing (outbox):" in text.stdout and "pending" in text.stdout
        assert "worker-1:abc" in text.stdout
        machine = run("status", "--json", url=database_url, prefix=table_prefix)
        report = json.loads(machine.stdout)
        assert report["outgoing"] == [{"status": "pending", "destination": "q", "count": 2}]
        assert report["oldest_pending_outgoing_age_seconds"] >= 0
        assert [n["name"] for n in report["nodes"]] == ["worker-1:abc"]
    finally:
        drop_store(store)


def test_unreachable_database_is_one_line_without_the_password(table_prefix):
    result = run("status", url="postgresql+psycopg://app:s3cret-pw@127.0.0.1:1/shop", prefix=table_prefix)
    assert result.returncode != 0
    assert "s3cret-pw" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot use the message store at postgresql+psycopg://app:***@127.0.0.1:1/shop" in result.stderr


def test_bad_prefix_is_one_clear_line(tmp_path):
    result = run("migrate", url=f"sqlite:///{tmp_path / 'x.sqlite3'}", prefix="bad-prefix")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "outbox_table_prefix = 'bad-prefix' is not valid" in result.stderr


def test_the_store_url_comes_from_the_option_then_the_environment_then_the_app(tmp_path, table_prefix):
    """``--database-url`` wins over ``CELERY_OUTBOX_DATABASE_URL``, which wins over the app's
    ``outbox_database_url``, as Celery's ``--broker`` and ``CELERY_BROKER_URL`` do."""
    app_url, environment_url, option_url = (f"sqlite:///{tmp_path / name}.sqlite3" for name in ("app", "env", "opt"))

    def migrate(*args: str, environment: str | None = None) -> str:
        env = dict(os.environ, TEST_DATABASE_URL=app_url, TEST_TABLE_PREFIX=table_prefix, PYTHONPATH=str(ROOT))
        env.pop("CELERY_OUTBOX_DATABASE_URL", None)
        if environment:
            env["CELERY_OUTBOX_DATABASE_URL"] = environment
        done = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", *args, "migrate"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[0]

    assert migrate() == f"store: {app_url}"
    assert migrate(environment=environment_url) == f"store: {environment_url}"
    assert migrate("--database-url", option_url, environment=environment_url) == f"store: {option_url}"
    for url in (app_url, environment_url, option_url):
        assert Store(build_engine(url), table_prefix).missing_tables() == []
