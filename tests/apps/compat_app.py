"""The app of the compatibility suite (tests/compat): the same tasks in four modes.

``COMPAT_MODE`` says how celery-outbox is installed:

* ``plain``: no Outbox, Celery alone;
* ``outbox``: ``Outbox(app)`` with no durable queue;
* ``durable``: ``Outbox(app)`` with every queue of the app durable;
* ``idempotent``: every queue durable and every task an ``IdempotentTask`` (each body a unit of work).

The worker builds the app from the environment (COMPAT_MODE, TEST_BROKER_URL, TEST_BACKEND_URL,
TEST_DATABASE_URL, TEST_TABLE_PREFIX, TEST_QUEUE), as does beat, which the durable modes run
(it publishes the countdown/eta messages the outbox holds in the database until due); a test
builds the same app in its own process with ``create(...)``. Tasks leave what they saw in Redis
lists (``record``) and every task end is written to ``compat:postrun:<task id>`` (state), after
its result is stored, so a test waits for that instead of sleeping.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from types import SimpleNamespace

import redis
from celery import Celery, group, signals
from celery.exceptions import Ignore, Reject
from kombu import Exchange, Queue

MODES = ("plain", "outbox", "durable", "idempotent")
KEY_TTL = 600  # seconds the Redis lists of one run live


def postrun_key(task_id: str) -> str:
    return f"compat:postrun:{task_id}"


def create(mode: str, broker_url: str, backend_url: str, database_url: str, prefix: str,
           queue: str, recover_interval: float = 1.0) -> SimpleNamespace:
    if mode not in MODES:
        raise ValueError(f"COMPAT_MODE must be one of {MODES}, not {mode!r}")
    other = f"{queue}_other"
    app = Celery(f"compat_{mode}", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_queues=[Queue(queue, Exchange(queue), routing_key=queue),
                     Queue(other, Exchange(other), routing_key=other)],
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        result_expires=KEY_TTL,
        broker_connection_retry_on_startup=True,
    )
    outbox = None
    if mode != "plain":
        from celery_outbox import Outbox

        app.conf.update(
            outbox_database_url=database_url,
            outbox_table_prefix=prefix,
            outbox_durable_queues=[queue, other] if mode in ("durable", "idempotent") else [],
            outbox_node_heartbeat_interval=0.5,
            # beat publishes durable countdown/eta messages when due: every second, not every five
            outbox_recover_interval=recover_interval,
        )
        outbox = Outbox(app)
    store = redis.Redis.from_url(backend_url)

    def task(**options):
        options.setdefault("shared", False)
        options.setdefault("bind", True)
        if mode == "idempotent":
            from celery_outbox import IdempotentTask

            options["base"] = IdempotentTask
        return app.task(**options)

    def log(key: str, value) -> None:
        store.rpush(key, json.dumps(value))
        store.expire(key, KEY_TTL)

    def runs(key: str) -> int:
        """Counts the runs of one body under ``key``: 1 the first time."""
        count = store.incr(key)
        store.expire(key, KEY_TTL)
        return count

    @task(name="compat.add")
    def add(self, x, y):
        return x + y

    @task(name="compat.tsum")
    def tsum(self, numbers):
        return sum(numbers)

    @task(name="compat.record")
    def record(self, value, key):
        """Appends its argument (a parent's result when used as a callback) to the list ``key``."""
        log(key, value)
        return value

    @task(name="compat.fail")
    def fail(self, message):
        raise ValueError(message)

    @task(name="compat.errback_new", bind=False)  # bound tasks are always called as old-style errbacks
    def errback_new(request, exc, traceback, key):
        """A new-style errback: the worker calls it in the failing task's process."""
        log(key, f"new:{request.task}:{type(exc).__name__}:{exc}")

    @task(name="compat.errback_old")
    def errback_old(self, task_id, *, key):
        """An old-style errback (one positional argument): sent as a message with the failed id."""
        log(key, f"old:{app.AsyncResult(task_id).state}")

    @task(name="compat.info")
    def info(self, key=None):
        """What the task sees of its message."""
        request = self.request
        delivery = request.delivery_info or {}
        eta = request.eta
        seen = {
            "id": request.id,
            "routing_key": delivery.get("routing_key"),
            "exchange": delivery.get("exchange"),
            "priority": delivery.get("priority"),
            "x_custom": getattr(request, "x_custom", None),
            "eta": eta is not None,
            "ran_after_eta": eta is not None and datetime.now(timezone.utc) >= datetime.fromisoformat(eta)
            if isinstance(eta, str) else None,
            "stamped_headers": sorted(request.stamped_headers or []),
            "stamps": {k: v for k, v in sorted((request.stamps or {}).items())},
        }
        if key:
            log(key, seen)
        return seen

    @task(name="compat.count")
    def count(self, key):
        """Counts its runs; returns the count."""
        return runs(key)

    @task(name="compat.retry_once", max_retries=3)
    def retry_once(self, key):
        log(key, self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return self.request.retries

    @task(name="compat.retry_always", max_retries=2)
    def retry_always(self, key):
        log(key, self.request.retries)
        raise self.retry(countdown=0)

    @task(name="compat.autoretry", autoretry_for=(KeyError,), max_retries=3, default_retry_delay=0)
    def autoretry(self, key):
        log(key, self.request.retries)
        if self.request.retries < 2:
            raise KeyError("not yet")
        return self.request.retries

    @task(name="compat.replace_sig")
    def replace_sig(self):
        return self.replace(add.si(2, 3))

    @task(name="compat.replace_group")
    def replace_group(self):
        return self.replace(group(add.si(1, 1), add.si(2, 2)))

    @task(name="compat.reject_once", acks_late=True)
    def reject_once(self, key):
        if runs(key) == 1:
            raise Reject("once", requeue=True)
        return "ran again"

    @task(name="compat.reject_drop", acks_late=True)
    def reject_drop(self, key):
        runs(key)
        raise Reject("dropped", requeue=False)

    @task(name="compat.ignore")
    def ignore(self, key):
        runs(key)
        raise Ignore()

    @task(name="compat.progress")
    def progress(self, key):
        """Reports a custom state, then waits for the test to have seen it (``<key>:go``)."""
        self.update_state(state="PROGRESS", meta={"step": 1})
        store.blpop(f"{key}:go", timeout=30)
        return "done"

    def on_postrun(sender=None, task_id=None, state=None, **_):
        if sender is not None and sender.app is app:
            store.rpush(postrun_key(task_id), state or "")
            store.expire(postrun_key(task_id), KEY_TTL)

    signals.task_postrun.connect(on_postrun, weak=False)

    return SimpleNamespace(
        mode=mode, app=app, outbox=outbox, redis=store, queue=queue, other_queue=other, add=add, tsum=tsum,
        record=record, fail=fail, errback_new=errback_new, errback_old=errback_old, info=info, count=count,
        retry_once=retry_once, retry_always=retry_always, autoretry=autoretry, replace_sig=replace_sig,
        replace_group=replace_group, reject_once=reject_once, reject_drop=reject_drop, ignore=ignore,
        progress=progress, disconnect=lambda: signals.task_postrun.disconnect(on_postrun),
    )


if "COMPAT_MODE" in os.environ:
    compat = create(os.environ["COMPAT_MODE"], os.environ["TEST_BROKER_URL"], os.environ["TEST_BACKEND_URL"],
                    os.environ.get("TEST_DATABASE_URL", ""), os.environ.get("TEST_TABLE_PREFIX", ""),
                    os.environ["TEST_QUEUE"])
    app = compat.app
