"""A Celery app for the countdown, ETA and task-sent tests, with or without an Outbox.

The worker builds it from the environment (TEST_BROKER_URL, TEST_BACKEND_URL, TEST_DATABASE_URL,
TEST_TABLE_PREFIX, TEST_QUEUE, TEST_DURABLE_QUEUE, TEST_IDLE_QUEUE, TEST_OUTBOX: "1" installs
the Outbox, "0" leaves plain Celery); a test builds the same app in its own process with
``create(...)``. Without the Outbox the durable queues are ordinary queues: the same scenario
runs on plain Celery. Each task returns what it saw (its ``request.eta``, when it started) to
the Redis result backend.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from celery import Celery

#: the outbox's timing in these tests: a recover interval of 1 s, scheduled messages released 3 s
#: ahead of their eta, unacknowledged ones redelivered after 1 s
OUTBOX_CONF = {"outbox_recover_interval": 1, "outbox_release_ahead": 3, "outbox_redeliver_after": 1,
               "outbox_node_heartbeat_interval": 0.5}


def create(broker_url: str, backend_url: str, database_url: str, prefix: str, queue: str, durable_queue: str,
           idle_queue: str, with_outbox: bool) -> SimpleNamespace:
    """``idle_queue`` is durable too, and no worker consumes it: its messages are redelivered."""
    app = Celery("schedule_app", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=False,
        result_expires=600,
    )
    outbox = None
    if with_outbox:
        from celery_outbox import Outbox

        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=prefix,
                        outbox_durable_queues=[durable_queue, idle_queue], **OUTBOX_CONF)
        outbox = Outbox(app)

    @app.task(bind=True, name="schedule.when", shared=False)
    def when(self, label: str) -> dict:
        return {"label": label, "eta": self.request.eta, "started": time.time()}

    @app.task(name="schedule.join", shared=False)
    def join(results: list) -> dict:
        return {"labels": sorted(r["label"] for r in results), "started": time.time()}

    return SimpleNamespace(app=app, outbox=outbox, when=when, join=join, queue=queue, durable_queue=durable_queue,
                           idle_queue=idle_queue)


if "TEST_BROKER_URL" in os.environ:
    world = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_BACKEND_URL"], os.environ["TEST_DATABASE_URL"],
                   os.environ["TEST_TABLE_PREFIX"], os.environ["TEST_QUEUE"], os.environ["TEST_DURABLE_QUEUE"],
                   os.environ["TEST_IDLE_QUEUE"], os.environ["TEST_OUTBOX"] == "1")
    app = world.app
