"""One test per private Celery/kombu touch point of ``celery_outbox.consumer.celery_internals``: each pins the
Celery or kombu behaviour it relies on, with real Celery and kombu objects (the memory
transport; Redis where only a real transport batches), so that an upgrade that changes one of
them fails here, by name."""

from __future__ import annotations

import inspect
import time
import uuid
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from celery import Celery, Task, bootsteps, concurrency, signals
from celery.app.task import Context
from celery.concurrency.solo import TaskPool
from celery.exceptions import WorkerLostError
from celery.utils.imports import symbol_by_name
from celery.utils.timer2 import Timer
from celery.worker import WorkController
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.request import Request
from kombu import Connection, Exchange, Queue
from kombu.transport import virtual

from celery_outbox.consumer import celery_internals as hooks
from celery_outbox.outbox import THREADED_POOL_MODULES
from tests.versions import CELERY

from ..celery_objects import delivered, request_of


def test_app_task_is_a_cached_property_built_from_task_cls(app):
    """``Celery.Task`` is cached in ``app.__dict__``; dropped there, it is built from ``task_cls`` again."""
    assert not hooks.app_task_base_used(app)
    first = app.Task
    assert hooks.app_task_base_used(app) and app.__dict__["Task"] is first

    class Base(Task):
        abstract = True

    hooks.set_app_task_base(app, Base)
    assert not hooks.app_task_base_used(app)
    assert issubclass(app.Task, Base)

    @app.task(name="t.after")
    def after() -> None:
        pass

    assert isinstance(after, Base)


def consumer_of(app: Celery, received: list[Any]) -> Consumer:
    """A real worker consumer, not started: its strategies and task handler built as the Tasks
    step builds them."""
    controller = SimpleNamespace(state=worker_state, use_eventloop=False)
    return Consumer(received.append, app=app, hostname="w@hooks", pool=TaskPool(), timer=Timer(),
                    controller=controller)


def test_a_swapped_task_class_gives_its_request_class_to_the_strategy_built_after_it(app):
    """``swap_task_class`` relies on the worker resolving ``task.Request`` when it builds a task's
    strategy (``Consumer.update_strategies`` -> ``Task.start_strategy``), after ``worker_init``."""

    @app.task(name="t.plain", shared=False)
    def plain(*args: Any) -> None:
        pass

    plain = app.tasks[plain.name]  # the task itself, not the proxy

    class Recorded(Request):
        pass

    cls = type(plain)
    swapped = type(cls.__name__, (cls,), {"Request": Recorded})
    hooks.swap_task_class(plain, swapped)
    assert app.tasks["t.plain"] is plain and type(plain) is swapped
    received: list[Any] = []
    consumer = consumer_of(app, received)
    consumer.update_strategies()
    consumer.create_task_handler()(delivered(app, "t.plain"))
    [request] = received
    worker_state.task_ready(request)  # the strategy reserved it
    assert isinstance(request, Recorded) and request.task is plain


def test_task_handler_is_made_by_create_task_handler_and_looks_tasks_up_in_strategies(app):
    """``Consumer.create_task_handler()`` makes the handler of every task message; it looks the
    task up in ``Consumer.strategies`` (missing: ``on_unknown_task``). The Tasks step is the one
    ``TASKS_STEP`` names, and it sets ``Consumer.task_consumer``."""

    @app.task(name="t.known", shared=False)
    def known(*args: Any) -> None:
        pass

    known = app.tasks[known.name]  # the task itself, not the proxy

    received: list[Any] = []
    consumer = consumer_of(app, received)
    consumer.update_strategies()
    assert "t.known" in hooks.task_strategies(consumer) and "t.unknown" not in hooks.task_strategies(consumer)
    unknown: list[Any] = []
    consumer.on_unknown_task = lambda body, message, exc: unknown.append(message)
    seen: list[Any] = []

    def wrap(handler: Any) -> Any:
        def guarded(message: Any) -> Any:
            seen.append(message)
            return handler(message)

        return guarded

    hooks.wrap_task_handler(consumer, wrap)
    handler = consumer.create_task_handler()
    handler(known_message := delivered(app, "t.known"))
    handler(unknown_message := delivered(app, "t.unknown"))
    assert seen == [known_message, unknown_message]
    assert [request.task_name for request in received] == ["t.known"]
    worker_state.task_ready(received[0])  # the strategy reserved it
    assert unknown == [unknown_message]

    tasks_step = symbol_by_name(hooks.TASKS_STEP)
    assert issubclass(tasks_step, bootsteps.StartStopStep) and hooks.TASKS_STEP in Consumer.Blueprint.default_steps
    assert hooks.task_consumer_channel(consumer) is None  # set by the Tasks step's start
    assert "task_consumer = c.app.amqp.TaskConsumer(" in inspect.getsource(tasks_step.start)


def test_consumer_timer_and_event_dispatcher(app):
    """``Consumer.timer`` schedules with ``call_after(seconds, fun, args)``; ``event_dispatcher`` is
    an attribute of every consumer (None until the Events step runs)."""
    consumer = consumer_of(app, [])
    assert hooks.consumer_event_dispatcher(consumer) is None
    called: list[Any] = []
    timer = consumer.timer
    try:
        hooks.call_later(consumer, 0.01, called.append, ("later",))
        deadline = time.monotonic() + 5
        while not called and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        timer.stop()
    assert called == ["later"]


class RecordingRequest(hooks.HookedRequest):
    def before_revoked_announced(self, reason: str, terminated: bool) -> None:
        self.announced = (reason, terminated, self.acknowledged)

    def resending_lost_attempt(self) -> Any:
        return resending_var_set(self)


_resending: ContextVar[Any] = ContextVar("test_resending", default=None)


class resending_var_set:
    def __init__(self, request: Any):
        self.request = request

    def __enter__(self) -> None:
        self.token = _resending.set(self.request)

    def __exit__(self, *exc: Any) -> None:
        _resending.reset(self.token)


def test_the_tracer_calls_a_task_with_its_own_call_after_pushing_its_request(app):
    """``tracer_pushed_request``: Celery's tracer (here ``apply``) pushes the request and calls a
    task with a ``__call__`` of its own; ``Task.__call__`` would push a second request."""

    class Custom(Task):
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(("call", self.request.id, len(self.request_stack.stack),
                         hooks.tracer_pushed_request(self, super().__call__)))
            return super().__call__(*args, **kwargs)

    seen: list[Any] = []

    @app.task(name="t.custom", base=Custom, shared=False, bind=True)
    def custom(self: Task) -> None:
        seen.append(("run", self.request.id, len(self.request_stack.stack)))

    custom = app.tasks[custom.name]  # the task itself, not the proxy
    custom.apply(task_id="the-id")
    assert seen[0] == ("call", "the-id", 1, True)
    assert seen[1][0] == "run" and seen[1][2] == 2, "Task.__call__ pushed a request of its own"
    seen.clear()
    custom()  # called directly: no request pushed by a tracer
    assert seen[0][3] is False


def test_revoked_announces_through_announce_revoked_before_the_ack(app):
    """``Request.revoked()`` of a revoked (or expired) message calls
    ``_announce_revoked(reason, terminated, signum, expired)``, which marks it REVOKED and acks it."""
    assert list(inspect.signature(Request._announce_revoked).parameters) == [
        "self", "reason", "terminated", "signum", "expired"]

    @app.task(name="t.revoked", shared=False)
    def revoked(*args: Any) -> None:
        pass

    revoked = app.tasks[revoked.name]  # the task itself, not the proxy

    request = request_of(app, revoked, RecordingRequest)
    worker_state.revoked.add(request.id)
    try:
        assert request.revoked() is True
    finally:
        worker_state.revoked.discard(request.id)
    assert request.announced == ("revoked", False, False)
    assert request.acknowledged

    expired = request_of(app, revoked, RecordingRequest, expires=-60)
    assert expired.revoked() is True
    assert expired.announced == ("expired", False, False)


def test_lost_attempts_are_resent_by_celery_from_5_7_and_handed_back_before():
    """``RESENDS_LOST_ATTEMPTS`` holds where Celery has ``retry_on_worker_lost`` (5.7): there a lost
    attempt is re-sent as its next retry, up to ``max_retries``; before, ``on_failure`` hands it
    back to the broker as it is (``reject_on_worker_lost``), with no cap for the inbox to mirror."""
    assert hooks.RESENDS_LOST_ATTEMPTS is (CELERY >= (5, 7))
    on_failure = inspect.getsource(Request.on_failure)
    assert ("retry_on_worker_lost" in on_failure) is hooks.RESENDS_LOST_ATTEMPTS
    assert "reject_on_worker_lost" in on_failure and "self.reject(requeue=requeue)" in on_failure


def test_celery_hands_back_at_the_hard_time_limit_from_5_7_and_fails_for_good_before():
    """``HANDS_BACK_AT_TIME_LIMIT`` holds where Celery has ``acks_on_timeout`` (5.7): the pool's
    failure of the timed-out job (``on_failure``) hands an ``acks_late`` task's message back when it
    is off; before, ``acks_on_failure_or_timeout`` acks the message or drops it."""
    assert hooks.HANDS_BACK_AT_TIME_LIMIT is (CELERY >= (5, 7))
    on_failure = inspect.getsource(Request.on_failure)
    assert ("self.task.acks_on_timeout" in on_failure) is hooks.HANDS_BACK_AT_TIME_LIMIT
    assert "self.reject(requeue=False)" in on_failure


def test_retry_worker_lost_resends_through_signature_from_request(app):
    """Celery 5.7 (``retry_on_worker_lost``): ``on_failure`` of a ``WorkerLostError`` calls
    ``_retry_worker_lost(exc, exc_info)``, which re-sends the task as its next retry through
    ``task.signature_from_request(request._context, ...).apply_async()``."""
    if not hasattr(Request, "_retry_worker_lost"):
        pytest.skip("Celery < 5.7 has no retry_on_worker_lost")
    assert list(inspect.signature(Request._retry_worker_lost).parameters) == ["self", "exc", "exc_info"]
    assert "signature_from_request(" in inspect.getsource(Request._retry_worker_lost)

    @app.task(name="t.lost", shared=False, acks_late=True, retry_on_worker_lost=True, max_retries=3)
    def lost(*args: Any) -> None:
        pass

    lost = app.tasks[lost.name]  # the task itself, not the proxy

    request = request_of(app, lost, RecordingRequest)
    published: list[tuple[Any, Any]] = []

    def on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append((headers, _resending.get()))

    signals.before_task_publish.connect(on_publish, weak=False)
    try:
        try:
            raise WorkerLostError("lost")
        except WorkerLostError:
            request.on_failure(ExceptionInfo(), send_failed_event=False, return_ok=True)
    finally:
        signals.before_task_publish.disconnect(on_publish)
    [(headers, resending)] = published
    assert headers["id"] == request.id and headers["retries"] == 1
    assert resending is request, "published inside resending_lost_attempt()"
    assert request.acknowledged


def test_request_context_is_the_context_the_task_sees(app):
    """``Request._context`` is a cached ``Context`` built from the message's headers."""

    @app.task(name="t.context", shared=False)
    def context(*args: Any) -> None:
        pass

    context = app.tasks[context.name]  # the task itself, not the proxy

    request = request_of(app, context)
    ctx = hooks.request_context(request)
    assert isinstance(ctx, Context) and ctx is request._context is hooks.request_context(request)
    assert ctx.id == request.id and ctx.retries == 0 and ctx.delivery_info["routing_key"] == app.conf.task_default_queue


def test_exception_with_traceback_carries_the_pool_processs_exception():
    """billiard's prefork pool sends a task's exception back wrapped; ``exc`` is the original."""
    error = WorkerLostError("lost")
    try:
        raise error
    except WorkerLostError as caught:
        wrapped = ExceptionWithTraceback(caught, caught.__traceback__)
    assert wrapped.exc is error
    assert hooks.unwrap_exception(wrapped) is error
    assert hooks.unwrap_exception(error) is error


def test_worker_init_sees_the_pool_class_and_concurrency_as_given(app):
    """At ``worker_init`` (sent by ``WorkController.setup_instance``) ``WorkController.pool_cls`` is
    still what was given (an alias here) and ``concurrency`` the number; the threaded pools' aliases name the modules
    the engine sizing knows."""
    for alias in ("threads", "gevent", "eventlet"):
        assert concurrency.ALIASES[alias].split(":")[0] in THREADED_POOL_MODULES
    seen: list[tuple[Any, Any]] = []

    def on_init(sender: Any = None, **_: Any) -> None:
        seen.append((hooks.pool_module(sender), hooks.worker_concurrency(sender)))

    signals.worker_init.connect(on_init, weak=False)
    try:
        WorkController(app=app, pool_cls="threads", concurrency=3, hostname="w@hooks", without_mingle=True)
    finally:
        signals.worker_init.disconnect(on_init)
    assert seen == [("celery.concurrency.thread", 3)]
    assert hooks.worker_concurrency(SimpleNamespace(concurrency="auto")) >= 1


class Marked:
    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any):
        self.seen_payload = payload
        super().__init__(payload, channel=channel, **kwargs)


def test_virtual_transports_build_messages_through_channel_message():
    """A virtual channel builds every delivered message with ``self.Message(payload, channel=self)``:
    by ``basic_get`` and for a consumer; the mixin's ``__init__`` signature is the transport's."""
    assert list(inspect.signature(virtual.Message.__init__).parameters)[:3] == ["self", "payload", "channel"]
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection("memory://") as conn:
        channel = conn.channel()
        hooks.build_channel_messages_with(channel, Marked)
        hooks.build_channel_messages_with(channel, Marked)  # once
        assert channel.Message.__mro__[1:3] == (Marked, virtual.Message)
        producer = conn.Producer(channel)
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        got = queue.bind(channel).get()
        assert isinstance(got, Marked) and got.payload == {"n": 1} and isinstance(got.seen_payload, dict)
        received: list[Any] = []
        producer.publish({"n": 2}, exchange=queue.exchange, routing_key=name)
        with conn.Consumer(queue, channel=channel, callbacks=[lambda body, message: received.append(message)]):
            conn.drain_events(timeout=2)
        assert isinstance(received[0], Marked) and received[0].payload == {"n": 2}
        other = conn.channel()
        assert not issubclass(other.Message, Marked), "per channel"
        channel.close()
        other.close()
