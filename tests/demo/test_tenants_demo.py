"""The tenants demo (``python -m example_project.tenants_demo``) run as a user runs it: on its
embedded defaults (each tenant an SQLite file, the default store another, a filesystem broker) and
on PostgreSQL (each tenant a schema of a database of its own). Orders are placed for three tenants
in ``outbox.transaction(tenant=...)``, a real worker charges them, duplicates are sent; its summary
is asserted: each tenant's orders paid exactly once in its own database, nothing in another's or in
the default store, nothing pending."""

from __future__ import annotations

import json
import subprocess
import sys

from .test_demo import ROOT

TENANTS = ("acme", "globex", "initech")


def run_tenants_demo(tmp_path, *extra: str) -> dict:
    process = subprocess.run(
        [sys.executable, "-m", "example_project.tenants_demo", "--orders", "10", "--json",
         "--data-dir", str(tmp_path / "demo"), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert process.stdout.strip(), f"no summary; stderr: {process.stderr[-3000:]}"
    summary = json.loads(process.stdout)
    assert process.returncode == (0 if summary["ok"] else 1)
    return summary


def assert_each_tenant_paid_in_its_own_store(summary: dict) -> None:
    assert summary["ok"], json.dumps(summary)
    stores = summary["stores"]
    assert list(stores) == ["default", *TENANTS]
    assert len({store["database"] for store in stores.values()}) == 4, "four places, one per store"
    for name in TENANTS:
        store = stores[name]
        assert store["orders_placed"] == store["orders_paid_exactly_once"] == store["payments_made"] == 10, name
        assert store["receipts_sent"] == 10 and store["orders_charged_twice"] == 0, name
        assert store["duplicates_sent"] == store["duplicates_discarded"] == 3, name
    default = stores["default"]
    assert default["orders_placed"] == default["payments_made"] == default["receipts_sent"] == 0
    assert default["duplicates_discarded"] == 0
    for name, store in stores.items():
        assert store["others_orders"] == store["others_payments"] == store["others_inbox_rows"] == 0, name
        assert store["rows_pending"] == store["dead_letters"] == 0, name
        assert store["ok"], name


def test_the_tenants_demo_on_sqlite(tmp_path):
    summary = run_tenants_demo(tmp_path)
    assert_each_tenant_paid_in_its_own_store(summary)
    for name in TENANTS:
        assert summary["stores"][name]["database"].endswith(f"/tenant-{name}.sqlite3")
    assert (tmp_path / "demo" / "tenant-acme.sqlite3").exists()
    log = (tmp_path / "demo" / "tenants.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_the_tenants_demo_on_postgresql(tmp_path, own_database):
    summary = run_tenants_demo(tmp_path, "--database-url", own_database)
    assert_each_tenant_paid_in_its_own_store(summary)
    for name in TENANTS:
        assert summary["stores"][name]["database"].endswith(f", schema tenant_{name}")
