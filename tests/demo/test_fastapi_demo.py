"""The FastAPI shop's demo (``python -m example_project.fastapi_demo``) in its short mode, run as a
user runs it on PostgreSQL, with RabbitMQ, its async units of work on asyncpg (psycopg's async mode
and Redis run in tests/faults/test_async_producer.py's drills; on SQLite with the server-less broker
it runs as the README gives it, ``tox -e fastapi-demo``, in CI before the test suite). uvicorn serves
the shop's async API in a process of its own; eight clients place orders at once, each written with
an ``AsyncSession`` inside ``outbox.atransaction()``; a worker is SIGKILLed and duplicates are
sent; the summary is asserted."""

from __future__ import annotations

import pytest

from ..services import require
from .test_demo import assert_every_receipt_sent_but_the_killed_workers, assert_settled_exactly_once, run_demo

MODULE = "example_project.fastapi_demo"


@pytest.mark.parametrize(("broker", "driver"), [("rabbitmq", "asyncpg")])
def test_the_fastapi_demo_on_postgresql(tmp_path, broker, driver, own_database, monkeypatch):
    if driver == "asyncpg":  # the shop's settings read it (outbox_async_database_url); the store stays on psycopg
        monkeypatch.setenv("SHOP_ASYNC_DATABASE_URL", own_database.replace("postgresql+psycopg", "postgresql+asyncpg"))
    else:
        monkeypatch.delenv("SHOP_ASYNC_DATABASE_URL", raising=False)
    summary = run_demo(tmp_path, "--database-url", own_database, "--broker-url", require(broker), "--no-audit",
                       module=MODULE)
    assert_settled_exactly_once(summary)
    assert_every_receipt_sent_but_the_killed_workers(summary)
    server_log = (tmp_path / "demo" / "uvicorn.log").read_text()
    assert "Uvicorn running on" in server_log and "Traceback" not in server_log, server_log[-3000:]
