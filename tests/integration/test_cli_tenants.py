"""The operator commands per tenant on real PostgreSQL, each a ``celery -A ... outbox`` subprocess:
a tenant with a database of its own, one with a schema of the test database, and one whose
database does not exist. In one process on SQLite files: tests/unit/test_cli_tenants.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import psycopg
import pytest

from celery_outbox.store import Store, build_engine

from ..conftest import drop_store
from .test_cli_schema import ROOT

pytestmark = pytest.mark.postgres


def with_database(url: str, database: str) -> str:
    return urlsplit(url)._replace(path=f"/{database}").geturl()


def admin(url: str) -> psycopg.Connection:
    """An autocommit connection to the server's ``postgres`` database (CREATE and DROP DATABASE)."""
    return psycopg.connect(with_database(url, "postgres").replace("postgresql+psycopg", "postgresql"),
                           autocommit=True)


@pytest.fixture
def tenants(postgres_url, table_prefix):
    """acme: a database of its own; globex: a schema of the test database; ghost: a database that
    does not exist (a password in its URL). All dropped afterwards, with the default store's tables."""
    run = uuid.uuid4().hex[:8]
    database, schema = f"cli_acme_{run}", f"cli_globex_{run}"
    with admin(postgres_url) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    places = {"acme": with_database(postgres_url, database),
              "globex": {"url": postgres_url, "schema": schema},
              "ghost": with_database(postgres_url, f"cli_ghost_{run}").replace("postgres@", "postgres:s3cret-pw@")}
    try:
        yield places
    finally:
        drop_store(Store(build_engine(postgres_url), table_prefix))
        with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        with admin(postgres_url) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def run(*args: str, url: str, prefix: str, tenants: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, TEST_DATABASE_URL=url, TEST_TABLE_PREFIX=prefix, TEST_TENANTS=json.dumps(tenants),
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.tenants_cli_app", "outbox", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def tables_in(url: str, schema: str = "public") -> set[str]:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        return {name for (name,) in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,))}


def test_migrate_status_and_check_per_tenant_on_a_database_a_schema_and_a_missing_database(
        postgres_url, table_prefix, tenants):
    """``migrate --all-tenants`` creates the tables of the default store, of acme's database and of
    globex's schema, and reports ghost's missing database in one line that hides its password,
    exit 1; ``status --tenant`` reads the tenant's own tables; ``check --all-tenants`` names ghost
    as the store down (exit 2); a name ``outbox_tenants`` does not know is a usage error (exit 2)."""
    def command(*args: str) -> subprocess.CompletedProcess:
        return run(*args, url=postgres_url, prefix=table_prefix, tenants=tenants)

    migrated = command("migrate", "--all-tenants")
    assert migrated.returncode == 1, migrated.stdout + migrated.stderr
    assert [line for line in migrated.stdout.splitlines() if line.startswith("==")] == [
        "== default store ==", "== tenant acme ==", "== tenant ghost ==", "== tenant globex =="]
    assert migrated.stderr.splitlines()[0].startswith(
        "Error: tenant ghost: cannot use the message store at postgresql+psycopg://postgres:***@"), migrated.stderr
    assert migrated.stderr.splitlines()[-1] == "Error: 1 of 4 stores failed: tenant ghost"
    assert "s3cret-pw" not in migrated.stdout + migrated.stderr and "Traceback" not in migrated.stderr
    wanted = {f"{table_prefix}outgoing", f"{table_prefix}incoming", f"{table_prefix}dead_letters"}
    assert wanted <= tables_in(postgres_url) and wanted <= tables_in(tenants["acme"])
    assert wanted <= tables_in(postgres_url, tenants["globex"]["schema"])

    acme = Store(build_engine(tenants["acme"]), table_prefix)
    acme.register_node("acme-worker:1", "acme-host", 7)
    status = command("status", "--tenant", "acme", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert (report["tenant"], [node["name"] for node in report["nodes"]]) == ("acme", ["acme-worker:1"])
    globex = json.loads(command("status", "--tenant", "globex", "--json").stdout)
    assert (globex["tenant"], globex["nodes"]) == ("globex", [])

    checked = command("check", "--all-tenants", "--json", "--node-stale-after", "1h")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    documents = [json.loads(line) for line in checked.stdout.splitlines()]
    assert [(each["tenant"], each["ok"], [f["condition"] for f in each["failures"]]) for each in documents] == [
        (None, True, []), ("acme", True, []), ("ghost", False, ["store"]), ("globex", True, [])]
    assert "s3cret-pw" not in checked.stdout + checked.stderr

    unknown = command("dead-letters", "list", "--tenant", "initech")
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr
    assert "Error: Invalid value for '--tenant': unknown tenant 'initech': outbox_tenants does not name it" \
        in unknown.stderr
    assert "Traceback" not in unknown.stderr
