"""Real traffic from a worker run on PostgreSQL and Redis, archived by cleanup, audits clean."""

from __future__ import annotations

import json
import os

from celery_outbox.audit.job import EXIT_CLEAN, main

from ..brokers import copy_options
from ..scenario import Scenario
from ..services import wait_until
from .conftest import JDBC_JAR


def test_a_worker_runs_traffic_is_archived_and_audits_clean(spark, postgres_url, redis_url, table_prefix, tmp_path):
    archive, out = tmp_path / "archive", tmp_path / "audit"
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, outbox_archive_path=str(archive),
                        outbox_keep_after_handling=1)
    try:
        shop, durable = scenario.shop, scenario.env["TEST_OTHER_QUEUE"]
        store = shop.outbox.store
        scenario.worker(queues=[durable], concurrency=2)
        ids = [f"e2e-{n}" for n in range(30)]
        with shop.outbox.transaction():
            for task_id in ids:
                shop.pay.apply_async((task_id,), **copy_options(task_id), queue=durable)
        # a duplicate (a copy of the same send), sent once the original ran: a copy sent while the
        # original's inbox claim commits may be acknowledged before it is published, and then it is
        # (rightly) never sent
        scenario.wait_events(ids[0], "postrun", 1)
        shop.pay.apply_async((ids[0],), **copy_options(ids[0]), queue=durable)
        scenario.wait_events(ids[0], "postrun", 2)
        for task_id in ids:
            wait_until(lambda task_id=task_id: (row := store.get_incoming(task_id)) and row.status == "handled",
                       timeout=60, message=f"{task_id} handled")
        wait_until(lambda: shop.outbox.cleanup() and store.count_incoming() == 0 and store.count_outgoing() == 0,
                   timeout=30, message="cleanup to archive every handled row")
        assert {p.name for p in archive.iterdir()} == {"incoming", "sent"}

        argv = ["--archive", str(archive), "--out", str(out), "--grace", "0", "--table-prefix", table_prefix]
        if os.path.exists(JDBC_JAR):
            argv += ["--jdbc-url", postgres_url, "--jdbc-jar", JDBC_JAR]
        assert main(argv, spark) == EXIT_CLEAN
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["sent"], summary["handled"], summary["lost"]) == (30, 30, 0)
        assert summary["duplicates_discarded"] == 1 and summary["dead_lettered"] == 0
        assert summary["latency_seconds"]["max"] >= 0
        report = (out / "report.html").read_text()
        assert report.count("<svg") == 2 and "no dead letters" in report, "an empty panel is one line"
    finally:
        scenario.close()
