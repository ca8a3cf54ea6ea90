"""The scenarios of the compatibility suite: each drives one mode's app from the test process and
returns a plain, comparable outcome (results, states, exception types, what the tasks saw, the
order in which callbacks and errbacks ran), never a task id or a time.

``EXPECTED`` holds what plain Celery does in each scenario, as Celery documents it; every other
mode must give the same outcome, except the deliberate differences ``DIFFERENCES`` names.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from celery import chain, chord, group
from celery.canvas import StampingVisitor
from celery.exceptions import TimeoutError as ResultTimeout
from sqlalchemy import func, select

from ..apps.compat_app import postrun_key
from ..versions import CELERY
from .harness import CONCURRENCY, Context

TIMEOUT = 15.0  # how long a scenario waits for what plain Celery does at once

SCENARIOS: list[Callable[[Context], Any]] = []
EXPECTED: dict[str, Any] = {}
#: (scenario, mode) -> the outcome of a deliberate difference from plain Celery, each with its reason
DIFFERENCES: dict[tuple[str, str], Any] = {}
#: scenario -> the Celery release that first gives its ``EXPECTED`` outcome (an older one, such as
#: ``tox -e lowest`` runs, gives another: what every other mode is compared with all the same)
DOCUMENTED_SINCE: dict[str, tuple[int, int]] = {
    "errbacks_of_a_failing_chord_member_in_a_chain": (5, 7),  # the chord body's ChordError stayed PENDING
    "reject_without_requeue": (5, 7),  # no FAILURE (Reject) stored: the state stayed PENDING
    "chord_with_countdown": (5, 7),  # the header tasks ran with no ETA
    "events_of_a_task": (5, 7),  # task events of a pool thread lost now and then: see events_of_one_task
    "events_of_a_task_with_a_countdown": (5, 7),
}


def scenario(expected: Any) -> Callable[[Callable[[Context], Any]], Callable[[Context], Any]]:
    def register(function: Callable[[Context], Any]) -> Callable[[Context], Any]:
        SCENARIOS.append(function)
        EXPECTED[function.__name__] = expected
        return function

    return register


# -- helpers ---------------------------------------------------------------------------------------

def settle(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float = TIMEOUT) -> Any:
    """``read()`` once ``done`` holds for it, or its last value when ``timeout`` passes first: a
    mode that differs gives its outcome for the comparison instead of failing here."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def outcome_of(result, timeout: float = TIMEOUT) -> tuple:
    """``(state, value)``, ``(state, exception type, message)``, or ``("not ready", state)``."""
    try:
        value = result.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
    except ResultTimeout:
        return ("not ready", result.state)
    if isinstance(value, BaseException):
        return (result.state, type(value).__name__, str(value))
    return (result.state, value)


def logged(ctx: Context, key: str, count: int | None = None) -> list:
    """The values the tasks appended to ``key``; with ``count``, once that many are there."""
    def read():
        return [json.loads(v) for v in ctx.redis.lrange(key, 0, -1)]

    return read() if count is None else settle(read, lambda values: len(values) >= count)


def postruns(ctx: Context, task_id: str, count: int) -> list[str]:
    """The states of a task's ends (``task_postrun``, after the result is stored), once ``count`` came."""
    return settle(lambda: [v.decode() for v in ctx.redis.lrange(postrun_key(task_id), 0, -1)],
                  lambda states: len(states) >= count)


def runs(ctx: Context, key: str) -> int:
    return int(ctx.redis.get(key) or 0)


def unsettled(ctx: Context, task_id: str) -> int:
    """How many copies of the message ``task_id`` the outbox still holds to publish again: rows of its
    outgoing table, which stay until the consuming inbox acknowledges them and are redelivered
    (published again) if it never does. Plain Celery holds none: a message the worker acked,
    rejected or discarded is gone, so every mode must hold none once the task has ended."""
    if ctx.outbox is None:
        return 0
    outgoing = ctx.outbox.store.tables.outgoing
    with ctx.outbox.engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(outgoing).where(
            outgoing.c.message_id == task_id)).scalar_one()


def drain(ctx: Context) -> None:
    """Runs a group of tasks wider than the worker's concurrency on its queue and waits for them:
    a message the worker handed back before would be run by then."""
    group(ctx.add.si(n, n) for n in range(2 * CONCURRENCY)).apply_async().get(timeout=TIMEOUT)


def final_state(result, timeout: float = TIMEOUT) -> str:
    return settle(lambda: result.state, lambda state: state in ("SUCCESS", "FAILURE", "REVOKED"), timeout)


# -- publish options -----------------------------------------------------------------------------

@scenario(expected=("SUCCESS", "other", ""))  # a direct queue named alone: the default exchange
def queue_option(ctx):
    """``queue=`` sends the task to that queue (its exchange and routing key)."""
    result = ctx.info.apply_async(queue=ctx.other_queue)
    state, seen = outcome_of(result)
    rename = {ctx.other_queue: "other", ctx.queue: "default"}
    return state, rename.get(seen["routing_key"], seen["routing_key"]), rename.get(seen["exchange"], seen["exchange"])


@scenario(expected=("SUCCESS", "other", "other"))
def exchange_and_routing_key_options(ctx):
    """``exchange=`` and ``routing_key=`` route the task to the queue bound with them."""
    result = ctx.info.apply_async(exchange=ctx.other_queue, routing_key=ctx.other_queue)
    state, seen = outcome_of(result)
    rename = {ctx.other_queue: "other", ctx.queue: "default"}
    return state, rename.get(seen["routing_key"], seen["routing_key"]), rename.get(seen["exchange"], seen["exchange"])


@scenario(expected=("SUCCESS", 5))
def priority_option(ctx):
    state, seen = outcome_of(ctx.info.apply_async(priority=5))
    return state, seen["priority"]


@scenario(expected=("SUCCESS", "custom value"))
def headers_option(ctx):
    """A custom header reaches the task's request."""
    state, seen = outcome_of(ctx.info.apply_async(headers={"x_custom": "custom value"}))
    return state, seen["x_custom"]


@scenario(expected=(True, "SUCCESS", True))
def task_id_option(ctx):
    task_id = f"compat-{uuid.uuid4()}"
    result = ctx.info.apply_async(task_id=task_id)
    state, seen = outcome_of(result)
    return result.id == task_id, state, seen["id"] == task_id


@scenario(expected=(("SUCCESS", 3), ["queue", "task.sent"]))
def producer_option(ctx):
    """A producer passed to ``apply_async`` publishes the message (and its task-sent event)."""
    published = []
    with ctx.app.connection_for_write() as connection:
        producer = ctx.app.amqp.Producer(connection)
        original = producer.publish

        def publish(*args, **kwargs):
            published.append("queue" if kwargs.get("routing_key") == ctx.queue else kwargs.get("routing_key"))
            return original(*args, **kwargs)

        producer.publish = publish
        result = ctx.add.apply_async((1, 2), producer=producer)
    return outcome_of(result), published


@scenario(expected=("SUCCESS", 5))
def send_task_by_name(ctx):
    return outcome_of(ctx.app.send_task("compat.add", (2, 3)))


@scenario(expected=(["SUCCESS"], "PENDING", ["ran"]))
def ignore_result_option(ctx):
    """``ignore_result=True``: the task runs and no result is stored (the state stays PENDING)."""
    key = ctx.key()
    result = ctx.record.apply_async(("ran", key), ignore_result=True)
    ends = postruns(ctx, result.id, 1)
    return ends, result.state, logged(ctx, key)


@scenario(expected=("SUCCESS", [[1, 2], {"a": None}]))
def serializer_json(ctx):
    """JSON turns a tuple into a list, both ways."""
    return outcome_of(ctx.record.apply_async(([(1, 2), {"a": None}], ctx.key()), serializer="json"))


# -- canvas -------------------------------------------------------------------------------------

@scenario(expected=("SUCCESS", 10))
def chain_of_tasks(ctx):
    return outcome_of((ctx.add.s(1, 2) | ctx.add.s(3) | ctx.add.s(4)).apply_async())


@scenario(expected=[0, 2, 4, 6])
def group_of_tasks(ctx):
    return group(ctx.add.s(i, i) for i in range(4)).apply_async().get(timeout=TIMEOUT)


@scenario(expected=("SUCCESS", 6))
def chord_of_tasks(ctx):
    return outcome_of(chord([ctx.add.s(i, i) for i in range(3)], ctx.tsum.s()).apply_async())


@scenario(expected=("SUCCESS", 107))
def chord_in_a_chain(ctx):
    flow = chain(ctx.add.si(1, 1), chord([ctx.add.s(1), ctx.add.s(2)], ctx.tsum.s()), ctx.add.s(100))
    return outcome_of(flow.apply_async())


@scenario(expected=[6, 10])
def chord_in_a_group(ctx):
    flow = group(chord([ctx.add.si(1, 1), ctx.add.si(2, 2)], ctx.tsum.s()), ctx.add.si(5, 5))
    return flow.apply_async().get(timeout=TIMEOUT)


@scenario(expected=([6, 8], ("SUCCESS", [7, 8])))
def chain_of_groups(ctx):
    """A group followed by a group, and a group | task | group."""
    two = chain(group(ctx.add.si(1, 1), ctx.add.si(2, 2)), group(ctx.add.si(3, 3), ctx.add.si(4, 4)))
    three = chain(group(ctx.add.si(1, 1), ctx.add.si(2, 2)), ctx.tsum.s(), group(ctx.add.s(1), ctx.add.s(2)))
    return two.apply_async().get(timeout=TIMEOUT), ("SUCCESS", three.apply_async().get(timeout=TIMEOUT))


@scenario(expected=(("SUCCESS", 4), [4, "immutable"]))
def link_callbacks(ctx):
    """``link``: each callback runs after the task, a mutable one with its result."""
    key = ctx.key()
    result = ctx.add.apply_async((2, 2), link=[ctx.record.s(key), ctx.record.si("immutable", key)])
    return outcome_of(result), sorted(logged(ctx, key, 2), key=str)


@scenario(expected=(("FAILURE", "ValueError", "boom"),
                    ["new:compat.fail:ValueError:boom", ["old:FAILURE", "si"]]))
def errbacks_of_a_failing_task(ctx):
    """``link_error``: a new-style errback (request, exc, traceback) runs first, in the failing
    task's worker; old-style ones (a task id) and immutable ones are sent as messages after."""
    key = ctx.key()
    result = ctx.fail.apply_async(("boom",), link_error=[
        ctx.errback_new.s(key), ctx.errback_old.s(key=key), ctx.record.si("si", key)])
    log = logged(ctx, key, 3)
    return outcome_of(result), [*log[:1], sorted(log[1:])]


def failing_member(ctx, key: str):
    """A failing task with a new-style and an old-style errback."""
    return ctx.fail.si("member").on_error(ctx.errback_new.s(key)).on_error(ctx.errback_old.s(key=key))


def without_ids(outcome: tuple) -> tuple:
    """An outcome with the task ids in its exception message (a ChordError's) left out."""
    return tuple(re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<id>", part) if isinstance(part, str) else part
                 for part in outcome)


@scenario(expected=(("FAILURE", "ChordError", "Dependency <id> raised ValueError('member')"),
                    ["new:compat.fail:ValueError:member", "old:FAILURE"], "FAILURE", []))
def errbacks_of_a_failing_chord_member_in_a_chain(ctx):
    """A chord header member fails inside a chain: its errbacks run, the chord body fails
    (ChordError), and what follows the chord does not run."""
    key = ctx.key()
    flow = chain(ctx.add.si(1, 1), chord([ctx.add.si(2, 2), failing_member(ctx, key)], ctx.tsum.s()),
                 ctx.record.s(key + ":after"))
    result = flow.apply_async()
    body = outcome_of(result.parent)
    return without_ids(body), sorted(logged(ctx, key, 2)), final_state(result), logged(ctx, key + ":after")


@scenario(expected=([("FAILURE", "ChordError", "Dependency <id> raised ValueError('member')"), ("SUCCESS", 6)],
                    ["new:compat.fail:ValueError:member", "old:FAILURE"]))
def errbacks_of_a_failing_chord_member_in_a_group(ctx):
    key = ctx.key()
    flow = group(chord([ctx.add.si(2, 2), failing_member(ctx, key)], ctx.tsum.s()), ctx.add.si(3, 3))
    result = flow.apply_async()
    return [without_ids(outcome_of(child)) for child in result.results], sorted(logged(ctx, key, 2))


@scenario(expected=(("SUCCESS", 4), ("SUCCESS", "fixed"), ["fixed"]))
def immutable_signatures(ctx):
    """``si``: an immutable signature ignores its parent's result."""
    key = ctx.key()
    first = chain(ctx.add.si(1, 1), ctx.add.si(2, 2)).apply_async()
    second = chain(ctx.add.s(1, 1), ctx.record.si("fixed", key)).apply_async()
    return outcome_of(first), outcome_of(second), logged(ctx, key)


@scenario(expected=(("SUCCESS", [3, 7]), ("SUCCESS", [3, 7]), ("SUCCESS", [[0, 2], [4, 6], [8, 10]])))
def map_starmap_chunks(ctx):
    mapped = ctx.tsum.map([[1, 2], [3, 4]]).apply_async()
    starmapped = ctx.add.starmap([(1, 2), (3, 4)]).apply_async()
    chunked = ctx.add.chunks([(n, n) for n in range(6)], 2).apply_async()
    return outcome_of(mapped), outcome_of(starmapped), ("SUCCESS", chunked.get(timeout=TIMEOUT))


# -- retries, stamps, replace ------------------------------------------------------------------------

@scenario(expected=(("SUCCESS", 1), [0, 1], ["RETRY", "SUCCESS"]))
def retry_with_countdown_zero(ctx):
    """``self.retry(countdown=0)``: the task runs again at once and succeeds. The retry is sent
    before the first attempt ends, so the two ends (RETRY, SUCCESS) come in either order."""
    key = ctx.key()
    result = ctx.retry_once.apply_async((key,))
    return outcome_of(result), logged(ctx, key), sorted(postruns(ctx, result.id, 2))


@scenario(expected=(("FAILURE", "MaxRetriesExceededError"), [0, 1, 2]))
def retries_exceeded(ctx):
    key = ctx.key()
    result = ctx.retry_always.apply_async((key,))
    return outcome_of(result)[:2], logged(ctx, key)


@scenario(expected=(("SUCCESS", 2), [0, 1, 2]))
def autoretry_for(ctx):
    key = ctx.key()
    result = ctx.autoretry.apply_async((key,))
    return outcome_of(result), logged(ctx, key)


class Stamp(StampingVisitor):
    def on_signature(self, sig, **headers) -> dict:
        return {"colour": "blue"}


@scenario(expected=[(["colour"], {"colour": "blue"}), (["colour"], {"colour": "blue"})])
def stamped_canvas(ctx):
    """A stamping visitor's stamp reaches every task of the canvas it stamps."""
    key = ctx.key()
    flow = chain(ctx.info.si(key), ctx.info.si(key))
    flow.stamp(visitor=Stamp())
    outcome_of(flow.apply_async())
    return [(seen["stamped_headers"], seen["stamps"]) for seen in logged(ctx, key, 2)]


@scenario(expected=("SUCCESS", 5))
def replace_with_a_signature(ctx):
    return outcome_of(ctx.replace_sig.apply_async())


@scenario(expected=("SUCCESS", [2, 4]))
def replace_with_a_group(ctx):
    return outcome_of(ctx.replace_group.apply_async())


# -- Reject and Ignore ---------------------------------------------------------------------------

@scenario(expected=(("SUCCESS", "ran again"), 2, ["REJECTED", "SUCCESS"]))
def reject_requeue_then_success(ctx):
    """``Reject(requeue=True)``: the message goes back to the queue and runs again."""
    key = ctx.key()
    result = ctx.reject_once.apply_async((key,))
    return outcome_of(result), runs(ctx, key), postruns(ctx, result.id, 2)


@scenario(expected=(["REJECTED"], ("FAILURE", "Reject"), 1, 0))
def reject_without_requeue(ctx):
    """``Reject(requeue=False)``: the message does not run again; Celery 5.7 stores FAILURE (Reject)."""
    key = ctx.key()
    result = ctx.reject_drop.apply_async((key,))
    ends = postruns(ctx, result.id, 1)
    drain(ctx)
    return ends, outcome_of(result, 1)[:2], runs(ctx, key), unsettled(ctx, result.id)


@scenario(expected=(["IGNORED"], "PENDING", 1, 0))
def ignore(ctx):
    key = ctx.key()
    result = ctx.ignore.apply_async((key,))
    ends = postruns(ctx, result.id, 1)
    drain(ctx)
    return ends, result.state, runs(ctx, key), unsettled(ctx, result.id)


# -- revoke and expires --------------------------------------------------------------------------

@scenario(expected=(True, ("REVOKED", "TaskRevokedError"), 0, 0))
def revoke_before_run(ctx):
    """A task revoked before its message arrives is never run and its state is REVOKED."""
    key, task_id = ctx.key(), f"compat-{uuid.uuid4()}"
    replies = ctx.app.control.revoke(task_id, reply=True, destination=[ctx.mode.worker.hostname], timeout=5)
    result = ctx.count.apply_async((key,), task_id=task_id)
    final_state(result)
    drain(ctx)
    return len(replies) == 1, outcome_of(result, 1)[:2], runs(ctx, key), unsettled(ctx, task_id)


@scenario(expected=(("REVOKED", "TaskRevokedError"), 0, 0))
def expires_in_the_past(ctx):
    key = ctx.key()
    result = ctx.count.apply_async((key,), expires=datetime.now(timezone.utc) - timedelta(minutes=1))
    final_state(result)
    drain(ctx)
    return outcome_of(result, 1)[:2], runs(ctx, key), unsettled(ctx, result.id)


# -- ETA and countdown ---------------------------------------------------------------------------

def what_info_saw(result) -> tuple:
    """The state of an ``info`` task, whether its request had an ETA and whether it ran after it."""
    outcome = outcome_of(result)
    if outcome[0] != "SUCCESS":
        return outcome
    return outcome[0], outcome[1]["eta"], outcome[1]["ran_after_eta"]


@scenario(expected=("SUCCESS", True, True))
def countdown(ctx):
    """``countdown=``: the task runs after its ETA, which its request carries."""
    return what_info_saw(ctx.info.apply_async(countdown=1))


@scenario(expected=("SUCCESS", True, True))
def eta(ctx):
    return what_info_saw(ctx.info.apply_async(eta=datetime.now(timezone.utc) + timedelta(seconds=1)))


@scenario(expected=("SUCCESS", [(True, True), (True, True)]))
def chord_with_countdown(ctx):
    """A countdown given to a chord: what its header tasks see of it."""
    key = ctx.key()
    result = chord([ctx.info.si(), ctx.info.si()], ctx.record.s(key)).apply_async(countdown=1)
    state = outcome_of(result)[0]
    return state, [(seen["eta"], seen["ran_after_eta"]) for seen in (logged(ctx, key) or [[]])[0]]


# -- results and states ---------------------------------------------------------------------------

@scenario(expected=(("SUCCESS", 3), ["SUCCESS"], 0))
def success_result(ctx):
    result = ctx.add.apply_async((1, 2))
    return outcome_of(result), postruns(ctx, result.id, 1), unsettled(ctx, result.id)


@scenario(expected=(("FAILURE", "ValueError", "bad input"), True))
def failure_result(ctx):
    result = ctx.fail.apply_async(("bad input",))
    outcome = outcome_of(result)
    return outcome, "ValueError: bad input" in (result.traceback or "")


@scenario(expected=("PROGRESS", {"step": 1}, ("SUCCESS", "done")))
def custom_state(ctx):
    """``update_state``: the custom state and its meta are visible while the task runs."""
    key = ctx.key()
    result = ctx.progress.apply_async((key,))
    state = settle(lambda: result.state, lambda state: state != "PENDING")
    info = result.info
    ctx.redis.rpush(f"{key}:go", "1")
    ctx.redis.expire(f"{key}:go", 600)
    return state, info, outcome_of(result)


@scenario(expected=("PROGRESS", "active", True, ("SUCCESS", "done")))
def query_task_while_running(ctx):
    """``inspect().query_task`` of a running task: its state and whether its message was acked."""
    key = ctx.key()
    result = ctx.progress.apply_async((key,))
    state = settle(lambda: result.state, lambda state: state != "PENDING")
    replies = ctx.app.control.inspect(timeout=3).query_task(result.id) or {}
    seen = [answer[result.id] for answer in replies.values() if result.id in answer]
    status, info = seen[0] if seen else (None, {})
    ctx.redis.rpush(f"{key}:go", "1")
    ctx.redis.expire(f"{key}:go", 600)
    return state, status, info.get("acknowledged"), outcome_of(result)


# A deliberate difference (docs/differences.md): an IdempotentTask is acks_late, so its message is
# acked when the body's transaction has committed, not when the body starts.
DIFFERENCES[("query_task_while_running", "idempotent")] = ("PROGRESS", "active", False, ("SUCCESS", "done"))


@scenario(expected=(2, ["SUCCESS", "SUCCESS"]))
def same_task_id_twice(ctx):
    """Two ``apply_async(task_id=X)``: plain Celery runs both."""
    key, task_id = ctx.key(), f"compat-{uuid.uuid4()}"
    ctx.count.apply_async((key,), task_id=task_id)
    ctx.count.apply_async((key,), task_id=task_id)
    ends = postruns(ctx, task_id, 2)
    return settle(lambda: runs(ctx, key), lambda n: n >= 2), ends


@scenario(expected=(("FAILURE", "NotRegistered", "'compat.unknown'"), 0))
def unknown_task(ctx):
    """``send_task`` of a name no worker knows: the worker stores FAILURE NotRegistered."""
    result = ctx.app.send_task("compat.unknown", (1,))
    return outcome_of(result), unsettled(ctx, result.id)


# -- events ----------------------------------------------------------------------------------------

def events_of_one_task(ctx, **options):
    """The events an ``app.events.Receiver`` sees for one task: one task-sent event (the sender's),
    and the worker's received, started, succeeded, in this order. Celery publishes task-sent just
    after the task message, from another process than the worker's events: it may come before or
    after them, so only its count is compared.

    Before Celery 5.7 a worker's event dispatcher drops a task event that a pool thread buffers
    while the event loop flushes the buffer (celery/celery#10434): on the threads pool
    task-started and task-succeeded, sent from the task's thread, are lost now and then, in plain
    Celery as in every mode, and more often beside beat's maintenance tasks, whose events are
    flushed meanwhile. There only task-sent and task-received (buffered by the event loop itself)
    are compared, once the task's result is stored."""
    app, task_id, probe = ctx.app, f"compat-{uuid.uuid4()}", f"probe-{uuid.uuid4()}"
    seen: list[str] = []
    listening = threading.Event()

    def on_event(event):
        if event.get("uuid") == probe:
            listening.set()
        elif event.get("uuid") == task_id:
            seen.append(event["type"])

    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": on_event})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False),
                                  daemon=True)
        thread.start()
        try:
            with app.events.default_dispatcher() as dispatcher:
                settle(lambda: dispatcher.send("compat-probe", uuid=probe) or listening.is_set(), bool)
            result = ctx.add.apply_async((1, 1), task_id=task_id, **options)
            if CELERY < (5, 7):
                settle(result.ready, bool)
                settle(lambda: list(seen), lambda events: "task-sent" in events and "task-received" in events)
            else:
                settle(lambda: list(seen), lambda events: "task-sent" in events and "task-succeeded" in events)
        finally:
            receiver.should_stop = True
            thread.join(TIMEOUT)
    events = [event for event in seen if event != "task-sent"]
    if CELERY < (5, 7):
        events = [event for event in events if event not in ("task-started", "task-succeeded")]
    return seen.count("task-sent"), events


@scenario(expected=(1, ["task-received", "task-started", "task-succeeded"]))
def events_of_a_task(ctx):
    return events_of_one_task(ctx)


@scenario(expected=(1, ["task-received", "task-started", "task-succeeded"]))
def events_of_a_task_with_a_countdown(ctx):
    return events_of_one_task(ctx, countdown=1)
