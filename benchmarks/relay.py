"""Relay: publishing 100 k stranded outgoing rows vs plain Celery sending the same messages.

The rows are stranded the way production strands them: the producer commits its
units of work while its broker cannot be reached (1000 messages per unit of work).
Then a process that reaches the broker relays them (``outbox.relay()``, what beat's
recover runs), in batches of ``outbox_relay_batch_size``. Plain Celery sends the same
messages with ``apply_async`` in a loop. Messages per second, on Redis and RabbitMQ. Each
publishes into an empty broker (plain Celery's messages are purged before the relay runs:
RabbitMQ slows its publishers down as its queues grow).
"""

from __future__ import annotations

import logging
import sys
import time

from celery import Celery

from celery_outbox import Outbox

from .common import POSTGRES_URL, RABBITMQ_URL, REDIS_URL, Options, Result, rate, unique_prefix
from .producer import _tear_down

UNIT_OF_WORK = 1000


def build(broker_url: str, prefix: str, durable_queue: str) -> tuple[Celery, Outbox]:
    app = Celery(f"bench_relay_{prefix}", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}plain", task_routes={"bench.durable": {"queue": durable_queue}},
                    outbox_database_url=POSTGRES_URL, outbox_table_prefix=prefix,
                    outbox_durable_queues=[durable_queue], broker_connection_retry_on_startup=False)
    outbox = Outbox(app)
    app.task(name="bench.durable", shared=False)(lambda n: n)
    app.task(name="bench.plain", shared=False)(lambda n: n)
    return app, outbox.ready()


def strand(prefix: str, durable_queue: str, messages: int) -> None:
    """Commit ``messages`` durable messages while the broker is unreachable: they stay in the table."""
    app, outbox = build("redis://127.0.0.1:1/0", prefix, durable_queue)
    publishing_log = logging.getLogger("celery_outbox.publishing")
    level = publishing_log.level
    publishing_log.setLevel(logging.ERROR)  # one "the relay will retry it" per message is the point here
    try:
        for start in range(0, messages, UNIT_OF_WORK):
            with outbox.transaction():
                for n in range(start, min(messages, start + UNIT_OF_WORK)):
                    app.send_task("bench.durable", (n,))
    finally:
        publishing_log.setLevel(level)
        outbox.engine.dispose()


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    messages = options.units(100_000, 5_000)
    prefix = unique_prefix()
    durable_queue = f"{prefix}durable"
    app, outbox = build(broker_url, prefix, durable_queue)
    try:
        app.send_task("bench.plain", (0,))  # connect and declare before the clocks start
        plain = rate(messages, lambda: [app.send_task("bench.plain", (n,)) for n in range(messages)])
        with app.connection_for_write() as connection:  # the relay publishes into an empty broker too
            connection.default_channel.queue_purge(f"{prefix}plain")
        began = time.monotonic()
        strand(prefix, durable_queue, messages)
        print(f"  relay {broker}: stranded {messages} rows in {time.monotonic() - began:.0f}s", file=sys.stderr)
        relayed = []
        ours = rate(messages, lambda: relayed.append(outbox.relay(max_batches=10**9)))
        if relayed[0].published != messages:
            raise RuntimeError(f"the relay published {relayed[0].published} of {messages} rows: {relayed[0]}")
        print(f"  relay {broker}: plain {plain:.0f}/s, relay {ours:.0f}/s", file=sys.stderr)
        return [Result("relay", f"{broker}, {messages:,} stranded rows vs plain apply_async loop", "msg/s", ours,
                       plain, target=(">=", 1.0))]
    finally:
        _tear_down(app, outbox)


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
