"""One test per private Celery/kombu touch point of ``celery_outbox.celery_hooks``: each pins the
Celery or kombu behaviour the hook relies on, with real Celery and kombu objects (the memory
transport; Redis where only a real transport batches), so that an upgrade that changes one of them
fails here, by name."""

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
from celery.app.amqp import AMQP
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

from celery_outbox.core import celery_hooks as hooks
from celery_outbox.outbox import THREADED_POOL_MODULES
from tests.brokers import counted_acquires
from tests.services import require
from tests.versions import CELERY


@pytest.fixture
def app():
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker="memory://", backend="disabled://", set_as_current=False)
    app.conf.task_default_queue = name  # the memory transport's queues are shared by the process
    yield app
    app.close()


class RecordingProducer:
    """Stands in for a kombu Producer: records each publish (what ``envelope.capture`` relies on)."""

    def __init__(self, connection: Any = None):
        self.connection = connection
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.calls.append((body, kwargs))

    def revive(self, channel: Any) -> None:
        pass


def task_message(app: Celery, name: str = "t.add", sent_event: bool = False, **options: Any) -> Any:
    return app.amqp.create_task_message(str(uuid.uuid4()), name, (1, 2), {}, create_sent_event=sent_event, **options)


def delivered(app: Celery, name: str = "t.add", **options: Any) -> Any:
    """A task message as the worker receives it: published to and read from the memory broker."""
    message = task_message(app, name, **options)
    with app.connection_for_write() as conn:
        queue = app.amqp.queues[app.conf.task_default_queue]
        with app.amqp.Producer(conn) as producer:
            app.amqp.send_task_message(producer, name, message, queue=queue, declare=[queue])
        received = queue.bind(conn.default_channel).get(accept=["json"])
    assert received is not None
    return received


def request_of(app: Celery, task: Task, cls: type = Request, **options: Any) -> Request:
    message = delivered(app, task.name, **options)
    return cls(message, app=app, task=task, on_ack=lambda *a: None, on_reject=lambda *a: None,
               hostname="w@hooks", eventer=None)


# -- publishing ----------------------------------------------------------------------------------


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery 5.7 added AMQP._retry_publish and its ContextVar; "
                    "before it the hook sets a stand-in nothing reads")
def test_callback_publish_retry_is_what_makes_the_sender_retry_over_time(app):
    """Celery >= 5.7: inside ``AMQP._retry_publish`` the ContextVar is set and ``send_task_message``
    publishes through its own retry loop (``retry=False`` per try); ``without_callback_publish_retry``
    gives the one plain ``publish`` call the capture records."""
    from celery.app import amqp as celery_amqp

    assert isinstance(celery_amqp._callback_publish_retry, ContextVar)
    with app.connection_for_write() as conn:
        looping, plain = RecordingProducer(conn), RecordingProducer(conn)

        def send(producer: RecordingProducer) -> None:
            app.amqp.send_task_message(producer, "t.add", task_message(app), retry=True)

        def in_callback_publish() -> None:
            assert celery_amqp._callback_publish_retry.get() is True
            send(looping)
            with hooks.without_callback_publish_retry():
                send(plain)

        app.amqp._retry_publish(in_callback_publish)
    assert [kwargs["retry"] for _, kwargs in looping.calls] == [False], "Celery's own retry loop"
    assert [kwargs["retry"] for _, kwargs in plain.calls] == [True], "the call as the caller made it"


def test_send_task_message_publishes_once_with_the_keywords_the_capture_reads(app):
    """``envelope.capture`` records ``producer.publish(body, **kwargs)`` and splits the keywords into
    routing, sending options (``_SENDING_OPTIONS``) and properties."""
    producer = RecordingProducer()
    app.amqp.send_task_message(producer, "t.add", task_message(app))
    [(body, kwargs)] = producer.calls
    assert body == ((1, 2), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    timeouts = {"timeout", "confirm_timeout"} if CELERY >= (5, 5) else set()  # passed on since Celery 5.5
    assert {"exchange", "routing_key", "serializer", "compression", "retry", "retry_policy", "delivery_mode",
            "declare", "headers", *timeouts} <= set(kwargs)
    assert kwargs["headers"]["task"] == "t.add"


def test_send_task_uses_a_given_producer_as_is_and_acquires_none(app, monkeypatch):
    """``install_send_task_producer`` relies on ``Celery.send_task``'s parameters (``producer`` after
    ``task_id``, then ``connection``; ``publisher`` its alias) and on a given producer being
    used as is: Celery enters its ``connection._reraise_as_library_errors()`` and hands it to
    the sender, and takes none from the pool."""
    names = list(inspect.signature(Celery.send_task).parameters)
    assert names[:9] == ["self", "name", "args", "kwargs", "countdown", "eta", "task_id", "producer", "connection"]
    assert "publisher" in names
    acquired = counted_acquires(app, monkeypatch)
    given = RecordingProducer(Connection("memory://"))
    app.send_task("t.add", (1, 2), producer=given)
    assert acquired == [] and len(given.calls) == 1
    app.send_task("t.add", (1, 2))
    assert acquired == [1], "with no producer given, Celery takes one from the pool"


def test_an_installed_send_task_takes_the_producer_offered_unless_the_caller_gave_one(app, monkeypatch):
    """The wrapper gives ``send_task`` the producer ``producer_for_send`` offers when the caller
    gave none (by keyword or position, nor a connection or publisher), and leaves the call as it
    is when it offers None; installing it twice with one owner wraps once."""
    acquired = counted_acquires(app, monkeypatch)
    offered = RecordingProducer(Connection("memory://"))
    offers: list[Any] = [offered]
    owner = object()
    hooks.install_send_task_producer(app, owner, lambda: offers[0])
    hooks.install_send_task_producer(app, owner, lambda: offers[0])
    app.send_task("t.add", (1, 2))
    assert len(offered.calls) == 1 and acquired == []
    given = RecordingProducer(Connection("memory://"))
    app.send_task("t.add", (1, 2), {}, None, None, None, given)
    app.send_task("t.add", (1, 2), publisher=given)
    assert len(given.calls) == 2 and len(offered.calls) == 1, "a producer the caller gave is used"
    with Connection("memory://") as connection:
        app.send_task("t.add", (1, 2), connection=connection)
    assert len(offered.calls) == 1, "a connection the caller gave makes its own producer"
    offers[0] = None
    app.send_task("t.add", (1, 2))
    assert len(offered.calls) == 1 and acquired == [1], "nothing offered: Celery acquires as usual"


@pytest.mark.redis
def test_only_a_backend_that_declares_on_send_uses_the_producer(app):
    """``backend_ignores_producer``: the base backend's ``on_task_call`` does nothing and the Redis
    one subscribes on its own connection, so neither reads the producer (a producer with no
    attributes passes); the rpc backend declares its reply queue on the producer's channel."""
    task_id = str(uuid.uuid4())
    assert hooks.backend_ignores_producer(app.backend)
    app.backend.on_task_call(object(), task_id)
    redis_app = Celery("hooks-redis", broker="memory://", backend=require("redis"), set_as_current=False)
    try:
        assert hooks.backend_ignores_producer(redis_app.backend)
        redis_app.backend.on_task_call(object(), task_id)
    finally:
        redis_app.close()
    rpc_app = Celery("hooks-rpc", broker="memory://", backend="rpc://", set_as_current=False)
    try:
        assert not hooks.backend_ignores_producer(rpc_app.backend)
        with pytest.raises(AttributeError, match="channel"):
            rpc_app.backend.on_task_call(object(), task_id)
    finally:
        rpc_app.close()


def test_create_task_sender_builds_the_sender_every_publish_goes_through(app):
    """``install_task_sender`` swaps ``app.amqp_cls`` for a subclass overriding
    ``AMQP._create_task_sender()``; ``app.amqp`` (a cached property) is rebuilt from it, and
    ``send_task``, ``apply_async`` and ``delay`` all call the sender it returns."""
    assert list(inspect.signature(AMQP._create_task_sender).parameters) == ["self"]
    assert "send_task_message" in vars(AMQP)  # a cached property returning _create_task_sender()
    built_before = app.amqp
    assert app.__dict__["amqp"] is built_before
    sent: list[str] = []
    owner = object()

    def wrap(amqp: AMQP, celery_sender: Any) -> Any:
        assert amqp is app.amqp and callable(celery_sender)

        def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> None:
            sent.append(name)

        return send_task_message

    hooks.install_task_sender(app, owner, wrap)
    hooks.install_task_sender(app, owner, wrap)  # once per owner
    assert app.amqp is not built_before and isinstance(app.amqp, symbol_by_name("celery.app.amqp:AMQP"))
    assert type(app.amqp).__mro__[1] is AMQP, "subclassed once"

    @app.task(name="t.add")
    def add(x: int, y: int) -> int:
        return x + y

    app.send_task("t.other")
    add.apply_async((1, 2))
    add.delay(1, 2)
    assert sent == ["t.other", "t.add", "t.add"]


def test_event_dispatcher_is_the_default_one_send_task_message_publishes_task_sent_with(app):
    """``AMQP._event_dispatcher`` is the dispatcher ``send_task_message`` calls
    ``publish('task-sent', fields, producer, retry=..., retry_policy=...)`` on when the caller gives
    none: what ``sent_events.RecordingDispatcher`` stands in for and ``SentEvent.send`` calls later."""
    app.conf.task_send_sent_event = True
    dispatcher = hooks.default_event_dispatcher(app.amqp)
    assert dispatcher is app.amqp._event_dispatcher
    calls: list[tuple[Any, ...]] = []
    dispatcher.publish = lambda type, fields, producer, **options: calls.append((type, fields, producer, options))
    producer = RecordingProducer()
    message = task_message(app, sent_event=True)
    app.amqp.send_task_message(producer, "t.add", message)
    [(kind, fields, used, options)] = calls
    assert (kind, used) == ("task-sent", producer)
    assert fields["uuid"] == message.headers["id"] and fields["name"] == "t.add"
    assert set(options) == {"retry", "retry_policy"}


# -- the app's task base and the worker's tasks ---------------------------------------------------


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


def test_store_errors_reads_the_messages_ignore_result_from_5_6():
    """``STORE_ERRORS_READS_THE_MESSAGE``: Celery's ``Request.store_errors`` reads the request's own
    ``ignore_result`` (the message's header) where it holds, the task's alone before."""
    source = inspect.getsource(Request.store_errors.fget)
    assert ("self._ignore_result" in source) is hooks.STORE_ERRORS_READS_THE_MESSAGE
    assert ("self.task.ignore_result" in source) is not hooks.STORE_ERRORS_READS_THE_MESSAGE


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


# -- kombu ---------------------------------------------------------------------------------------


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


def test_virtual_publish_looks_exchange_bindings_up_through_get_table(monkeypatch):
    """A virtual channel's publish to an exchange looks its bindings up through ``self.get_table``,
    so an instance attribute answers for the class's; removed, the class's answers again."""
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection("memory://") as conn:
        channel = conn.channel()
        lookups: list[str] = []
        real = type(channel).get_table
        monkeypatch.setattr(type(channel), "get_table", lambda self, exchange: lookups.append(exchange)
                            or real(self, exchange))
        producer = conn.Producer(channel)
        producer.publish({}, exchange=queue.exchange, routing_key=name, declare=[queue])
        assert lookups == [name]
        hooks.cache_exchange_bindings(channel)
        for _ in range(3):
            producer.publish({}, exchange=queue.exchange, routing_key=name)
        assert lookups == [name, name], "looked up once while cached"
        hooks.uncache_exchange_bindings(channel)
        assert "get_table" not in channel.__dict__
        producer.publish({}, exchange=queue.exchange, routing_key=name)
        assert lookups == [name, name, name]
        assert channel._size(name) == 5
        channel.close()


@pytest.mark.redis
def test_producer_batch_defers_publishes_until_it_exits():
    """kombu 5.7: ``Producer.supports_batch_publish`` says whether ``Producer.batch(max_size=...)``
    defers publishes (Redis does, memory does not); a batch flushes at its exit and discards
    what it holds when it exits with an exception."""
    with Connection("memory://") as conn:
        assert not hooks.can_batch_publish(conn.Producer())
    url = require("redis")
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection(url) as conn:
        producer = conn.Producer()
        if not hasattr(producer, "batch"):
            pytest.skip("kombu < 5.7 has no Producer.batch")
        assert hooks.can_batch_publish(producer)
        bound = queue.bind(producer.channel)
        bound.declare()
        try:
            batch = hooks.start_publish_batch(producer, 100)
            producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name)
            assert bound.get() is None, "deferred"
            batch.__exit__(None, None, None)
            assert bound.get(no_ack=True).payload == {"n": 1}
            batch = hooks.start_publish_batch(producer, 100)
            producer.publish({"n": 2}, exchange=queue.exchange, routing_key=name)
            batch.__exit__(RuntimeError, RuntimeError("x"), None)
            assert bound.get() is None, "discarded"
        finally:
            bound.delete()


@pytest.mark.redis
def test_redis_commands_make_a_client_each_and_a_kept_one_serves_them_all(monkeypatch):
    """kombu 5: the Redis channel's ``conn_or_acquire()`` makes a client through ``_create_client()``
    for every command (a publish makes at least one). ``keep_redis_client`` on a connected producer
    gives every command of its channel one client, made once per channel; ``unkeep_redis_client``
    brings kombu's own back. A producer not connected yet is left alone, and nothing connects."""
    url = require("redis")
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    made: list[Any] = []
    with Connection(url) as conn:
        producer = conn.Producer()
        assert hooks.keep_redis_client(producer) is None and not conn.connected, "nothing connects"
        channel = producer.channel
        real = type(channel)._create_client  # the class of the module loaded now (a test may reload kombu's)
        monkeypatch.setattr(type(channel), "_create_client",
                            lambda self, *args, **kwargs: made.append(self) or real(self, *args, **kwargs))
        queue.bind(channel).declare()
        before = len(made)
        producer.publish({"n": 0}, exchange=queue.exchange, routing_key=name)
        assert len(made) > before, "kombu makes a client per command"
        assert hooks.keep_redis_client(producer) is channel
        kept = len(made)
        for n in range(1, 4):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=name)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire(client=None) as second:
            assert first is second, "kombu calls it with and without its keyword"
        with channel.conn_or_acquire(client=conn) as given:
            assert given is conn, "a client given is used"
        assert len(made) == kept, "no client made while one is kept"
        hooks.unkeep_redis_client(channel)
        assert "conn_or_acquire" not in channel.__dict__
        assert hooks.keep_redis_client(producer) is channel and len(made) == kept, "made once per channel"
        hooks.unkeep_redis_client(channel)
        assert channel._size(name) == 4
        queue.bind(channel).delete()
        other = conn.channel()
        producer.revive(other)
        monkeypatch.setattr(type(other), "_create_client", lambda self, *args, **kwargs: 1 / 0)
        assert hooks.keep_redis_client(producer) is None, "a failure on the way leaves kombu's own"
        assert "conn_or_acquire" not in other.__dict__
        other.close()
    assert hooks.keep_redis_client(SimpleNamespace()) is None, "not a kombu producer: nothing changes"
    with Connection("memory://") as conn:
        producer = conn.Producer()
        assert producer.channel is not None
        assert hooks.keep_redis_client(producer) is None, "another transport: nothing changes"


def test_a_pooled_producer_is_revived_on_every_acquire_and_a_kept_one_is_not(app):
    """kombu 5: a producer of the pool (``ProducerPool.connections``, its connection pool, and
    ``ProducerPool.Producer``) is revived on every acquire: its ``_channel`` a ``ChannelPromise``,
    its exchange a new copy. A connection's ``_default_channel`` is the channel ``default_channel``
    gave; connecting afresh makes a new one. ``kept_pooled_producer`` keeps its producer
    on the pooled connection: the same producer, exchange and channel from block to block,
    revived once its connection was lost."""
    from kombu.utils.functional import ChannelPromise

    pool = app.amqp.producer_pool
    assert pool.connections is not None and pool.Producer is not None
    with app.producer_or_acquire() as pooled:
        assert isinstance(pooled._channel, ChannelPromise)
        first_exchange = pooled.exchange
    with app.producer_or_acquire() as pooled:
        assert pooled.exchange is not first_exchange, "revived: a new copy of its exchange"
    with hooks.kept_pooled_producer(app) as kept:
        channel, exchange = kept.channel, kept.exchange
        assert kept.connection._default_channel is channel
    with hooks.kept_pooled_producer(app) as again:
        assert again is kept and again.exchange is exchange and again.channel is channel, "kept as it was"
        again.connection.collect()  # the connection lost, as after a broker failure
        assert not again.connection.connected
    with hooks.kept_pooled_producer(app) as revived:
        assert revived is kept and isinstance(revived._channel, ChannelPromise), "revived, to connect afresh"
        assert revived.channel is not channel
