"""The Django shop's demo (``python -m example_project.django_demo``) in its short mode, run as a
user runs it on PostgreSQL with Redis and with RabbitMQ (on SQLite with the server-less broker it
runs as the README gives it, ``tox -e django-demo``, in CI before the test suite). Its views place
orders under ``ATOMIC_REQUESTS``, its ``IdempotentTask`` charges them with the ORM; a worker is
SIGKILLed and duplicates are sent; the summary is asserted."""

from __future__ import annotations

import subprocess
import sys

import django
import pytest
from sqlalchemy import create_engine, text

from ..services import require
from .test_demo import ROOT, assert_every_receipt_sent_but_the_killed_workers, assert_settled_exactly_once, run_demo

MODULE = "example_project.django_demo"


def test_the_django_demo_refuses_sqlite_before_django_5_1(monkeypatch):
    from example_project.django_demo import DjangoShop

    monkeypatch.delenv("SHOP_DATABASE_URL", raising=False)
    monkeypatch.setattr(django, "VERSION", (4, 2, 0, "final", 0))
    reason = DjangoShop().refusal()
    assert reason and "needs Django 5.1 or later" in reason and "--database-url" in reason, reason
    monkeypatch.setenv("SHOP_DATABASE_URL", "postgresql+psycopg://shop@db/shop")
    assert DjangoShop().refusal() is None, "on PostgreSQL the settings give no SQLite option"
    monkeypatch.delenv("SHOP_DATABASE_URL")
    monkeypatch.setattr(django, "VERSION", (5, 1, 0, "final", 0))
    assert DjangoShop().refusal() is None


@pytest.mark.skipif(django.VERSION >= (5, 1), reason="Django 5.1 or later here: the demo runs on SQLite "
                                                     "(tox -e django-demo, in .ci/run)")
def test_before_django_5_1_the_django_demo_on_sqlite_exits_with_the_reason(tmp_path):
    """Django before 5.1 refuses the SQLite options of the shop's settings when it connects: the demo
    says so before it starts anything, with exit code 2."""
    process = subprocess.run([sys.executable, "-m", MODULE, "--short", "--json", "--data-dir", str(tmp_path / "demo")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stderr[-3000:]
    assert process.stderr.startswith("demo: refused: the shop's SQLite database needs Django 5.1 or later"), \
        process.stderr[-3000:]
    assert not process.stdout


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_django_demo_on_postgresql(tmp_path, broker, own_database):
    summary = run_demo(tmp_path, "--database-url", own_database, "--broker-url", require(broker), "--no-audit",
                       module=MODULE)
    assert_settled_exactly_once(summary)
    assert_every_receipt_sent_but_the_killed_workers(summary)
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
