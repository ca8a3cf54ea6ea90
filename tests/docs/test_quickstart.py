"""README's Quickstart, run as written from its Markdown on the services it names (PostgreSQL and
Redis on their default local ports): its role and database, its files, its commands, a worker
and beat; a payment is made once and a copy of its message is discarded."""

from __future__ import annotations

import json

import pytest

from ..services import wait_until
from .quickstart import commands, make_shop

pytestmark = [pytest.mark.worker, pytest.mark.postgres, pytest.mark.redis]


def test_the_quickstart_runs_as_written_and_discards_a_copy(shell, clean_services):
    worker_command, beat_command = make_shop(shell.run, shell.cwd)
    copy = commands()[-1]
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

    wait_until(discarded, timeout=30, interval=0.5, message="the copy to be discarded")
    report = json.loads(shell.run(f"{status} --json"))
    handled = [row["count"] for row in report["incoming"] if row["status"] == "handled" and row["queue"] == "payments"]
    assert handled == [2], report["incoming"]
    log = worker.read_text()
    assert log.count("receipt for order 1") == 1 and log.count("receipt for order 2") == 1, log
    payments = shell.run("psql -h localhost -U shop shop -At -c 'SELECT order_id, amount FROM payments ORDER BY 1'")
    assert payments.split() == ["1|12.50", "2|7.00"]

