"""A Celery app whose callers read results, for tests/integration/test_dead_letter_results.py.

Plain Celery, or (with TEST_DATABASE_URL and TEST_TABLE_PREFIX) the same app with an ``Outbox``
and one durable queue, so one scenario runs both ways. The worker builds it from the environment
(TEST_BROKER_URL, TEST_RESULT_BACKEND, TEST_QUEUE, TEST_DURABLE_QUEUE); a test builds the same app
in its own process with ``create(...)`` to send tasks and read results. Its worker sends task
events (``-E``), so a test can see the ``task-failed`` event. The worker records each
``task_unknown`` signal in the result backend's Redis (key ``unknown-signal:<task id>``, the task
name), so a test can see the signal was sent; its errback ``results.record_error`` records the
failed task's id there too (key ``errback:<task id>``).
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from celery import Celery, signals
from sqlalchemy import update

from celery_outbox import IdempotentTask, Outbox
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import IncomingStatus


def create(broker_url: str, result_backend: str, queue: str, durable_queue: str, database_url: str | None = None,
           prefix: str | None = None, **conf) -> SimpleNamespace:
    app = Celery("results_app", broker=broker_url, backend=result_backend, set_as_current=False)
    app.conf.update(task_default_queue=queue, worker_prefetch_multiplier=1, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=False, worker_send_task_events=True, **conf)
    outbox = None
    if database_url is not None:
        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=prefix,
                        outbox_durable_queues=[durable_queue], outbox_node_heartbeat_interval=0.5)
        outbox = Outbox(app)

    @app.task(name="results.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="results.lose_worker", shared=False)
    def lose_worker() -> None:
        """Kills its own pool process: the worker running it is lost."""
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(name="results.record_error", shared=False)
    def record_error(task_id: str) -> None:
        """An errback of the older kind (Celery sends it as a task, with the failed task's id):
        records that it ran, in the result backend's Redis."""
        app.backend.client.set(errback_key(task_id), "ran", ex=600)

    @app.task(name="results.total", shared=False)
    def total(values: list[int]) -> int:
        """A chord's body."""
        return sum(values)

    lost_after_a_copy = None
    if outbox is not None:
        @app.task(base=IdempotentTask, bind=True, name="results.lost_after_a_copy", shared=False, max_retries=0)
        def lost_after_a_copy(self) -> None:
            """Plays a copy of its own message handled elsewhere (its inbox row handled, its
            result not stored yet), then kills its own pool process past the re-send cap."""
            incoming = outbox.store.tables.incoming
            with outbox.store.begin() as conn:
                conn.execute(update(incoming).where(incoming.c.message_id == self.request.id)
                             .values(status=IncomingStatus.HANDLED.value, owner=0, handled_at=utcnow()))
            os.kill(os.getpid(), signal.SIGKILL)

        lost_after_a_copy.idempotency = "eager"  # its claim commits before the body, for the body to update

    return SimpleNamespace(app=app, outbox=outbox, add=add, lose_worker=lose_worker, record_error=record_error,
                           total=total, lost_after_a_copy=lost_after_a_copy)


def unknown_signal_key(task_id: str) -> str:
    return f"unknown-signal:{task_id}"


def errback_key(task_id: str) -> str:
    return f"errback:{task_id}"


if "TEST_BROKER_URL" in os.environ:
    shop = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_RESULT_BACKEND"], os.environ["TEST_QUEUE"],
                  os.environ["TEST_DURABLE_QUEUE"], os.environ.get("TEST_DATABASE_URL"),
                  os.environ.get("TEST_TABLE_PREFIX"))
    app = shop.app

    @signals.task_unknown.connect(weak=False)
    def record_unknown(sender=None, name=None, id=None, **_):
        app.backend.client.set(unknown_signal_key(id), name, ex=600)
