"""A worker app whose tasks publish from their bodies, for the producer-pool tests: each task
first retries itself once, then sends two messages to another durable queue. With an Outbox
it is an IdempotentTask (the sends leave after the inbox commits, the retry after the
rollback); without one, plain Celery, the same body.

Built from the environment (TEST_BROKER_URL, TEST_DATABASE_URL, TEST_TABLE_PREFIX, TEST_QUEUE,
TEST_OTHER_QUEUE, TEST_WITH_OUTBOX=1 or 0, TEST_POOL_LIMIT) by the worker; a test builds the
same app with ``create(...)``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from celery import Celery

from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str, other_queue: str, with_outbox: bool,
           pool_limit: int) -> SimpleNamespace:
    app = Celery("pool_worker_app", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_pool_limit=pool_limit, worker_prefetch_multiplier=1,
                    worker_hijack_root_logger=False, broker_connection_retry_on_startup=False)
    outbox = None
    if with_outbox:
        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=prefix,
                        outbox_durable_queues=[queue, other_queue], outbox_node_heartbeat_interval=0.5)
        outbox = Outbox(app)

    @app.task(name="poolw.echo", shared=False)
    def echo(n: int, i: int) -> None:
        return None

    options = {"base": IdempotentTask} if with_outbox else {}

    @app.task(bind=True, name="poolw.fan_out", shared=False, max_retries=1, **options)
    def fan_out(self, n: int) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        for i in range(2):
            echo.apply_async((n, i), queue=other_queue)
        return n

    return SimpleNamespace(app=app, outbox=outbox, fan_out=fan_out)


if "TEST_QUEUE" in os.environ:
    _env = os.environ
    _built = create(_env["TEST_BROKER_URL"], _env["TEST_DATABASE_URL"], _env["TEST_TABLE_PREFIX"], _env["TEST_QUEUE"],
                    _env["TEST_OTHER_QUEUE"], _env["TEST_WITH_OUTBOX"] == "1", int(_env["TEST_POOL_LIMIT"]))
    app = _built.app
    outbox = _built.outbox
