"""Django: N messages sent inside ``transaction.atomic()``, celery-outbox vs ``delay_on_commit``.

Both write one row of the user's data with the ORM and send N task messages in one atomic
block, on the same PostgreSQL and Redis:

* plain Celery: ``delay_on_commit`` for each message: published by ``on_commit`` after the
  commit, lost if the broker does not answer then;
* celery-outbox (``celery_outbox.django``): ``delay`` to a durable queue: the N rows written
  through Django's connection in one INSERT sent with the block's COMMIT, published after it.

Messages per second for N = 1, 10 and 100; nobody consumes (the queues are deleted afterwards).
Django is configured in this process on the ``postgres`` database of the benchmark's server,
so that the other benchmarks' outboxes (on their own database) do not join its transactions.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

from celery import Celery

from celery_outbox import Outbox

from . import django_settings
from .common import REDIS_URL, Options, Result, delete_queues, drop_store, in_rounds, rate, unique_prefix

BATCHES = (1, 10, 100)
ROUNDS = 5
MESSAGES = {1: 2000, 10: 3000, 100: 3000}


def configure_django() -> None:
    """Django settings for this process (``benchmarks.django_settings``): one PostgreSQL database,
    the outbox's app."""
    django_settings.configure()


def build(prefix: str) -> tuple[Celery, Outbox, Any, Any, Any]:
    from celery.contrib.django.task import DjangoTask

    app = Celery(f"bench_django_{prefix}", broker=REDIS_URL, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}plain", task_routes={"bench.durable": {"queue": f"{prefix}durable"}},
                    outbox_table_prefix=prefix, outbox_durable_queues=[f"{prefix}durable"])
    outbox = Outbox(app)

    @app.task(name="bench.plain", base=DjangoTask, shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(name="bench.durable", shared=False)
    def durable(n: int) -> int:
        return n

    outbox.ready()
    table = f"{prefix}data"
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, n integer NOT NULL)")
    return app, outbox, plain, durable, table


def unit_of_work(table: str, send: Any, units: int, n: int) -> None:
    """``units`` atomic blocks, each writing one row of the user's data and sending N messages."""
    from django.db import connection, transaction

    for _ in range(units):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"INSERT INTO {table} (n) VALUES (%s)", [n])
            for i in range(n):
                send(i)


def measure(options: Options) -> list[Result]:
    configure_django()
    prefix = unique_prefix()
    app, outbox, plain, durable, table = build(prefix)
    try:
        unit_of_work(table, plain.delay_on_commit, 1, 1)  # connect and declare before anything is timed
        unit_of_work(table, durable.delay, 1, 1)
        results = []
        for n in BATCHES:
            units = max(10, options.units(MESSAGES[n], 200) // n)
            rounds = in_rounds(options.size(ROUNDS, 1),
                               partial(rate, units * n, partial(unit_of_work, table, plain.delay_on_commit, units, n)),
                               partial(rate, units * n, partial(unit_of_work, table, durable.delay, units, n)))
            for plain_rate, ours in rounds:
                print(f"  django N={n}: delay_on_commit {plain_rate:.0f}/s, outbox durable {ours:.0f}/s",
                      file=sys.stderr)
            results.append(Result.of_rounds(
                "django", f"Redis, N={n} in transaction.atomic() with one ORM row, durable vs delay_on_commit",
                "msg/s", [(ours, plain_rate, None) for plain_rate, ours in rounds]))
        return results
    finally:
        with outbox.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        delete_queues(app, list(app.amqp.queues))
        drop_store(outbox)
        from django.db import connections

        connections.close_all()


def run(options: Options) -> list[Result]:
    return measure(options)
