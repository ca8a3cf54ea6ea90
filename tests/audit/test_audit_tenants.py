"""``outbox audit --tenant NAME`` on real PostgreSQL: a tenant placed in a schema of the default
store's database, whose archive is written by the outbox's own archiver into its folder of
``outbox_archive_path``, is audited from that folder and from its live tables (its schema), and
nothing of the default store's archive counts. The command's wiring per store, without Spark:
tests/unit/test_cli_audit_tenants.py."""

from __future__ import annotations

import json
import os
import uuid
from datetime import timedelta
from types import SimpleNamespace

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner

from celery_outbox import Outbox, using_tenant
from celery_outbox.cli import outbox as outbox_group
from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import Store, build_engine
from celery_outbox.vocabulary import DeadLetterReason

from ..conftest import drop_store
from ..services import services_required
from .conftest import JDBC_JAR, NOW, T0, incoming, sent
from .test_audit_live_tables import outgoing


@pytest.fixture
def tenant_box(postgres_url, table_prefix, tmp_path):
    """An outbox archiving to ``tmp_path/archive``, its tenant ``initech`` in a schema of the test
    database; the schema and the default store's tables are dropped afterwards."""
    if not os.path.exists(JDBC_JAR):
        reason = f"no PostgreSQL JDBC driver at {JDBC_JAR} (apt install libpostgresql-jdbc-java)"
        pytest.fail(reason) if services_required() else pytest.skip(reason)
    schema = f"audit_initech_{uuid.uuid4().hex[:8]}"
    app = Celery(f"audit_tenants_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=postgres_url, outbox_table_prefix=table_prefix,
                    outbox_archive_path=str(tmp_path / "archive"),
                    outbox_tenants={"initech": {"url": postgres_url, "schema": schema}})
    box = Outbox(app)
    try:
        yield box
    finally:
        for tenant in (None, "initech"):
            with using_tenant(tenant):
                box.runtime.store.engine.dispose()
        drop_store(Store(build_engine(postgres_url), table_prefix))
        with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_tenant_is_audited_from_its_archive_folder_and_its_schemas_live_tables(tenant_box, spark, table_prefix,
                                                                                  tmp_path):
    """initech: m0-m3 sent, m0-m2 handled (archived), m3's dead letter and an unsent row still live.
    The default store's archive holds a lost message, d8, which initech's audit must not see."""
    box = tenant_box
    box.runtime.archiver.archive("sent", [SimpleNamespace(**{**vars(sent(8, T0)), "message_id": "d8"})])
    with using_tenant("initech"):
        box.runtime.archiver.archive("sent", [sent(n, T0 + timedelta(minutes=n)) for n in range(4)])
        box.runtime.archiver.archive("incoming", [incoming(n, "handled", T0 + timedelta(minutes=n, seconds=1))
                                                  for n in range(3)])
        box.migrate()
        store = box.store
        with store.begin() as conn:
            store.insert_dead_letters(conn, [dead_letter_row(
                reason=DeadLetterReason.FAILED, failed_at=T0 + timedelta(hours=1), message_id="m3",
                task_name="shop.ship", queue="payments", error=KeyError("card"))])
            store.insert_outgoing(conn, [outgoing("unsent", T0 + timedelta(hours=1))])

    out = tmp_path / "audit"
    result = CliRunner().invoke(outbox_group, [
        "audit", "--tenant", "initech", "--out", str(out), "--jdbc-url", "store", "--jdbc-jar", JDBC_JAR,
        "--master", "local[1]", "--now", NOW.strftime("%Y-%m-%dT%H:%M:%S%z")], obj=SimpleNamespace(app=box.app))

    assert result.exit_code == 0, result.output
    assert not (out / "summary.json").exists(), "a tenant's outputs are in its folder of --out"
    summary = json.loads((out / "tenants" / "initech" / "summary.json").read_text())
    assert {key: summary[key] for key in ("sent", "handled", "lost", "dead_lettered", "stuck")} == {
        "sent": 4, "handled": 3, "lost": 0, "dead_lettered": 1, "stuck": 1}
    schema = store.schema
    assert summary["inputs"]["archive"]["path"] == str(tmp_path / "archive" / "tenants" / "initech")
    assert summary["inputs"]["live"]["rows"] == {f"{schema}.{table_prefix}sent": 0,
                                                 f"{schema}.{table_prefix}outgoing": 1,
                                                 f"{schema}.{table_prefix}dead_letters": 1,
                                                 f"{schema}.{table_prefix}incoming": 0}
