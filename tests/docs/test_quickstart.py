"""README's Quickstart, run as written from its Markdown on the services it names (PostgreSQL and
Redis on their default local ports): its role and database, its files, its commands, a worker
and beat; a payment is made once and a copy of its message is discarded."""

from __future__ import annotations

import pytest
import redis

from ..markdown import blocks, titled
from ..markdown import shell as shell_blocks
from ..services import require, wait_until

pytestmark = [pytest.mark.worker, pytest.mark.postgres, pytest.mark.redis]

QUICKSTART = blocks("README.md", "Quickstart")
QUEUES = ("payments", "receipts", "celery")  # the worker's -Q


@pytest.fixture
def clean_services():
    """No role or database ``shop`` before or after, and no message in the Quickstart's queues."""
    import psycopg

    admin = require("postgres").replace("postgresql+psycopg", "postgresql")
    require("redis")

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS shop WITH (FORCE)")
            conn.execute("DROP ROLE IF EXISTS shop")
        broker = redis.Redis.from_url("redis://localhost:6379/0")
        broker.delete(*QUEUES, "unacked", "unacked_index")

    drop()
    yield
    drop()


def test_the_quickstart_runs_as_written_and_discards_a_copy(shell, clean_services):
    create, tables, processes, copy = (block.commands() for block in shell_blocks(QUICKSTART))
    for name in ("shop.py", "pay.py", "twice.py"):
        (shell.cwd / name).write_text(titled(QUICKSTART, name).code)
    for command in create + tables:
        shell.run(command)
    worker_command, beat_command = processes
    worker = shell.start(worker_command, "worker.log")
    shell.start(beat_command, "beat.log")
    wait_until(lambda: " ready." in worker.read_text(), timeout=60, message="the Quickstart's worker to be ready")

    shell.run("python pay.py")
    wait_until(lambda: "receipt for order 1" in worker.read_text(), timeout=30, message="order 1's receipt")

    send_twice, status = copy
    assert send_twice == "python twice.py" and status == "celery -A shop outbox status"
    shell.run(send_twice)

    def discarded() -> str | None:
        out = shell.run(status)
        return out if "duplicates discarded: 1" in out else None

    report = wait_until(discarded, timeout=30, interval=0.5, message="the copy to be discarded")
    assert _handled(report) == 2, report
    log = worker.read_text()
    assert log.count("receipt for order 1") == 1 and log.count("receipt for order 2") == 1, log
    payments = shell.run("psql -h localhost -U shop shop -At -c 'SELECT order_id, amount FROM payments ORDER BY 1'")
    assert payments.split() == ["1|12.50", "2|7.00"]


def _handled(report: str) -> int:
    """The count of the ``handled payments`` row of ``outbox status``'s inbox table."""
    for line in report.splitlines():
        words = line.split()
        if words[:2] == ["handled", "payments"]:
            return int(words[2])
    return 0
