"""The Django shop's demo (``python -m example_project.django_demo``) in its short mode, run as a
user runs it: on SQLite with the server-less broker, and on PostgreSQL with Redis and with
RabbitMQ. Its views place orders under ``ATOMIC_REQUESTS``, its ``IdempotentTask`` charges them
with the ORM; a worker is SIGKILLed and duplicates are sent; the summary is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text

from ..services import require
from .test_demo import ROOT, assert_every_receipt_sent_but_the_killed_workers, assert_settled_exactly_once, run_demo

MODULE = "example_project.django_demo"


def test_the_django_demo_on_embedded_defaults(tmp_path):
    summary = run_demo(tmp_path, "--no-audit", module=MODULE)
    assert_settled_exactly_once(summary)
    assert_every_receipt_sent_but_the_killed_workers(summary)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_django_demo_on_postgresql(tmp_path, broker, own_database):
    summary = run_demo(tmp_path, "--database-url", own_database, "--broker-url", require(broker), "--no-audit",
                       module=MODULE)
    assert_settled_exactly_once(summary)
    assert_every_receipt_sent_but_the_killed_workers(summary)

    # run again on the same database: its tables hold this run's rows, so the demo refuses to empty them
    again = subprocess.run([sys.executable, "-m", MODULE, "--short", "--json", "--no-audit", "--data-dir",
                            str(tmp_path / "again"), "--database-url", own_database, "--broker-url", require(broker)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert "already holds rows in orders_receipt, orders_payment, orders_order" in again.stderr, again.stderr
    engine = create_engine(own_database)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM orders_order")).scalar() == summary["orders_placed"]
    engine.dispose()
