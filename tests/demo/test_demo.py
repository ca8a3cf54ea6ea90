"""The example shop's demo, in its short mode, run as a user runs it on PostgreSQL with Redis and
with RabbitMQ; its summary is asserted. On its embedded defaults it runs as the README gives it,
``tox -e demo`` (long mode, with the delivery audit), in CI before the test suite (``.ci/run``):
its exit code says whether every invariant held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..services import require

ROOT = Path(__file__).parents[2]


def run_demo(tmp_path, *extra: str, module: str = "example_project.demo") -> dict:
    """Run a demo in its short mode as a user runs it (``python -m <module>``); its JSON summary."""
    process = subprocess.run(
        [sys.executable, "-m", module, "--short", "--json", "--data-dir", str(tmp_path / "demo"), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert process.stdout.strip(), f"no summary; stderr: {process.stderr[-3000:]}"
    summary = json.loads(process.stdout)
    assert process.returncode == (0 if summary["ok"] else 1)
    return summary


def assert_settled_exactly_once(summary: dict) -> None:
    assert summary["ok"], json.dumps(summary)
    assert summary["orders_placed"] == 60
    # a payment later than its order's 20 s cancellation (a busy host) charges nothing: the shop's rule
    late = summary["payments_after_cancellation"]
    assert summary["payments_made"] + late == summary["orders_to_pay"] == summary["orders_paid_exactly_once"] + late
    assert summary["orders_charged_twice"] == 0
    assert summary["unpaid_orders_cancelled"] == summary["unpaid_orders"] > 0
    assert summary["paid_orders_cancelled"] == 0
    # each duplicate is discarded, except one whose original died unacked with the killed worker:
    # it runs in the original's place (and the original, if the broker ever gives it back, is discarded)
    assert summary["duplicates_sent"] > 0 and summary["duplicates_discarded"] > 0
    assert summary["killed_after_orders"] == 30
    assert summary["rows_pending"] == 0 and summary["dead_letters"] == 0


PAYMENT_WORKER_CONCURRENCY = 2  # the demos' payments worker (example_project/demo.py), SIGKILLed halfway


def assert_every_receipt_sent_but_the_killed_workers(summary: dict) -> None:
    """A receipt goes to a plain queue: published after its payment's commit, not stored. A
    payment that committed in the instant before the SIGKILL loses its receipt with the worker
    (its redelivered copy is discarded: the payment is done), as with ``delay_on_commit``. Only
    the payments running at the kill can; every other payment has its receipt."""
    lost = summary["payments_made"] - summary["receipts_sent"]
    assert 0 <= lost <= PAYMENT_WORKER_CONCURRENCY, json.dumps(summary)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_demo_on_postgresql(tmp_path, broker):
    summary = run_demo(tmp_path, "--database-url", require("postgres"), "--broker-url", require(broker), "--no-audit",
                       "--reset")
    assert_settled_exactly_once(summary)
    assert_every_receipt_sent_but_the_killed_workers(summary)


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "example_project.demo", "--short", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_demo_refuses_a_data_folder_it_did_not_make(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    result = demo("--data-dir", str(mine))
    assert result.returncode == 2, result.stderr
    assert f"{mine} holds files the demo did not make" in result.stderr and "--reset" in result.stderr
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_the_demo_refuses_a_database_whose_tables_hold_rows(tmp_path, own_database):
    from sqlalchemy import create_engine, text

    from celery_outbox.store import Store, build_engine

    store = Store(build_engine(own_database))
    store.migrate()
    store.register_node("someone else's worker", "h", 1)
    result = demo("--data-dir", str(tmp_path / "demo"), "--database-url", own_database, "--broker-url",
                  require("redis"), "--no-audit")
    assert result.returncode == 2, result.stderr
    assert f"already holds rows in {store.tables.nodes.name}" in result.stderr and "--reset" in result.stderr
    with create_engine(own_database).connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {store.tables.nodes.name}")).scalar() == 1
    store.engine.dispose()
