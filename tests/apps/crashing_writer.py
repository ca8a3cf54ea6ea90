"""A writer process for crash drills: commits one durable message and prints its id.

Run with CELERY_OUTBOX_CRASHPOINT set, it dies at that point (os._exit)."""

from __future__ import annotations

import sys

from celery import Celery

from celery_outbox import Outbox


def main(broker_url: str, database_url: str, table_prefix: str, durable_queue: str, tracking: str = "on",
         unit: str = "session") -> None:
    """``tracking`` "off": delivery tracking off (``outbox_redeliver_after = None``), "default":
    on with the default redelivery (ten minutes), else on, redelivery after one second; ``unit``
    "connection": the unit of work is ``outbox.begin()``, else ``outbox.transaction()``."""
    app = Celery("crashing_writer", broker=broker_url, set_as_current=False)
    app.conf.update(
        outbox_database_url=database_url,
        outbox_table_prefix=table_prefix,
        outbox_durable_queues=[durable_queue],
        task_routes={"shop.durable": {"queue": durable_queue}},
    )
    if tracking != "default":
        app.conf.outbox_redeliver_after = None if tracking == "off" else 1.0
    outbox = Outbox(app)
    outbox.ready()
    task_id = "crash-" + __import__("uuid").uuid4().hex
    print(task_id, flush=True)
    with outbox.begin() if unit == "connection" else outbox.transaction():
        app.send_task("shop.durable", args=["written before the crash"], task_id=task_id)
    sys.exit(0)  # not reached when the crash point fires
