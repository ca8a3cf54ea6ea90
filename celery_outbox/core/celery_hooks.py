"""Every place celery-outbox relies on a private (undocumented, underscore-prefixed or internal)
part of Celery or kombu, and nowhere else.

Each function or class below touches one such internal; its docstring says which, why, and for
which versions it is known to hold (checked against Celery 5.7 and kombu 5.7, the versions
the tests run). Each has a test in
``tests/unit/test_celery_hooks.py`` that pins the Celery or kombu behaviour it relies on, so a
Celery or kombu upgrade that changes one of them fails there first, by name, instead of somewhere
deep in an integration test. The rest of the package uses only what this module exports and
Celery's and kombu's public API.

Where each is used: ``without_callback_publish_retry`` (envelope), ``install_task_sender``,
``default_event_dispatcher``, ``install_send_task_producer`` and ``backend_ignores_producer``
(publish_hook), ``app_task_base_used``, ``set_app_task_base``,
``pool_module`` and ``worker_concurrency`` (outbox), ``HookedRequest``, ``RESENDS_LOST_ATTEMPTS``,
``HANDS_BACK_AT_TIME_LIMIT``, ``request_context`` and ``unwrap_exception`` (worker_request),
``tracer_pushed_request`` and ``swap_task_class`` (tasks),
``STORE_ERRORS_READS_THE_MESSAGE`` (results),
``TASKS_STEP``, ``wrap_task_handler``, ``task_consumer_channel``, ``task_strategies``,
``call_later``, ``consumer_event_dispatcher`` and ``build_channel_messages_with`` (guard),
``can_batch_publish``, ``start_publish_batch``, ``cache_exchange_bindings``,
``uncache_exchange_bindings``, ``keep_redis_client``, ``unkeep_redis_client`` and
``kept_pooled_producer`` (broker).

Two undocumented call shapes are relied on without touching a private name, and are pinned by
the same tests: ``send_task_message`` publishes with one ``producer.publish(body, **kwargs)``
call (``envelope._RecordingProducer`` records it), and sends ``task-sent`` with
``dispatcher.publish(type, fields, producer, retry=..., retry_policy=...)``
(``sent_events.RecordingDispatcher`` records it).
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

from billiard.einfo import ExceptionWithTraceback
from celery import VERSION as CELERY_VERSION
from celery.app.task import Task
from celery.worker.request import Request
from kombu.exceptions import LimitExceeded
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.transport import virtual
from kombu.utils.functional import ChannelPromise

__all__ = [
    "RESENDS_LOST_ATTEMPTS",
    "HANDS_BACK_AT_TIME_LIMIT",
    "STORE_ERRORS_READS_THE_MESSAGE",
    "TASKS_STEP",
    "HookedRequest",
    "app_task_base_used",
    "backend_ignores_producer",
    "build_channel_messages_with",
    "cache_exchange_bindings",
    "call_later",
    "can_batch_publish",
    "consumer_event_dispatcher",
    "default_event_dispatcher",
    "install_send_task_producer",
    "install_task_sender",
    "pool_module",
    "request_context",
    "set_app_task_base",
    "start_publish_batch",
    "swap_task_class",
    "tracer_pushed_request",
    "task_consumer_channel",
    "task_strategies",
    "uncache_exchange_bindings",
    "unwrap_exception",
    "without_callback_publish_retry",
    "worker_concurrency",
    "wrap_task_handler",
]

# -- publishing: the app's AMQP and its task sender (publish_hook.py, envelope.py) -----------------

try:  # Celery >= 5.7 re-publishes worker callbacks with its own retry loop; we defer instead
    from celery.app.amqp import _callback_publish_retry
except ImportError:  # pragma: no cover - older Celery
    _callback_publish_retry = contextvars.ContextVar("_callback_publish_retry_unused", default=False)


@contextmanager
def without_callback_publish_retry() -> Iterator[None]:
    """While the block runs, Celery's sender publishes with a plain ``producer.publish`` call.

    Touches ``celery.app.amqp._callback_publish_retry`` (a ``ContextVar``, Celery >= 5.7; a
    stand-in before): ``AMQP._retry_publish`` sets it while a worker publishes a task's callbacks,
    and ``send_task_message`` then wraps ``producer.publish`` in ``retry_over_time``. The outbox
    captures the publish instead (``envelope.capture``): the recording producer must see the one
    ``publish`` call, not a retry loop around it."""
    token = _callback_publish_retry.set(False)
    try:
        yield
    finally:
        _callback_publish_retry.reset(token)


def install_task_sender(app: Any, owner: Any, wrap: Callable[[Any, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make ``app``'s AMQP send every task message through ``wrap(amqp, celery_sender)``.

    Touches ``Celery.amqp_cls`` (a class or a ``"module:Class"`` string) and
    ``AMQP._create_task_sender`` (Celery 4 to 5.7): the app's AMQP class is swapped for a subclass
    whose ``_create_task_sender`` wraps the sender Celery builds, which ``AMQP.send_task_message``
    (a cached property) returns and ``Task.apply_async``, ``Celery.send_task``, retries, canvas
    and worker callbacks all call. ``app.amqp`` is a cached property: an AMQP built before the
    swap is dropped from ``app.__dict__`` so that it is rebuilt from the new class. Calling it
    again with the same ``owner`` changes nothing."""
    base = app.amqp_cls
    if isinstance(base, str):
        from celery.utils.imports import symbol_by_name

        base = symbol_by_name(base)
    if getattr(base, "_celery_outbox", None) is owner:
        return

    class OutboxAMQP(base):  # type: ignore[misc, valid-type]
        _celery_outbox = owner

        def _create_task_sender(self) -> Callable[..., Any]:
            return wrap(self, super()._create_task_sender())

    app.amqp_cls = OutboxAMQP
    app.__dict__.pop("amqp", None)


def install_send_task_producer(app: Any, owner: Any, producer_for_send: Callable[[], Any]) -> None:
    """Make ``app.send_task`` (which ``Task.apply_async`` calls) use ``producer_for_send()`` when
    the caller gives no producer, instead of acquiring one from the app's pool for the call;
    ``producer_for_send`` returns None to leave Celery's acquire as it is.

    Touches the call shape of ``Celery.send_task`` (Celery 5): after ``name`` come ``args``,
    ``kwargs``, ``countdown``, ``eta``, ``task_id``, ``producer``, ``connection``, and
    ``publisher`` is an alias of ``producer``; given a producer it acquires none, and uses it only
    as ``P.connection._reraise_as_library_errors()``, ``backend.on_task_call(P, task_id)`` and
    ``amqp.send_task_message(P, ...)``. The wrapper is an attribute of the app instance. Calling
    it again with the same ``owner`` changes nothing."""
    celery_send_task = app.send_task
    if getattr(celery_send_task, "_celery_outbox", None) is owner:
        return

    @functools.wraps(celery_send_task)
    def send_task(name: str, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 6 and kwargs.get("producer") is None and kwargs.get("connection") is None \
                and kwargs.get("publisher") is None:
            producer = producer_for_send()
            if producer is not None:
                kwargs["producer"] = producer
        return celery_send_task(name, *args, **kwargs)

    send_task._celery_outbox = owner  # type: ignore[attr-defined]
    app.send_task = send_task


def backend_ignores_producer(backend: Any) -> bool:
    """Whether ``backend.on_task_call(producer, task_id)``, which ``Celery.send_task`` calls before
    it sends, leaves the producer alone. Touches ``on_task_call`` of Celery 5's backends: the base
    one does nothing and the Redis one subscribes to the result's channel on its own connection;
    the rpc one declares its reply queue on the producer's channel, as may a backend of the
    user's own."""
    call = getattr(type(backend), "on_task_call", None)
    known = _PRODUCERLESS_TASK_CALLS.get(call)
    if known is None:
        from celery.backends.base import BaseBackend

        producerless = [BaseBackend.on_task_call]
        # not imported unless a Redis backend exists: importing it needs the redis package
        redis_backends = sys.modules.get("celery.backends.redis")
        if redis_backends is not None:
            producerless.append(redis_backends.RedisBackend.on_task_call)
        known = _PRODUCERLESS_TASK_CALLS[call] = call in producerless
    return known


_PRODUCERLESS_TASK_CALLS: dict[Any, bool] = {}


def default_event_dispatcher(amqp: Any) -> Any:
    """The event dispatcher Celery's sender sends ``task-sent`` events with when the caller gives none.

    Touches ``AMQP._event_dispatcher`` (Celery 4 to 5.7, a cached property): ``_create_task_sender``
    takes it as ``default_evd`` and ``send_task_message`` calls its ``publish('task-sent', fields,
    producer, retry=..., retry_policy=...)``. The outbox records that call and makes it later on
    the same dispatcher (``sent_events``), so it must be the very object Celery would use."""
    return amqp._event_dispatcher


# -- the app's task base and the worker's tasks (outbox.py, tasks.py) ----------------------------


def app_task_base_used(app: Any) -> bool:
    """Whether ``app.Task`` (the task base built from ``app.task_cls``) was already built.

    Touches ``Celery.Task``, a cached property (Celery 4 to 5.7) whose value lives in
    ``app.__dict__``."""
    return "Task" in app.__dict__


def set_app_task_base(app: Any, cls: type) -> None:
    """Make ``cls`` the app's task base: tasks defined from now on derive from it.

    Touches ``Celery.task_cls`` and the cached property ``Celery.Task`` (Celery 4 to 5.7): a
    ``Task`` already built from the old ``task_cls`` is dropped from ``app.__dict__`` so that the
    next ``app.Task`` (and ``@app.task``) is built from ``cls``."""
    app.__dict__.pop("Task", None)
    app.task_cls = cls


def tracer_pushed_request(task: Any, next_call: Callable[..., Any]) -> bool:
    """Whether ``next_call`` (the next ``__call__`` of ``task``'s classes) is Celery's own
    ``Task.__call__`` while Celery's tracer runs the task, so that the body can run directly.

    Relies on ``celery.app.trace.build_tracer`` (Celery 4 to 5.7, a worker and ``Task.apply``):
    a task with a ``__call__`` of its own is called as ``task(*args, **kwargs)`` after the tracer
    pushed the task and its request (``request.called_directly`` is False); a task without one
    is run through ``task.run``. ``Task.__call__`` pushes the task and a new request again."""
    from celery import Task

    return not task.request.called_directly and getattr(next_call, "__func__", None) is Task.__call__


def swap_task_class(task: Any, cls: type) -> None:
    """Give a registered task object the class ``cls`` (a subclass of its own class) in place.

    Relies on Celery (4 to 5.7) reading a task's ``Request`` class and ``__call__`` only when the
    worker builds its strategies (``Consumer.update_strategies``, ``Task.start_strategy``, which
    resolves ``task.Request``) and tracers, after ``worker_init``; and on ``app.tasks`` holding the
    task objects themselves, which the user's modules refer to, so the object must stay the same."""
    task.__class__ = cls


class HookedRequest(Request):
    """The worker's request class with two hooks into its private steps.

    Touches ``Request._announce_revoked(reason, terminated, signum, expired)`` (Celery 5 up to
    5.7), which ``Request.revoked()`` (a revoked or expired message, before it runs) and
    ``Request.terminate`` call to mark the task REVOKED and ack its message, and
    ``Request._retry_worker_lost(exc, exc_info)`` (Celery 5.7, ``retry_on_worker_lost``), which
    ``on_failure`` calls for a ``WorkerLostError`` to re-send the task as its next retry through
    ``task.signature_from_request(request._context, ...).apply_async()``."""

    def before_revoked_announced(self, reason: str, terminated: bool) -> None:
        """Runs before Celery marks the task REVOKED and acks its message."""

    def resending_lost_attempt(self) -> ContextManager[Any]:
        """Entered while Celery re-sends the attempt of a lost worker process."""
        from contextlib import nullcontext

        return nullcontext()

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> None:
        self.before_revoked_announced(reason, terminated)
        super()._announce_revoked(reason, terminated, signum, expired)

    def _retry_worker_lost(self, exc: BaseException, exc_info: Any) -> bool:
        with self.resending_lost_attempt():
            return super()._retry_worker_lost(exc, exc_info)


#: Celery's ``Request.store_errors`` (whether a FAILURE or REVOKED is stored) reads the message's
#: ``ignore_result`` header from Celery 5.6 (``Request._ignore_result``); before 5.6 the task's
#: ``ignore_result`` alone.
STORE_ERRORS_READS_THE_MESSAGE = (CELERY_VERSION.major, CELERY_VERSION.minor) >= (5, 6)

#: Celery re-sends the attempt of a lost pool process as its next retry, up to ``max_retries``
#: (``retry_on_worker_lost``, ``Request._retry_worker_lost``: Celery 5.7); before 5.7 it hands every
#: lost attempt of an ``acks_late`` task with ``reject_on_worker_lost`` back to the broker as it is.
RESENDS_LOST_ATTEMPTS = hasattr(Request, "_retry_worker_lost")

#: At an ``acks_late`` task's hard time limit Celery acks the message when the task's
#: ``acks_on_timeout`` is on and hands it back to the broker when it is off (Celery 5.7); before 5.7
#: ``acks_on_failure_or_timeout`` alone decides, and a message it does not ack is dropped (rejected,
#: not requeued): the task fails for good either way.
HANDS_BACK_AT_TIME_LIMIT = hasattr(Task, "acks_on_timeout")


def request_context(request: Any) -> Any:
    """The task ``Context`` a worker's ``Request`` runs with, as the task sees it in ``task.request``.

    Touches ``Request._context`` (Celery 4 to 5.7, a cached property): the same ``Context``
    Celery passes to the backend, the signals and ``signature_from_request``."""
    return request._context


def unwrap_exception(exc: BaseException) -> BaseException:
    """The exception a pool process raised, as the worker's main process sees it.

    Touches billiard's ``ExceptionWithTraceback`` (billiard 4): the prefork pool sends an
    exception back wrapped in it, and ``Request.on_failure`` receives it as
    ``exc_info.exception``; the original is its ``exc``."""
    return getattr(exc, "exc", exc) if isinstance(exc, ExceptionWithTraceback) else exc


def pool_module(worker: Any) -> str:
    """The module of the worker's pool class, without importing it.

    Touches ``WorkController.pool_cls`` (a class, an alias such as ``"threads"`` or a
    ``"module:Class"`` string, as set before the pool is built, at ``worker_init``) and
    ``celery.concurrency.ALIASES`` (Celery 5)."""
    from celery import concurrency

    pool = worker.pool_cls
    if isinstance(pool, str):  # an alias or "module:Class": read, not imported
        return concurrency.ALIASES.get(pool, pool).split(":", 1)[0]
    return getattr(pool, "__module__", "")


def worker_concurrency(worker: Any) -> int:
    """How many tasks the worker runs at once: ``WorkController.concurrency`` (Celery 5; 0 or
    None at ``worker_init`` means the CPU count, as Celery decides later)."""
    count = worker.concurrency
    if not isinstance(count, int) or count <= 0:
        count = os.cpu_count() or 1
    return count


# -- the consumer (guard.py) ---------------------------------------------------------------------

#: The consumer step that makes the task consumer (Celery 4 to 5.7); the guard's step requires it.
TASKS_STEP = "celery.worker.consumer.tasks:Tasks"


def wrap_task_handler(consumer: Any, wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> None:
    """Make the consumer's task message handler ``wrap(handler)``.

    Touches ``Consumer.create_task_handler`` (Celery 4 to 5.7): the Tasks step calls it on the
    consumer when it builds the task consumer, and its result is the ``on_message`` callback
    that receives every task message. Replaced on the consumer object, before that step starts."""
    create = consumer.create_task_handler

    def create_task_handler(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return wrap(create(*args, **kwargs))

    consumer.create_task_handler = create_task_handler


def task_consumer_channel(consumer: Any) -> Any:
    """The channel of the consumer's task consumer, or None before the Tasks step made it.

    Touches ``Consumer.task_consumer`` (Celery 4 to 5.7, set by the Tasks step at each
    (re)connection)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    return task_consumer.channel if task_consumer is not None else None


def task_strategies(consumer: Any) -> Any:
    """The consumer's registered task names, as the mapping from a name to its strategy.

    Touches ``Consumer.strategies`` (Celery 4 to 5.7): the handler made by
    ``create_task_handler`` looks a message's task up there, and a name missing there is an
    unknown task (``on_unknown_task``)."""
    return consumer.strategies


def call_later(consumer: Any, seconds: float, fun: Callable[..., Any], args: tuple) -> None:
    """Call ``fun(*args)`` after ``seconds`` in the consumer's thread.

    Touches ``Consumer.timer`` (Celery 4 to 5.7): the event loop's own timer (the hub's, on
    py-amqp and Redis) whose ``call_after`` schedules without blocking the consumer."""
    consumer.timer.call_after(seconds, fun, args)


def consumer_event_dispatcher(consumer: Any) -> Any:
    """The consumer's event dispatcher, or None: ``Consumer.event_dispatcher`` (Celery 4 to 5.7,
    set by the Events step; a disabled dispatcher when events are off)."""
    return getattr(consumer, "event_dispatcher", None)


def build_channel_messages_with(channel: Any, mixin: type) -> None:
    """Make a kombu virtual-transport ``channel`` build its messages from a class with ``mixin``
    first in its bases (once per channel); channels of other transports are left as they are.

    Touches ``kombu.transport.virtual.Channel.Message`` (kombu 5): a virtual channel (Redis, SQS,
    memory...) builds each delivered message with ``self.Message(payload, channel=self)`` in
    ``_restore``, ``basic_get`` and ``_deliver``, so an instance attribute replaces the class for
    that channel only. ``mixin.__init__(payload, channel=None, **kwargs)`` must call the
    transport's ``Message.__init__`` with that signature."""
    if isinstance(channel, virtual.Channel) and not issubclass(channel.Message, mixin):
        channel.Message = type(f"Tolerant{channel.Message.__name__}", (mixin, channel.Message), {})


# -- the broker (broker.py) ----------------------------------------------------------------------


def can_batch_publish(producer: Any) -> bool:
    """Whether ``producer`` and its transport can batch publishes (``start_publish_batch``).

    Touches ``Producer.batch`` and ``Producer.supports_batch_publish`` (kombu 5.7, absent before;
    the latter connects to ask the channel)."""
    return getattr(producer, "batch", None) is not None and bool(getattr(producer, "supports_batch_publish", False))


def start_publish_batch(producer: Any, max_size: int) -> Any:
    """An entered ``producer.batch(max_size=...)`` (kombu 5.7): publishes made until its
    ``__exit__`` go out together (one pipeline on Redis), flushed at the exit, discarded when
    it exits with an exception; a failed flush raises there (``BatchPublishError``)."""
    context = producer.batch(max_size=max_size)
    context.__enter__()
    return context


def cache_exchange_bindings(channel: Any) -> None:
    """Until ``uncache_exchange_bindings``, look up each exchange's bindings once on ``channel``.

    Touches ``virtual.Channel.get_table(exchange)`` (kombu 5): a virtual transport looks an
    exchange's bindings up in the broker (one Redis round trip) on each publish through
    ``_lookup``; an instance attribute of the same name answers instead, from a cache."""
    lookup = getattr(type(channel), "get_table", None)
    if lookup is None:
        return
    tables: dict[str, Any] = {}

    def get_table(exchange: str) -> Any:
        if exchange not in tables:
            tables[exchange] = lookup(channel, exchange)
        return tables[exchange]

    channel.get_table = get_table


def uncache_exchange_bindings(channel: Any) -> None:
    """Undo ``cache_exchange_bindings``: the channel's own ``get_table`` answers again."""
    channel.__dict__.pop("get_table", None)


# The attribute of a Redis channel that holds its kept client: (its connection pool, the
# client, the ``conn_or_acquire`` that hands it out)
_KEPT_CLIENT = "_celery_outbox_client"


def keep_redis_client(producer: Any) -> Any:
    """Until ``unkeep_redis_client(channel)``: ``producer``'s Redis channel gives each command the
    same client of its connection pool, made once per channel and pool, instead of a new one per
    command. Returns the channel so changed, or None: another transport, a connection not
    connected yet (nothing connects here; the publish connects under its own retry policy), or
    anything unexpected on the way (then kombu's own way stands, so this never fails a publish).

    Touches the Redis transport's ``Channel.conn_or_acquire(client=None)``,
    ``Channel._create_client()`` and ``Channel.pool`` (kombu 5.3 to 5.7): ``conn_or_acquire``
    builds a ``redis.Redis`` for every command (a publish to Celery's default exchange makes one,
    to a named exchange two: its bindings, then the LPUSH), and a client is costly to build (its
    response callbacks are copied into a case-insensitive dict). A client holds no connection of
    its own: every command borrows one from the pool, so one client serves every command as a
    new one would, and a reconnection (a new channel, or a new pool) gets a client of its own."""
    redis_transport = sys.modules.get("kombu.transport.redis")  # not imported: no channel of it exists
    if redis_transport is None:
        return None
    try:
        connection = producer.connection
        if not isinstance(connection.transport, redis_transport.Transport) or not connection.connected:
            return None
        channel = producer.channel  # connected: no round trip (a pooled producer's comes as a promise)
        if not isinstance(channel, redis_transport.Channel):
            return None
        pool = channel.pool
        kept = getattr(channel, _KEPT_CLIENT, None)
        if kept is None or kept[0] is not pool:
            kept_client = channel._create_client()

            def conn_or_acquire(client: Any = None) -> ContextManager[Any]:  # kombu's signature
                return nullcontext(client or kept_client)

            kept = (pool, kept_client, conn_or_acquire)
            setattr(channel, _KEPT_CLIENT, kept)
        channel.conn_or_acquire = kept[2]
    except Exception:  # noqa: BLE001 - an optimisation only: kombu's own client per command stands
        return None
    return channel


def unkeep_redis_client(channel: Any) -> None:
    """Undo ``keep_redis_client``: kombu's own ``conn_or_acquire`` answers again (the kept client
    stays on the channel for the next ``keep_redis_client``)."""
    channel.__dict__.pop("conn_or_acquire", None)


# The attribute of a pooled broker connection that holds the producer kept on it
_KEPT_PRODUCER = "_celery_outbox_producer"


@contextmanager
def kept_pooled_producer(app: Any) -> Iterator[Any]:
    """For the block: a producer on a connection of the app's producer pool, kept on that pooled
    connection from one block to the next instead of revived for every block. The block holds the
    connection as a producer of the pool would: one of the pool's connections, waiting
    ``broker_pool_acquire_timeout`` (Celery 5.7; for ever before it) for one when all are in use
    (the setting is read only then),
    then kombu's ``OperationalError`` (as Celery's own publishes raise); a block that raises
    hands it back to be replaced, as a pooled producer's does. Nothing connects here: a
    producer made or revived now takes its channel on its first publish, under that publish's
    own retry policy.

    Touches ``ProducerPool.connections`` and ``ProducerPool.Producer`` (kombu 5: the pool's
    connection pool, and the class it makes producers of), ``Producer._channel`` (the channel,
    or a promise of the connection's default channel not taken yet) and
    ``Connection._default_channel`` (kombu 5: the channel ``default_channel`` gave; a connection
    connecting afresh drops it).
    kombu's pool revives a producer on every acquire (a new copy of its exchange, its channel
    through a promise); a kept producer is revived only when its channel is no longer its
    connection's default channel (a reconnection, a channel closed) or the connection is down, so
    it never publishes on a channel its connection gave up, and a lost connection is connected
    afresh by the next publish, as a revived producer's is."""
    pool = app.amqp.producer_pool
    try:
        connection = pool.connections.acquire(block=False)  # a free one, or a new one within the limit
    except LimitExceeded:
        # Celery 5.7's setting; before it a pooled producer waits for ever, as None does
        connection = _wait_for_pooled_connection(pool.connections, app.conf.get("broker_pool_acquire_timeout"))
    try:
        producer = connection.__dict__.get(_KEPT_PRODUCER)
        if producer is None:
            producer = connection.__dict__[_KEPT_PRODUCER] = pool.Producer(connection)
        elif not isinstance(producer._channel, ChannelPromise) and (
                producer._channel is not connection._default_channel or not connection.connected):
            producer.revive(connection)
        yield producer
    except BaseException:
        pool.connections.replace(connection)  # closed: it connects afresh when next used
        raise
    finally:
        connection.release()


def _wait_for_pooled_connection(connections: Any, timeout: float | None) -> Any:
    """One of the pool ``connections`` once one is handed back, waiting up to ``timeout`` seconds
    (None: for ever); then kombu's ``OperationalError`` naming the limit."""
    try:
        return connections.acquire(block=True, timeout=timeout)
    except LimitExceeded as exc:  # Celery's own publishes raise this too, in its words
        raise KombuOperationalError(
            f"celery-outbox: timed out waiting for a broker connection after {timeout}s: all "
            f"{connections.limit} of the pool are in use (broker_pool_limit, broker_pool_acquire_timeout)",
        ) from exc
