"""Batched publishing (``broker.PublishBatch``) on real Redis and RabbitMQ.

On Redis a batch goes out as one pipeline, in call order, with each exchange's bindings
looked up once; a batch that cannot be flushed reports its error instead of raising. On
RabbitMQ (no batching in kombu), and for a batch of one message, every publish goes out at
once. ``BoundQueues`` binds each entity publishes declare once per channel, across loops, and
they are still declared; a producer whose channel was replaced binds afresh. On Redis the
commands of an ``outlet`` block share one client of the channel's pool, which outlives the broker
dropping its connections. An ``outlet`` block's producer is kept on its pooled connection from
one block to the next, revived only when its connection's channel changed or went down, within
the pool's limit, and connects nothing before its first publish.
"""

from __future__ import annotations

import threading
import uuid
from urllib.parse import urlsplit

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError as KombuOperationalError

from celery_outbox.producer.broker import MAX_BINDINGS, BoundQueues, PublishBatch, outlet
from celery_outbox.producer.celery_internals import kept_pooled_producer

from ..services import TcpProxy, free_port
from ..versions import KOMBU


def queue_named(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def publish(producer, queue: Queue, n: int) -> None:
    producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue],
                     serializer="json", retry=False)


def drain(connection, queue: Queue) -> list[int]:
    got = []
    simple = connection.SimpleQueue(queue)
    try:
        while True:
            try:
                message = simple.get(block=True, timeout=1)
            except simple.Empty:
                return got
            got.append(message.payload["n"])
            message.ack()
    finally:
        simple.close()


def drained_and_deleted(url: str, queue: Queue) -> list[int]:
    """What ``queue`` holds, read on a connection of its own; the queue is deleted after."""
    with Connection(url) as connection:
        got = drain(connection, queue)
        queue.bind(connection.default_channel).delete()
    return got


@pytest.fixture
def queue():
    return queue_named(f"batch_{uuid.uuid4().hex[:8]}")


#: kombu 5.7 added batch publishing; before it a batch publishes each message at once, as on RabbitMQ
needs_kombu_batch = pytest.mark.skipif(KOMBU < (5, 7), reason="kombu before 5.7 has no batch publishing: each "
                                        "message goes at once (test_rabbitmq_publishes_each_message_at_once)")


@needs_kombu_batch
def test_a_redis_batch_arrives_in_order_with_one_binding_lookup(redis_url, queue):
    with Connection(redis_url) as connection:
        producer = connection.Producer()
        publish(producer, queue, -1)  # declares and binds the queue
        lookups = []
        channel = producer.channel
        real = type(channel).get_table
        type(channel).get_table = lambda self, exchange: lookups.append(exchange) or real(self, exchange)
        try:
            with PublishBatch(producer, 50) as batch:
                for n in range(50):
                    publish(producer, queue, n)
                assert drain(connection, queue) == [-1], "nothing of the batch is sent before it ends"
        finally:
            type(channel).get_table = real
        assert batch.error is None
        assert lookups == [queue.exchange.name], "the bindings were looked up once"
        assert "get_table" not in channel.__dict__, "the lookup is plain again after the batch"
        assert drain(connection, queue) == list(range(50))
        queue.bind(channel).delete()


@needs_kombu_batch
def test_a_redis_batch_that_cannot_be_sent_reports_its_error(redis_url, queue):
    real = urlsplit(redis_url)
    proxy = TcpProxy(real.hostname or "127.0.0.1", real.port or 6379).start()
    try:
        with Connection(f"redis://127.0.0.1:{proxy.port}{real.path}") as connection:
            producer = connection.Producer()
            publish(producer, queue, -1)
            with PublishBatch(producer, 10) as batch:
                for n in range(10):
                    publish(producer, queue, n)
                proxy.stop()  # the broker goes away before the batch is flushed
            assert batch.error is not None, "the failed flush is reported, not raised"
    finally:
        proxy.stop()
    with Connection(redis_url) as connection:
        assert drain(connection, queue) == [-1], "none of the failed batch arrived"
        queue.bind(connection.default_channel).delete()


def test_a_redis_batch_of_one_message_goes_at_once(redis_url, queue):
    """One message needs no pipeline: it is published at once, as without a batch."""
    with Connection(redis_url) as connection:
        producer = connection.Producer()
        publish(producer, queue, -1)
        with PublishBatch(producer, 1) as batch:
            publish(producer, queue, 0)
            assert drain(connection, queue) == [-1, 0], "no batching: already sent"
        assert batch.error is None
        queue.bind(connection.default_channel).delete()


def test_rabbitmq_publishes_each_message_at_once(rabbitmq_url, queue):
    with Connection(rabbitmq_url) as connection:
        producer = connection.Producer()
        publish(producer, queue, -1)
        with PublishBatch(producer, 5) as batch:
            for n in range(5):
                publish(producer, queue, n)
            with Connection(rabbitmq_url) as other:
                assert drain(other, queue) == [-1, 0, 1, 2, 3, 4], "no batching: already sent"
        assert batch.error is None
        queue.bind(connection.default_channel).delete()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_entities_bound_once_per_channel_are_declared_and_receive(broker, redis_url, rabbitmq_url, queue):
    url = redis_url if broker == "redis" else rabbitmq_url
    with Connection(url) as connection:
        producer = connection.Producer()
        entities = BoundQueues({queue.name: queue}, producer)
        (bound,) = entities.bind([queue])
        assert bound is not queue and bound.channel is producer.channel
        assert entities.bind([queue])[0] is bound, "bound once"
        assert entities[queue.name] is bound, "by name, the same copy"
        assert BoundQueues({queue.name: queue}, producer).bind([queue])[0] is bound, "kept by the channel"
        for n in range(3):  # the queue does not exist yet: the first publish declares it
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=entities.bind([queue]), serializer="json", retry=False)
        with Connection(url) as other:
            assert drain(other, queue) == [0, 1, 2]
        queue.bind(connection.default_channel).delete()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_producer_with_a_new_channel_binds_afresh_and_its_messages_arrive(broker, redis_url, rabbitmq_url,
                                                                             queue):
    url = redis_url if broker == "redis" else rabbitmq_url
    with Connection(url) as connection:
        producer = connection.Producer(connection.channel())
        entities = BoundQueues({queue.name: queue}, producer)
        old = entities.bind([queue])[0]
        old_channel = producer.channel
        producer.revive(connection.channel())  # what kombu does after a reconnection
        (bound,) = entities.bind([queue])
        assert bound is not old and bound.channel is producer.channel and producer.channel is not old_channel
        old_channel.close()
        producer.publish({"n": 7}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[bound],
                         serializer="json", retry=False)
        with Connection(url) as other:
            assert drain(other, queue) == [7]
        queue.bind(connection.default_channel).delete()


def test_a_channel_keeps_a_bounded_number_of_copies(redis_url):
    with Connection(redis_url) as connection:
        producer = connection.Producer()
        entities = BoundQueues({}, producer)
        made = [queue_named(f"bounded_{n}") for n in range(MAX_BINDINGS + 1)]
        copies = [entities.bind([queue])[0] for queue in made]
        assert all(copy.name == queue.name and copy.channel is producer.channel
                   for copy, queue in zip(copies, made, strict=True))
        assert entities.bind([made[-1]])[0] is copies[-1], "kept after starting afresh"
        assert entities.bind([made[0]])[0] is not copies[0], "dropped when the copies started afresh"


def counting_clients(monkeypatch, channel_class: type) -> list:
    """The Redis channels each client is made for, as they are made."""
    made: list = []
    real = channel_class._create_client
    monkeypatch.setattr(channel_class, "_create_client",
                        lambda self, *args, **kwargs: made.append(self) or real(self, *args, **kwargs))
    return made


def test_an_outlet_on_redis_sends_every_command_through_one_kept_client(redis_url, queue, monkeypatch):
    app = Celery("kept_client", broker=redis_url, set_as_current=False)
    try:
        with outlet(app) as out:  # a new producer: not connected before its first publish, nothing kept
            publish(out.producer, queue, -1)
            made_clients = counting_clients(monkeypatch, type(out.producer.channel))
        before = len(made_clients)
        clients: dict = {}  # per channel, the clients its commands got (kombu's pools are per process: a
        for n in range(3):  # channel may have kept its client for another app of the same broker already)
            with outlet(app) as out:
                channel = out.producer.channel
                assert "conn_or_acquire" in channel.__dict__, "kept for the block"
                publish(out.producer, queue, n)
                with channel.conn_or_acquire() as client:
                    clients.setdefault(channel, set()).add(id(client))
            assert "conn_or_acquire" not in channel.__dict__, "kombu's own after the block"
        assert all(len(kept) == 1 for kept in clients.values()), "one client per channel, across blocks"
        assert len(made_clients) - before <= len(clients) < 3, "at most one made per channel, not one per command"
        assert drained_and_deleted(redis_url, queue) == [-1, 0, 1, 2]
    finally:
        app.close()


def test_a_kept_redis_client_reconnects_after_the_broker_dropped_its_connections(redis_url, queue):
    real = urlsplit(redis_url)
    proxy = TcpProxy(real.hostname or "127.0.0.1", real.port or 6379).start()
    app = Celery("kept_client_dropped", broker=f"redis://127.0.0.1:{proxy.port}{real.path}", set_as_current=False)
    try:
        for n in range(2):  # the second block keeps a client
            with outlet(app) as out:
                publish(out.producer, queue, n)
        proxy.stop()  # every connection cut, new ones refused
        with outlet(app) as out:
            assert "conn_or_acquire" in out.producer.channel.__dict__
            with pytest.raises(out.broker_errors):
                publish(out.producer, queue, 2)
        proxy.start()
        with outlet(app) as out:  # the kept client's pool connects afresh
            assert "conn_or_acquire" in out.producer.channel.__dict__
            publish(out.producer, queue, 3)
    finally:
        proxy.stop()
        app.close()
    with Connection(redis_url) as connection:
        assert drain(connection, queue) == [0, 1, 3], "the publish that failed is reported, the next one arrives"
        queue.bind(connection.default_channel).delete()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_an_outlet_keeps_its_producer_on_the_pooled_connection_across_blocks(broker, redis_url, rabbitmq_url,
                                                                               queue):
    url = redis_url if broker == "redis" else rabbitmq_url
    app = Celery("kept_producer", broker=url, set_as_current=False)
    app.conf.broker_pool_limit = 1  # one pooled connection: every block gets the same one
    try:
        producers, exchanges = [], []
        for n in range(3):
            with outlet(app) as out:
                publish(out.producer, queue, n)
                producers.append(out.producer)
                exchanges.append(out.producer.exchange)
        assert producers[0] is producers[1] is producers[2], "kept on the pooled connection"
        assert exchanges[0] is exchanges[1] is exchanges[2], "not revived between blocks"
        assert drained_and_deleted(url, queue) == [0, 1, 2]
    finally:
        app.close()


def test_a_kept_producer_is_revived_once_its_connection_was_lost(rabbitmq_url, queue):
    real = urlsplit(rabbitmq_url)
    proxy = TcpProxy(real.hostname or "127.0.0.1", real.port or 5672).start()
    app = Celery("kept_producer_lost", broker=real._replace(netloc=f"{real.netloc.rsplit('@', 1)[0]}@127.0.0.1:"
                                                                   f"{proxy.port}").geturl(), set_as_current=False)
    app.conf.broker_pool_limit = 1
    try:
        with Connection(rabbitmq_url) as direct:
            with outlet(app) as out:
                publish(out.producer, queue, 0)
                kept, first_channel = out.producer, out.producer.channel
            assert drain(direct, queue) == [0], "arrived before the cut (a publish is not confirmed)"
            proxy.stop()  # every connection cut, new ones refused
            with outlet(app) as out:
                with pytest.raises(out.broker_errors):
                    publish(out.producer, queue, 1)
            proxy.start()
            with outlet(app) as out:
                publish(out.producer, queue, 2)
                assert out.producer is kept and out.producer.channel is not first_channel, "revived, on a new channel"
            assert drain(direct, queue) == [2], "the publish that failed is reported, the next one arrives"
            queue.bind(direct.default_channel).delete()
    finally:
        proxy.stop()
        app.close()


def test_a_block_connects_nothing_before_its_first_publish():
    app = Celery("kept_producer_down", broker=f"amqp://guest:guest@127.0.0.1:{free_port()}//",
                 set_as_current=False)
    try:
        with kept_pooled_producer(app) as producer:  # nothing listens there: no wait, no error
            assert not producer.connection.connected
    finally:
        app.close()


def test_an_exhausted_pool_is_a_broker_error_naming_its_limit(redis_url):
    app = Celery("kept_producer_limit", broker=redis_url, set_as_current=False)
    app.conf.update(broker_pool_limit=1, broker_pool_acquire_timeout=0.2)
    try:
        with outlet(app):
            with pytest.raises(KombuOperationalError, match="broker_pool_limit"):
                with outlet(app):
                    pass
        with outlet(app) as out:  # handed back: the pool has its connection again
            assert out.producer is not None
    finally:
        app.close()


def test_a_block_finding_the_pool_in_use_waits_for_a_connection_handed_back(redis_url, queue, monkeypatch):
    """With every pooled connection in use, a block waits (``broker_pool_acquire_timeout``) and
    takes the connection the holder hands back, as Celery's pooled producers do."""
    app = Celery("kept_producer_waiting", broker=redis_url, set_as_current=False)
    app.conf.update(broker_pool_limit=1, broker_pool_acquire_timeout=30)
    connections = app.amqp.producer_pool.connections
    holding, waiting = threading.Event(), threading.Event()
    held: list = []
    real_acquire = connections.acquire

    def acquire(*args, **kwargs):
        if kwargs.get("block"):
            waiting.set()  # the holder hands its connection back now
        return real_acquire(*args, **kwargs)

    monkeypatch.setattr(connections, "acquire", acquire)

    def hold() -> None:
        with outlet(app) as out:
            held.append(out.producer.connection)
            holding.set()
            waiting.wait(30)

    holder = threading.Thread(target=hold)
    try:
        holder.start()
        assert holding.wait(30), "the holder took the pool's one connection"
        with outlet(app) as out:
            assert waiting.is_set() and out.producer.connection is held[0], "waited for the holder's connection"
            publish(out.producer, queue, 0)
        assert drained_and_deleted(redis_url, queue) == [0]
    finally:
        waiting.set()
        holder.join(30)
        app.close()


def test_a_block_that_raises_hands_its_connection_back_to_be_replaced(redis_url, queue):
    app = Celery("kept_producer_raising", broker=redis_url, set_as_current=False)
    app.conf.update(broker_pool_limit=1, broker_pool_acquire_timeout=1)
    try:
        with pytest.raises(RuntimeError):
            with outlet(app) as out:
                publish(out.producer, queue, 0)
                raise RuntimeError("the block failed")
        with outlet(app) as out:  # the connection came back to the pool, closed, and connects afresh
            publish(out.producer, queue, 1)
        assert drained_and_deleted(redis_url, queue) == [0, 1]
    finally:
        app.close()
