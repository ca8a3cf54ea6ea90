"""Producer: N ``apply_async`` inside one committed unit of work vs N plain ``apply_async``.

Three ways to send the same N task messages, in one process, on the same broker:

* plain Celery: N ``apply_async`` calls, no unit of work;
* in-memory unit of work: ``with outbox.transaction():`` around the N calls, to a plain
  queue: captured, then published after the commit with one producer;
* durable: the same to a durable queue: one INSERT of the N rows in the transaction,
  then the publish and one UPDATE marking them sent.

Messages per second for N = 1, 10 and 100, on Redis and RabbitMQ; nobody consumes
(the queues are deleted afterwards).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from functools import partial
from typing import Any

from celery import Celery

from celery_outbox import Outbox

from .common import (
    POSTGRES_URL,
    RABBITMQ_URL,
    REDIS_URL,
    Options,
    Result,
    best_of,
    delete_queues,
    drop_store,
    rate,
    unique_prefix,
)

BATCHES = (1, 10, 100)


def build(broker_url: str) -> tuple[Celery, Outbox, Any, Any]:
    prefix = unique_prefix()
    app = Celery(f"bench_producer_{prefix}", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}plain", task_routes={"bench.durable": {"queue": f"{prefix}durable"}},
                    outbox_database_url=POSTGRES_URL, outbox_table_prefix=prefix,
                    outbox_durable_queues=[f"{prefix}durable"])
    outbox = Outbox(app)

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(name="bench.durable", shared=False)
    def durable(n: int) -> int:
        return n

    outbox.ready()
    return app, outbox, plain, durable


def send(task: Any, units: int, n: int, outbox: Outbox | None) -> None:
    """``units`` times N ``apply_async``: each N in one unit of work with ``outbox``, plain without."""
    for _ in range(units):
        with outbox.transaction() if outbox is not None else nullcontext():
            for i in range(n):
                task.apply_async((i,))


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    app, outbox, plain, durable = build(broker_url)
    repeats = options.size(5, 1)
    try:
        plain.apply_async((0,))  # connect, declare the queues
        with outbox.transaction():
            durable.apply_async((0,))
        results = []
        for n in BATCHES:
            units = max(20, options.size(3000, 200) // n)
            messages = units * n
            baseline = best_of(repeats, partial(rate, messages, partial(send, plain, units, n, None)))
            memory = best_of(repeats, partial(rate, messages, partial(send, plain, units, n, outbox)))
            stored = best_of(repeats, partial(rate, messages, partial(send, durable, units, n, outbox)))
            print(f"  producer {broker} N={n}: plain {baseline:.0f}/s, in-memory {memory:.0f}/s, "
                  f"durable {stored:.0f}/s", file=sys.stderr)
            results += [
                Result("producer", f"{broker}, N={n} in one unit of work, in-memory", "msg/s", memory, baseline),
                Result("producer", f"{broker}, N={n} in one unit of work, durable", "msg/s", stored, baseline,
                       target=(">=", 1.0) if n == 100 else None),
            ]
        return results
    finally:
        _tear_down(app, outbox)


def _tear_down(app: Celery, outbox: Outbox) -> None:
    delete_queues(app, list(app.amqp.queues))
    drop_store(outbox)


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
