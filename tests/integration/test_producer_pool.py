"""Senders never wait on the app's producer pool: many threads sending to a durable queue outside a
unit of work finish, with the default ``broker_pool_limit`` and more threads than it allows, and
with a pool of one; side by side with plain Celery (PostgreSQL store, Redis broker)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from celery import Celery

from celery_outbox import Outbox

from ..brokers import purge, receive
from ..conftest import drop_store, unsent_rows
from ..services import require

DEADLINE = 60.0  # seconds for every sender together; a blocked sender never finishes
MESSAGES_PER_THREAD = 5


def _app(with_outbox: bool, database_url: str, table_prefix: str, **conf) -> tuple[Celery, Outbox | None, str]:
    queue = f"pool_{uuid.uuid4().hex[:8]}"
    app = Celery(f"pool_{queue}", broker=require("redis"), set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=False, **conf)
    outbox = None
    if with_outbox:
        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=table_prefix,
                        outbox_durable_queues=[queue])
        outbox = Outbox(app)
        outbox.ready()
    return app, outbox, queue


@pytest.mark.parametrize("with_outbox", [False, True], ids=["plain", "outbox"])
@pytest.mark.parametrize(("threads", "pool_limit"), [(50, None), (1, 1)], ids=["50-threads-default-pool", "pool-of-1"])
def test_threads_sending_to_a_durable_queue_never_block(with_outbox, threads, pool_limit, table_prefix):
    database_url = require("postgres")
    conf = {} if pool_limit is None else {"broker_pool_limit": pool_limit}
    app, outbox, queue = _app(with_outbox, database_url, table_prefix, **conf)
    if pool_limit is None:
        assert threads > app.conf.broker_pool_limit, "more senders than the default pool holds"

    @app.task(name="pool.send", shared=False)
    def send(x):
        return x

    sent: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def sender(n: int) -> None:
        try:
            for i in range(MESSAGES_PER_THREAD):
                result = send.delay(n * MESSAGES_PER_THREAD + i)
                with lock:
                    sent.append(result.id)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=sender, args=(n,), daemon=True) for n in range(threads)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + DEADLINE
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0))
    blocked = sum(worker.is_alive() for worker in workers)
    assert blocked == 0, f"{blocked} of {threads} senders still blocked after {DEADLINE} s"
    assert errors == []
    expected = threads * MESSAGES_PER_THREAD
    assert sorted(m.id for m in receive(app, queue, expected, timeout=30)) == sorted(sent)
    if outbox is not None:
        assert unsent_rows(outbox.store) == 0, "every stored message was published"
        drop_store(outbox.store)
        outbox.engine.dispose()
    purge(app, queue)
