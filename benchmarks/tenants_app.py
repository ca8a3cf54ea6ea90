"""The app the tenants benchmark's worker runs: a durable queue, the default store and tenants.

Built from BENCH_BROKER_URL, BENCH_DATABASE_URL (the default store), BENCH_TABLE_PREFIX,
BENCH_QUEUE and BENCH_TENANTS (JSON: tenant names to database URLs); the benchmark builds the
same app in its own process with ``create``. Its one task, ``bench.tenant_apply``, is an
``IdempotentTask`` with an empty body: what a message costs is its claim, in its tenant's store.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str,
           tenants: dict[str, str]) -> tuple[Celery, Outbox, Any]:
    app = Celery("bench_tenants_worker", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, outbox_database_url=database_url, outbox_table_prefix=prefix,
                    outbox_durable_queues=[queue], outbox_tenants=tenants, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)
    outbox = Outbox(app)

    @app.task(base=IdempotentTask, bind=True, name="bench.tenant_apply", shared=False)
    def apply(self: Any, n: int) -> int:
        return n

    return app, outbox, apply


if "BENCH_TENANTS" in os.environ:
    app, outbox, _ = create(os.environ["BENCH_BROKER_URL"], os.environ["BENCH_DATABASE_URL"],
                            os.environ["BENCH_TABLE_PREFIX"], os.environ["BENCH_QUEUE"],
                            json.loads(os.environ["BENCH_TENANTS"]))
