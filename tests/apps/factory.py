"""Builds a Celery app with an Outbox for a test: unique queue names, one durable queue."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from celery import Celery
from sqlalchemy import select

from celery_outbox import Outbox


@dataclass
class Shop:
    app: Celery
    outbox: Outbox
    plain_queue: str
    durable_queue: str
    plain: Any
    durable: Any


def make_shop(broker_url: str, database_url: str, table_prefix: str, **conf: Any) -> Shop:
    suffix = uuid.uuid4().hex[:8]
    plain_queue, durable_queue = f"plain_{suffix}", f"durable_{suffix}"
    app = Celery(f"shop_{suffix}", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=plain_queue,
        task_routes={"shop.durable": {"queue": durable_queue}},
        outbox_database_url=database_url,
        outbox_table_prefix=table_prefix,
        outbox_durable_queues=[durable_queue],
        broker_connection_retry_on_startup=False,
        **conf,
    )
    outbox = Outbox(app)

    @app.task(name="shop.plain", shared=False)
    def plain(x):
        return x

    @app.task(name="shop.durable", shared=False)
    def durable(x):
        return x

    return Shop(app, outbox, plain_queue, durable_queue, plain, durable)


def outgoing(shop: Shop) -> list[Any]:
    """The shop's outgoing rows, sent or not."""
    with shop.outbox.store.begin() as conn:
        return conn.execute(select(shop.outbox.store.tables.outgoing)).all()


def strand(shop: Shop, *args: Any, **options: Any) -> list[Any]:
    """Send durable messages as if their publish after the commit had failed: the rows wait,
    unsent, in the outgoing table for the relay, and nothing is published."""
    return stranded(shop, lambda: [shop.durable.apply_async((arg,), **options) for arg in args])


def publish_failing(shop: Shop, patch: Any) -> None:
    """Make the commit-time publisher of ``shop`` (through the monkeypatch ``patch``) do what a
    publish that failed does: nothing is published, and the rows stored marked sent go back to
    the relay, unsent."""
    store = shop.outbox.store

    def give_back(messages: list[Any], producer: Any = None) -> None:
        ids = sorted(m.row_id for m in messages if m.marked_sent)
        if ids:
            with store.begin() as conn:
                store.unmark_sent(conn, ids)

    patch.setattr(shop.outbox.publisher, "publish_committed", give_back)


def stranded(shop: Shop, send: Callable[[], Any]) -> Any:
    """What ``send()`` sends in a unit of work, stored unsent and left for the relay, as a publish
    that failed after the commit leaves it (``strand``: nothing is published); what ``send``
    returned."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        publish_failing(shop, patch)
        with shop.outbox.transaction():
            return send()
