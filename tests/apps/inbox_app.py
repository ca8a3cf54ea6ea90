"""A Celery app with IdempotentTasks, for tests that run real worker processes.

The worker builds it from the environment (TEST_BROKER_URL, TEST_DATABASE_URL,
TEST_TABLE_PREFIX, TEST_QUEUE, TEST_OTHER_QUEUE (a durable queue), TEST_IDENTITY,
TEST_VISIBILITY_TIMEOUT, TEST_CONF: more settings as JSON); a test builds the
same app in its own process with ``create(...)``. Every task start and end and
every failure is written to the ``events`` table from the worker, so a test can
see what happened in which process and in which order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

from celery import Celery, signals
from celery.exceptions import Reject
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, func, insert, select

from celery_outbox import IdempotentTask, Outbox

from ..brokers import fast_redelivery

#: seconds the ``overrun`` tasks may run (``time_limit``) before the pool kills their process
TIME_LIMIT = 2


def create(broker_url: str, database_url: str, prefix: str, queue: str, other_queue: str,
           identity: str = "id", visibility_timeout: float = 3, **conf) -> SimpleNamespace:
    app = Celery("inbox_app", broker=broker_url, set_as_current=False)
    app.conf.update({
        "task_default_queue": queue,
        "outbox_database_url": database_url,
        "outbox_table_prefix": prefix,
        "outbox_message_identity": identity,
        "outbox_durable_queues": [other_queue],
        "outbox_node_heartbeat_interval": 0.5,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        "broker_transport_options": fast_redelivery(visibility_timeout),
        **conf,
    })
    outbox = Outbox(app)
    metadata = MetaData()
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("order_id", String(64), nullable=False), Column("attempt", Integer, nullable=False))
    events = Table(f"{prefix}events", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                   Column("task_id", String(64)), Column("kind", String(16)), Column("state", String(16)),
                   Column("pid", Integer), Column("at", DateTime(timezone=True), server_default=func.now()))

    def record(task_id: str, kind: str, state: str | None = None) -> None:
        with outbox.engine.begin() as conn:
            conn.execute(insert(events).values(task_id=task_id, kind=kind, state=state, pid=os.getpid()))

    def started_before(order_id: str) -> int:
        with outbox.engine.begin() as conn:
            return conn.execute(select(func.count()).select_from(events).where(
                events.c.task_id == order_id, events.c.kind == "body")).scalar_one()

    def pay_body(task, order_id: str, hold: float) -> str:
        first_time = started_before(order_id) == 0
        record(order_id, "body")
        task.session.execute(insert(effects).values(order_id=order_id, attempt=task.request.retries))
        if hold and first_time:
            time.sleep(hold)  # the window in which a test kills the worker or sends a copy
        return order_id

    # default_retry_delay: a task whose pool process is killed comes back as a retry after this delay
    @app.task(base=IdempotentTask, bind=True, name="inbox.pay", shared=False, default_retry_delay=1)
    def pay(self, order_id: str, hold: float = 0.0) -> str:
        return pay_body(self, order_id, hold)

    @app.task(base=IdempotentTask, bind=True, name="inbox.pay_eager", shared=False, default_retry_delay=1)
    def pay_eager(self, order_id: str, hold: float = 0.0) -> str:
        return pay_body(self, order_id, hold)

    pay_eager.idempotency = "eager"

    @app.task(base=IdempotentTask, bind=True, name="inbox.flaky", shared=False, max_retries=3)
    def flaky(self, order_id: str) -> str:
        pay_body(self, order_id, 0)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return order_id

    @app.task(base=IdempotentTask, bind=True, name="inbox.fragile", shared=False)
    def fragile(self, order_id: str) -> str:
        """Fails until the data it needs exists (an effect row ``fixed:<order_id>``): then a replay succeeds."""
        record(order_id, "body")
        if not self.session.execute(select(effects.c.id).where(effects.c.order_id == f"fixed:{order_id}")).first():
            raise LookupError(f"order {order_id} has no fix yet")
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return order_id

    @app.task(base=IdempotentTask, bind=True, name="inbox.doomed", shared=False, max_retries=1,
              default_retry_delay=0)
    def doomed(self, order_id: str) -> None:
        """Kills its own pool process every time: Celery re-sends it up to ``max_retries``."""
        record(order_id, "body")
        os.kill(os.getpid(), signal.SIGKILL)

    def write_effect(order_id: str) -> str:
        """A plain task's write, in a unit of work of its own."""
        with outbox.transaction() as session:
            session.execute(insert(effects).values(order_id=order_id, attempt=0))
        return order_id

    def first_time(order_id: str) -> bool:
        """Whether no body of ``order_id`` started before this one (recorded as started)."""
        first = started_before(order_id) == 0
        record(order_id, "body")
        return first

    def die_the_first_time(order_id: str) -> None:
        if first_time(order_id):
            os.kill(os.getpid(), signal.SIGKILL)

    @app.task(name="inbox.ship", shared=False, acks_late=True, reject_on_worker_lost=True)
    def ship(order_id: str) -> str:
        """A plain task that kills its pool process the first time: Celery hands its message back
        to the broker as it is (``reject_on_worker_lost``; no re-send, which is ``IdempotentTask``'s)."""
        die_the_first_time(order_id)
        return write_effect(order_id)

    @app.task(base=IdempotentTask, bind=True, name="inbox.pay_eager_handed_back", shared=False,
              retry_on_worker_lost=False)
    def pay_eager_handed_back(self, order_id: str) -> str:
        """An eager ``IdempotentTask`` that kills its pool process the first time, re-sent by no
        one: Celery hands its message back to the broker as it is, as every lost attempt before
        Celery 5.7."""
        die_the_first_time(order_id)
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return order_id

    pay_eager_handed_back.idempotency = "eager"

    def stop_consuming_the_durable_queue(task) -> None:
        replies = app.control.cancel_consumer(other_queue, destination=[task.request.hostname], reply=True,
                                              timeout=10)
        if not replies:
            raise RuntimeError(f"the worker {task.request.hostname} did not stop consuming {other_queue}")

    def hand_back_the_first_time(task, order_id: str) -> None:
        """The first body stops its worker consuming the durable queue, then hands its message back
        to the broker (``Reject(requeue=True)``): the copy waits in the queue, behind nothing the
        worker could take first, until the test lets the worker consume again."""
        if first_time(order_id):
            stop_consuming_the_durable_queue(task)
            raise Reject("handed back", requeue=True)

    @app.task(bind=True, name="inbox.lose_process", shared=False, acks_late=True, reject_on_worker_lost=True)
    def lose_process(self, order_id: str) -> str:
        """``hand_back``, but the first body kills its pool process instead of rejecting: Celery
        hands the message back as it is (``reject_on_worker_lost``)."""
        if first_time(order_id):
            stop_consuming_the_durable_queue(self)
            os.kill(os.getpid(), signal.SIGKILL)
        return write_effect(order_id)

    @app.task(bind=True, name="inbox.hand_back", shared=False, acks_late=True)
    def hand_back(self, order_id: str) -> str:
        """A plain ``acks_late`` task that hands its message back the first time, then writes."""
        hand_back_the_first_time(self, order_id)
        return write_effect(order_id)

    @app.task(bind=True, name="inbox.hand_back_acked", shared=False, acks_late=False)
    def hand_back_acked(self, order_id: str) -> str:
        """``hand_back`` acked on receipt: its ``Reject(requeue=True)`` hands nothing back."""
        hand_back_the_first_time(self, order_id)
        return write_effect(order_id)

    @app.task(base=IdempotentTask, bind=True, name="inbox.hand_back_eager", shared=False)
    def hand_back_eager(self, order_id: str) -> str:
        """An eager ``IdempotentTask`` that hands its message back the first time, then writes."""
        hand_back_the_first_time(self, order_id)
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return order_id

    hand_back_eager.idempotency = "eager"

    @app.task(base=IdempotentTask, bind=True, name="inbox.hand_back_optimistic", shared=False)
    def hand_back_optimistic(self, order_id: str) -> str:
        """``hand_back_eager`` in the optimistic style."""
        hand_back_the_first_time(self, order_id)
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return order_id

    def outlive(order_id: str) -> str:
        record(order_id, "body")
        time.sleep(60)  # past the hard time limit: the pool kills the process
        return order_id

    @app.task(name="inbox.overrun", shared=False, time_limit=TIME_LIMIT)
    def overrun(order_id: str) -> str:
        """A plain task that runs past its hard time limit."""
        return outlive(order_id)

    @app.task(base=IdempotentTask, bind=True, name="inbox.overrun_optimistic", shared=False, time_limit=TIME_LIMIT)
    def overrun_optimistic(self, order_id: str) -> str:
        """An optimistic ``IdempotentTask`` that writes, then runs past its hard time limit."""
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return outlive(order_id)

    @app.task(base=IdempotentTask, bind=True, name="inbox.overrun_eager", shared=False, time_limit=TIME_LIMIT)
    def overrun_eager(self, order_id: str) -> str:
        """An eager ``IdempotentTask`` that writes, then runs past its hard time limit."""
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return outlive(order_id)

    overrun_eager.idempotency = "eager"

    def hang_the_first_time(order_id: str) -> None:
        """The first body hangs past the time limit deaf to the pool's SIGTERM, as one stuck in C
        code: only the SIGKILL that follows ends it, and its process's node is not deregistered."""
        if first_time(order_id):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)

    # acks_on_timeout off (Celery 5.7): Celery hands the message back to the broker at the hard time limit
    @app.task(name="inbox.overrun_once", shared=False, time_limit=TIME_LIMIT, acks_late=True, acks_on_timeout=False)
    def overrun_once(order_id: str) -> str:
        """A plain task that hangs past its hard time limit the first time, then writes and returns."""
        hang_the_first_time(order_id)
        return write_effect(order_id)

    @app.task(base=IdempotentTask, bind=True, name="inbox.overrun_once_eager", shared=False, time_limit=TIME_LIMIT,
              acks_on_timeout=False)
    def overrun_once_eager(self, order_id: str) -> str:
        """An eager ``IdempotentTask`` that hangs past its hard time limit the first time, then writes."""
        hang_the_first_time(order_id)
        self.session.execute(insert(effects).values(order_id=order_id, attempt=self.request.retries))
        return order_id

    overrun_once_eager.idempotency = "eager"

    def on_prerun(sender=None, task_id=None, **_):
        if sender is not None and sender.app is app:
            record(task_id, "prerun")

    def on_postrun(sender=None, task_id=None, state=None, **_):
        if sender is not None and sender.app is app:
            record(task_id, "postrun", state)

    def on_failure(sender=None, task_id=None, **_):
        if sender is not None and sender.app is app:
            record(task_id, "failure")

    receivers = (on_prerun, on_postrun, on_failure)
    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)
    signals.task_failure.connect(on_failure, weak=False)

    def disconnect() -> None:
        signals.task_prerun.disconnect(receivers[0])
        signals.task_postrun.disconnect(receivers[1])
        signals.task_failure.disconnect(receivers[2])

    def event_rows(task_id: str):
        with outbox.engine.begin() as conn:
            return conn.execute(select(events).where(events.c.task_id == task_id).order_by(events.c.id)).all()

    def effect_rows(order_id: str):
        with outbox.engine.begin() as conn:
            return conn.execute(select(effects).where(effects.c.order_id == order_id)).all()

    return SimpleNamespace(app=app, outbox=outbox, metadata=metadata, pay=pay, pay_eager=pay_eager, flaky=flaky,
                           fragile=fragile, doomed=doomed, ship=ship, overrun=overrun,
                           overrun_optimistic=overrun_optimistic, overrun_eager=overrun_eager,
                           overrun_once=overrun_once, overrun_once_eager=overrun_once_eager,
                           pay_eager_handed_back=pay_eager_handed_back, hand_back=hand_back,
                           hand_back_acked=hand_back_acked, hand_back_eager=hand_back_eager,
                           hand_back_optimistic=hand_back_optimistic, lose_process=lose_process,
                           events=event_rows, effects=effect_rows,
                           disconnect=disconnect)


if "TEST_BROKER_URL" in os.environ:
    shop = create(os.environ["TEST_BROKER_URL"], os.environ["TEST_DATABASE_URL"], os.environ["TEST_TABLE_PREFIX"],
                  os.environ["TEST_QUEUE"], os.environ["TEST_OTHER_QUEUE"], os.environ.get("TEST_IDENTITY", "id"),
                  float(os.environ.get("TEST_VISIBILITY_TIMEOUT", 3)), **json.loads(os.environ.get("TEST_CONF", "{}")))
    app = shop.app
