"""Every place the producer side relies on a private part of Celery or kombu, and nowhere else.

No transaction. Each function (the app's task sender, its event dispatcher, the producer's
batches, bindings and Redis client) says which internal, why, and for which versions it holds,
and ``tests/unit/producer/test_celery_internals.py`` pins that behaviour by name. Two
undocumented call shapes are pinned by the same tests: ``send_task_message`` publishes with one
``producer.publish(body, **kwargs)`` call (``envelope._RecordingProducer`` records it), and sends
``task-sent`` with ``dispatcher.publish(type, fields, producer, retry=..., retry_policy=...)``
(``sent_events.RecordingDispatcher`` records it).
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

from kombu.exceptions import LimitExceeded
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils.functional import ChannelPromise

__all__ = ["backend_ignores_producer", "cache_exchange_bindings", "can_batch_publish", "default_event_dispatcher",
    "install_send_task_producer", "install_task_sender", "keep_redis_client", "kept_pooled_producer",
    "start_publish_batch", "uncache_exchange_bindings", "unkeep_redis_client"]


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
