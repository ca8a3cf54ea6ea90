"""``outbox audit --tenant NAME`` and ``--all-tenants``, the job replaced by a recorder: what each
store's audit is given (its folder of the archive and of ``--out``, its database and schema) and the
exit code of all of them. The real audit of a tenant, on Spark: tests/audit/test_audit_tenants.py."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_outbox import Outbox
from celery_outbox.cli import outbox as outbox_group

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")


@pytest.fixture
def box(tmp_path) -> Outbox:
    """Stores on SQLite files: the default, acme's, and initech's, placed in a schema."""
    app = Celery(f"cli_audit_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}", outbox_table_prefix="shop_",
                    outbox_archive_path=str(tmp_path / "archive"),
                    outbox_tenants={"acme": f"sqlite:///{tmp_path / 'acme.db'}",
                                    "initech": {"url": f"sqlite:///{tmp_path / 'initech.db'}", "schema": "initech"}})
    return Outbox(app)


@pytest.fixture
def audits(monkeypatch) -> list[dict[str, str]]:
    """The options each audit the command starts is given; acme's finds a message lost (exit 1)."""
    import celery_outbox.audit.job as job

    given: list[dict[str, str]] = []

    def recorder(argv: list[str], spark=None) -> int:
        options = dict(zip(argv[::2], argv[1::2], strict=True))
        given.append(options)
        return 1 if options["--out"].endswith("/acme") else 0

    monkeypatch.setattr(job, "main", recorder)
    return given


def run(box: Outbox, *args: str) -> Result:
    return CliRunner().invoke(outbox_group, ["audit", *args], obj=SimpleNamespace(app=box.app))


def test_a_tenants_audit_reads_its_archive_folder_and_its_store_and_writes_its_out_folder(box, audits, tmp_path):
    result = run(box, "--tenant", "initech", "--out", "/srv/audit", "--jdbc-url", "store")
    assert result.exit_code == 0, result.output
    (given,) = audits
    assert {key: given[key] for key in ("--archive", "--out", "--jdbc-url", "--schema", "--table-prefix")} == {
        "--archive": f"{tmp_path}/archive/tenants/initech", "--out": "/srv/audit/tenants/initech",
        "--jdbc-url": f"sqlite:///{tmp_path / 'initech.db'}", "--schema": "initech", "--table-prefix": "shop_"}


def test_all_tenants_audits_every_store_in_its_folders_and_exits_1_when_one_lost(box, audits, tmp_path):
    result = run(box, "--all-tenants", "--out", "/srv/audit", "--archive", "s3a://bucket/outbox", "--jdbc-url",
                 "store")
    assert result.exit_code == 1, result.output
    assert [(a["--archive"], a["--out"], a["--jdbc-url"], a.get("--schema")) for a in audits] == [
        ("s3a://bucket/outbox", "/srv/audit", f"sqlite:///{tmp_path / 'default.db'}", None),
        ("s3a://bucket/outbox/tenants/acme", "/srv/audit/tenants/acme", f"sqlite:///{tmp_path / 'acme.db'}", None),
        ("s3a://bucket/outbox/tenants/initech", "/srv/audit/tenants/initech",
         f"sqlite:///{tmp_path / 'initech.db'}", "initech")]
    assert [line for line in result.stdout.splitlines() if line.startswith("==")] == [
        "== default store ==", "== tenant acme ==", "== tenant initech =="]
    assert "Error: 1 of 3 stores failed: tenant acme" in result.stderr


def test_one_database_url_for_every_tenant_and_an_unknown_tenant_are_usage_errors(box, audits):
    result = run(box, "--all-tenants", "--out", "/srv/audit", "--jdbc-url", "postgresql://db/shop")
    assert result.exit_code == 2 and "give --jdbc-url store with --all-tenants" in result.output
    result = run(box, "--tenant", "umbrella", "--out", "/srv/audit")
    assert result.exit_code == 2 and "unknown tenant 'umbrella'" in result.output
    assert audits == []
