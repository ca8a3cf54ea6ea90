"""Reading what reached a broker, and through which producers, for assertions: kombu consumers,
no workers, no sleeps."""

from __future__ import annotations

import queue as queue_module
from dataclasses import dataclass
from typing import Any

from celery import Celery

from .versions import KOMBU


@dataclass
class Received:
    task: str
    id: str
    args: list[Any]
    headers: dict[str, Any]


def receive(app: Celery, queue: str, count: int, timeout: float = 10.0) -> list[Received]:
    """The next ``count`` task messages of ``queue``, acked; fails if they do not come in time."""
    got: list[Received] = []
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(app.amqp.queues[queue])
        try:
            while len(got) < count:
                try:
                    message = simple.get(block=True, timeout=timeout)
                except queue_module.Empty:
                    raise AssertionError(f"only {len(got)} of {count} messages arrived on {queue!r}: {got}") from None
                args, _kwargs, _embed = message.decode()
                got.append(Received(message.headers["task"], message.headers["id"], list(args), dict(message.headers)))
                message.ack()
        finally:
            simple.close()
    return got


def send_marker(app: Celery, queue: str, marker: str) -> None:
    """Publish a plain message straight to ``queue``: once it arrives, everything published before it has."""
    with app.connection_for_write() as connection:
        producer = connection.Producer()
        producer.publish(
            [[marker], {}, {}], exchange="", routing_key=queue, serializer="json",
            headers={"task": "marker", "id": marker}, declare=[app.amqp.queues[queue]],
        )


def receive_until_marker(app: Celery, queue: str, marker: str, timeout: float = 10.0) -> list[Received]:
    """Every message that arrived before the marker: proves a negative without sleeping."""
    send_marker(app, queue, marker)
    before: list[Received] = []
    while True:
        (message,) = receive(app, queue, 1, timeout)
        if message.task == "marker" and message.id == marker:
            return before
        before.append(message)


def purge(app: Celery, *queues: str) -> None:
    with app.connection_for_write() as connection:
        for name in queues:
            try:
                app.amqp.queues[name].bind(connection.default_channel).delete()
            except Exception:  # noqa: BLE001 - a queue that never existed is fine
                pass


def waiting(app: Celery, queue: str) -> int:
    """How many messages ``queue`` holds that no consumer has taken (0 for a queue Redis does not
    have: it keeps no empty list)."""
    with app.connection_for_write() as connection:
        try:
            return app.amqp.queues[queue].bind(connection.default_channel).queue_declare(passive=True).message_count
        except connection.channel_errors:
            return 0


def nothing_more(app: Celery, queue: str) -> bool:
    """True when nothing is waiting on ``queue``: proven by a marker, not by a sleep."""
    import uuid

    return receive_until_marker(app, queue, f"marker-{uuid.uuid4().hex}") == []


#: Seconds between two sweeps in which a Redis worker restores a dead worker's unacked messages
#: (those past ``visibility_timeout``): every second with ``fast_redelivery`` from kombu 5.7;
#: before it kombu sweeps about every 100 s, whatever the options (a 10 s timer, every 10th call).
REDIS_RESTORE_SWEEP = 1 if KOMBU >= (5, 7) else 100


def fast_redelivery(visibility_timeout: float) -> dict[str, Any]:
    """Redis transport options for test workers: the unacked work of a dead worker comes back
    within seconds, not an hour. Every worker on the database restores it every second under
    kombu's ``unacked_mutex``, which is held for milliseconds; a worker SIGKILLed in those
    milliseconds leaves it held until ``unacked_mutex_expire`` (300 s by default), and no
    worker of any test restores anything until then. Five seconds bounds that wait."""
    return {"visibility_timeout": visibility_timeout, "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1, "unacked_mutex_expire": 5}


def copy_options(task_id: str) -> dict[str, Any]:
    """``apply_async`` options that make every call with them a copy of one send, as a broker
    redelivery is: the same task id and the same publish identity (an explicit header wins over
    the one the outbox stamps). Calls without them are new sends of the task id."""
    from celery_outbox.vocabulary import SEND_HEADER

    return {"task_id": task_id, "headers": {SEND_HEADER: f"send-of-{task_id}"}}


def counted_acquires(app: Celery, monkeypatch: Any) -> list[int]:
    """Counts the producers ``app``'s sends and publishes take from its pool, one entry per
    acquire: Celery's, from the producer pool, and the publish loop's, a producer kept on one of
    the pool's connections (``kept_pooled_producer``)."""
    from celery_outbox.producer import broker

    acquired: list[int] = []
    real_acquire = app.producer_pool.acquire
    real_kept = broker.kept_pooled_producer

    def acquire(*args: Any, **kwargs: Any) -> Any:
        acquired.append(1)
        return real_acquire(*args, **kwargs)

    def kept(*args: Any, **kwargs: Any) -> Any:
        acquired.append(1)
        return real_kept(*args, **kwargs)

    monkeypatch.setattr(app.producer_pool, "acquire", acquire)
    monkeypatch.setattr(broker, "kept_pooled_producer", kept)
    return acquired
