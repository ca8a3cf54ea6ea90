"""One test per private Celery/kombu touch point of ``celery_outbox.producer.celery_internals``: each pins the
Celery or kombu behaviour it relies on, with real Celery and kombu objects (the memory
transport; Redis where only a real transport batches), so that an upgrade that changes one of
them fails here, by name."""

from __future__ import annotations

import inspect
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.amqp import AMQP
from celery.utils.imports import symbol_by_name
from kombu import Connection, Exchange, Queue

from celery_outbox.producer import celery_internals as hooks
from tests.brokers import counted_acquires
from tests.services import require

from ..celery_objects import RecordingProducer, task_message


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
def test_only_a_backend_that_declares_on_send_uses_the_producer(app, monkeypatch):
    """``backend_ignores_producer``: the base backend's ``on_task_call`` does nothing and the Redis
    one subscribes on its own connection, so neither reads the producer (a producer with no
    attributes passes); the rpc backend declares its reply queue on the producer's channel (outside
    a prefork pool process: a worker test of this process may have left Celery's flag set)."""
    import celery._state

    monkeypatch.setattr(celery._state, "_task_join_will_block", False)
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
