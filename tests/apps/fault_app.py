"""The shop the fault-injection scenarios (tests/faults/) run under fire.

Built from the environment: FAULT_BROKER_URL, FAULT_DATABASE_URL, FAULT_PREFIX,
FAULT_QUEUE (a durable queue), FAULT_MAINTENANCE_QUEUE, FAULT_VISIBILITY_TIMEOUT,
FAULT_CONF (more settings as JSON). A test builds the same app in its own process
with ``create(...)`` to read the tables.

* The producer (``python -m tests.apps.fault_app produce N``) places the orders
  ``order-0 .. order-N-1`` that are not in the database yet, each in one unit of
  work (every other one ``outbox.begin()``, the others ``outbox.transaction()``):
  the order row and its payment message (every third one to the eager style)
  commit together. An order row is therefore exactly a committed send. A
  database that is down makes it wait and try the same order again.
* ``fault.pay`` (optimistic) and ``fault.pay_eager`` (eager) write a ``payment``
  effect and send the order's receipt from their unit of work; ``fault.receipt``
  (optimistic) writes a ``receipt`` effect. Effects carry no unique key: a second
  run of a body would show as a second row.
* FAULT_ASYNC=1 makes the producer asyncio code: batches of orders placed concurrently, each in
  an async unit of work (``outbox.abegin()`` and ``outbox.atransaction()`` in turn) on the async
  engine (``outbox_async_database_url`` in FAULT_CONF, or the store's URL with its async driver).
  FAULT_ASYNC=cancel also cancels the units still running a random moment after a batch starts,
  before, during or after their commits, and lets every other batch's loop shut down on them
  (``asyncio.run`` cancels what is left); an order it did not commit is placed again later.
* FAULT_TRICKS (comma-separated) makes the first delivery of some payments misbehave
  the way Celery allows: ``reject`` raises ``Reject(requeue=True)`` (every 7th order,
  from the 4th), ``worker_lost`` kills its own pool process (every 7th, from the 6th),
  which Celery answers by sending the task again (``retry_on_worker_lost``).
* FAULT_PLAIN_RECEIPTS=1 makes ``fault.receipt`` a plain Celery task (no
  ``IdempotentTask``, acked early): consumed from the durable queue, it still goes
  through the inbox (eager claim, envelope), but its write commits in a transaction of
  its own, so it is at least once; it writes its effect only when absent, as such a task
  must. Its first deliveries play the same tricks as the payments.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from types import SimpleNamespace

from celery import Celery
from celery.exceptions import Reject
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from celery_outbox import IdempotentTask, Outbox

from ..brokers import fast_redelivery
from . import skewed_clock

ORDER_ID = "order-{}"


def create(broker_url: str, database_url: str, prefix: str, queue: str, maintenance_queue: str,
           visibility_timeout: float = 3, body_seconds: float = 0.0, tricks: str = "", plain_receipts: bool = False,
           **conf) -> SimpleNamespace:
    app = Celery("fault_app", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=maintenance_queue,
        task_routes={"fault.*": {"queue": queue}},
        outbox_database_url=database_url,
        outbox_table_prefix=prefix,
        outbox_durable_queues=[queue],
        outbox_maintenance_queue=maintenance_queue,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=fast_redelivery(visibility_timeout),
        **{"worker_prefetch_multiplier": 1, "outbox_node_heartbeat_interval": 0.5, **conf},
    )
    outbox = Outbox(app)
    metadata = MetaData()
    orders = Table(f"{prefix}orders", metadata, Column("id", String(64), primary_key=True))
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("order_id", String(64), nullable=False), Column("kind", String(16), nullable=False),
                    Column("pid", Integer, nullable=False))

    tricked = Table(f"{prefix}tricked", metadata, Column("order_id", String(64), primary_key=True))
    # each start of an eager payment's body, committed on its own before the body's writes: the side
    # effect outside the task's transaction that the eager style exists for (at most once but for a crash)
    bodies = Table(f"{prefix}bodies", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                   Column("order_id", String(64), nullable=False), Column("pid", Integer, nullable=False))
    enabled_tricks = {name for name in tricks.split(",") if name}

    def first_trick(order_id: str, trick: str) -> bool:
        """Whether ``trick`` is on for this order and not played yet (recorded in a transaction of its own)."""
        number = int(order_id.rsplit("-", 1)[1])
        if trick not in enabled_tricks or number % 7 != {"reject": 3, "worker_lost": 5}[trick]:
            return False
        try:
            with outbox.engine.begin() as conn:
                conn.execute(insert(tricked).values(order_id=order_id))
        except IntegrityError:
            return False
        return True

    def play_tricks(key: str) -> None:
        if first_trick(key, "reject"):
            raise Reject("the fault drill's first delivery", requeue=True)
        if first_trick(key, "worker_lost"):
            os.kill(os.getpid(), signal.SIGKILL)

    def take_a_while() -> None:
        """A body that takes ``body_seconds``: faults find bodies running, eager ones among them."""
        if body_seconds:
            time.sleep(body_seconds)

    def pay_body(task, order_id: str) -> None:
        play_tricks(order_id)
        if task.idempotency == "eager":
            with outbox.engine.begin() as conn:
                conn.execute(insert(bodies).values(order_id=order_id, pid=os.getpid()))
        task.session.execute(insert(effects).values(order_id=order_id, kind="payment", pid=os.getpid()))
        take_a_while()
        receipt.apply_async((order_id,), task_id=f"receipt-{order_id}")

    @app.task(base=IdempotentTask, bind=True, name="fault.pay", shared=False, default_retry_delay=0.2)
    def pay(self, order_id: str) -> None:
        pay_body(self, order_id)

    @app.task(base=IdempotentTask, bind=True, name="fault.pay_eager", shared=False, default_retry_delay=0.2)
    def pay_eager(self, order_id: str) -> None:
        pay_body(self, order_id)

    pay_eager.idempotency = "eager"

    if plain_receipts:
        @app.task(name="fault.receipt", shared=False)
        def receipt(order_id: str) -> None:
            play_tricks(f"receipt-{order_id}")
            with outbox.transaction() as session:
                written = select(effects.c.id).where(effects.c.order_id == order_id, effects.c.kind == "receipt")
                if session.execute(written).first() is None:
                    session.execute(insert(effects).values(order_id=order_id, kind="receipt", pid=os.getpid()))
                take_a_while()
    else:
        @app.task(base=IdempotentTask, bind=True, name="fault.receipt", shared=False, default_retry_delay=0.2)
        def receipt(self, order_id: str) -> None:
            self.session.execute(insert(effects).values(order_id=order_id, kind="receipt", pid=os.getpid()))
            take_a_while()

    def place(number: int) -> None:
        """Commit one order and its payment message in one unit of work: every other order on a
        Core connection (``outbox.begin()``, its COMMIT sent with the message's INSERT), the
        others on a Session (``outbox.transaction()``)."""
        order_id = ORDER_ID.format(number)
        with outbox.begin() if number % 2 else outbox.transaction() as conn_or_session:
            conn_or_session.execute(insert(orders).values(id=order_id))
            (pay_eager if number % 3 == 2 else pay).apply_async((order_id,), task_id=order_id)

    async def aplace(number: int) -> None:
        """``place`` in an async unit of work: every other order on an ``AsyncConnection``
        (``outbox.abegin()``), the others on an ``AsyncSession`` (``outbox.atransaction()``)."""
        order_id = ORDER_ID.format(number)
        async with outbox.abegin() if number % 2 else outbox.atransaction() as conn_or_session:
            await conn_or_session.execute(insert(orders).values(id=order_id))
            (pay_eager if number % 3 == 2 else pay).apply_async((order_id,), task_id=order_id)

    def placed() -> set[str]:
        with outbox.engine.begin() as conn:
            return set(conn.execute(select(orders.c.id)).scalars())

    return SimpleNamespace(app=app, outbox=outbox, metadata=metadata, orders=orders, effects=effects,
                           bodies=bodies, place=place, aplace=aplace, placed=placed)


ASYNC_BATCH = 8  # orders an async producer places at once


def produce_async(shop: SimpleNamespace, count: int, pace: float, cancel: bool, patience: float = 120.0) -> None:
    """Place every order not placed yet, ``ASYNC_BATCH`` at a time in one event loop, until all
    are placed (a failed or cancelled unit's order is placed again in a later batch). With
    ``cancel``, each batch's units still running after a random 0 to 60 ms are cancelled: by the
    batch itself, or, every other batch, by ``asyncio.run`` shutting the loop down on them. Prints
    how many cancelled units had committed (their orders placed) and how many had not."""
    import asyncio
    import random

    deadline = time.monotonic() + patience
    cancelled_committed = cancelled_rolled_back = 0
    batch_number = 0
    while True:
        try:
            shop.outbox.ready()
            done = shop.placed()
        except SQLAlchemyError:
            _wait_or_give_up(deadline)
            continue
        todo = [number for number in range(count) if ORDER_ID.format(number) not in done]
        if not todo:
            break
        batch, batch_number = todo[:ASYNC_BATCH], batch_number + 1
        cancelled: list[int] = []

        async def run_batch(batch: list[int], batch_number: int, cancelled: list[int]) -> None:
            tasks = {asyncio.ensure_future(shop.aplace(number)): number for number in batch}
            if not cancel:
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            else:
                _, pending = await asyncio.wait(tasks, timeout=random.uniform(0, 0.06))
                cancelled.extend(tasks[task] for task in pending)
                if batch_number % 2:  # the loop shuts down on them: asyncio.run cancels them
                    return
                for task in pending:
                    task.cancel()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, (
                IntegrityError, SQLAlchemyError, asyncio.CancelledError))]
            if failed:
                raise failed[0]

        try:
            asyncio.run(run_batch(batch, batch_number, cancelled))
        except SQLAlchemyError:
            _wait_or_give_up(deadline)
        if cancelled:
            now_placed = shop.placed()
            committed = sum(ORDER_ID.format(number) in now_placed for number in cancelled)
            cancelled_committed += committed
            cancelled_rolled_back += len(cancelled) - committed
            print(f"fault producer: cancelled units committed {cancelled_committed}, "
                  f"not committed {cancelled_rolled_back}", flush=True)
        if pace:
            time.sleep(pace * len(batch))


def produce(shop: SimpleNamespace, count: int, pace: float, patience: float = 120.0) -> None:
    """Place every order not placed yet. A failed unit of work (the database is down) is tried
    again, as a web client would; an order committed by an earlier run of this process is skipped."""
    deadline = time.monotonic() + patience
    done = None
    while done is None:
        try:
            shop.outbox.ready()
            done = shop.placed()
        except SQLAlchemyError:
            _wait_or_give_up(deadline)
    for number in range(count):
        if ORDER_ID.format(number) in done:
            continue
        while True:
            try:
                shop.place(number)
                break
            except IntegrityError:
                break  # the commit went through before the connection broke: it is placed
            except SQLAlchemyError:
                _wait_or_give_up(deadline)
        if pace:
            time.sleep(pace)  # spreads the orders over the run, so faults meet messages in flight


def _wait_or_give_up(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise SystemExit("fault producer: the database stayed unavailable")
    time.sleep(0.2)


if "FAULT_CLOCK_OFFSET" in os.environ:  # this process's clock runs off the host's (tests/faults)
    skewed_clock.shift(float(os.environ["FAULT_CLOCK_OFFSET"]))

if "FAULT_BROKER_URL" in os.environ:
    shop = create(os.environ["FAULT_BROKER_URL"], os.environ["FAULT_DATABASE_URL"], os.environ["FAULT_PREFIX"],
                  os.environ["FAULT_QUEUE"], os.environ["FAULT_MAINTENANCE_QUEUE"],
                  float(os.environ.get("FAULT_VISIBILITY_TIMEOUT", 3)), float(os.environ.get("FAULT_BODY_SECONDS", 0)),
                  os.environ.get("FAULT_TRICKS", ""), os.environ.get("FAULT_PLAIN_RECEIPTS") == "1",
                  **json.loads(os.environ.get("FAULT_CONF", "{}")))
    app = shop.app

if __name__ == "__main__":
    if sys.argv[1:2] != ["produce"]:
        raise SystemExit("usage: python -m tests.apps.fault_app produce COUNT [PACE]")
    if os.environ.get("FAULT_ASYNC"):
        produce_async(shop, int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0,
                      cancel=os.environ["FAULT_ASYNC"] == "cancel")
    else:
        produce(shop, int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
