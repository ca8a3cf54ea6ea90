"""A Celery app whose durable queues are reached through named exchanges, for tests with real workers.

The worker builds it from the environment (TEST_BROKER_URL, TEST_DATABASE_URL, TEST_TABLE_PREFIX,
TEST_SUFFIX); a test builds the same app in its own process with ``create(...)``. Queues:
``plain_<suffix>`` (the default), ``pay_<suffix>`` (durable, bound to the direct exchange
``payex_<suffix>`` with ``paykey_<suffix>``), ``audit_<suffix>`` (durable, bound to the topic
exchange ``events_<suffix>`` with ``payment.#``). Message identity is ``id_and_destination``, so the
consumer acknowledges the sender's outgoing row only when both name the same queue.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from celery import Celery
from kombu import Exchange, Queue

from celery_outbox import Outbox


def create(broker_url: str, database_url: str, prefix: str, suffix: str) -> SimpleNamespace:
    names = {key: f"{key}_{suffix}" for key in ("plain", "pay", "payex", "paykey", "audit", "events")}
    pay_exchange = Exchange(names["payex"], "direct")
    events = Exchange(names["events"], "topic")
    app = Celery("routing_app", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=names["plain"],
        task_queues=[
            Queue(names["plain"]),
            Queue(names["pay"], pay_exchange, routing_key=names["paykey"]),
            Queue(names["audit"], events, routing_key="payment.#"),
        ],
        task_routes={"routing.routed": {"exchange": names["payex"], "routing_key": names["paykey"]}},
        outbox_database_url=database_url,
        outbox_table_prefix=prefix,
        outbox_durable_queues=[names["pay"], names["audit"]],
        outbox_message_identity="id_and_destination",
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
    )
    outbox = Outbox(app)

    @app.task(name="routing.record", shared=False)
    def record(tag: str) -> str:
        return tag

    @app.task(name="routing.routed", shared=False)
    def routed(tag: str) -> str:
        return tag

    return SimpleNamespace(app=app, outbox=outbox, names=names, exchanges=[pay_exchange, events], record=record,
                           routed=routed)


if "TEST_BROKER_URL" in os.environ:
    shop = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_DATABASE_URL"], os.environ["TEST_TABLE_PREFIX"],
                  os.environ["TEST_SUFFIX"])
    app = shop.app
