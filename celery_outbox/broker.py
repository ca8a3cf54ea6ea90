"""Talking to the broker without hanging on it: a quick reachability check, its error types."""

from __future__ import annotations

from typing import Any

from kombu.exceptions import OperationalError as KombuOperationalError

from .celery_hooks import cache_exchange_bindings, can_batch_publish, start_publish_batch, uncache_exchange_bindings

__all__ = ["PublishBatch", "connection_errors", "connect_quickly"]


def connection_errors(connection: Any) -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the broker cannot be reached", as opposed to "this message is bad"."""
    return tuple(connection.connection_errors) + (OSError, KombuOperationalError)


def connect_quickly(connection: Any) -> str | None:
    """Connect with one attempt and no back-off; the reason when the broker does not answer."""
    try:
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, interval_max=0)
    except connection_errors(connection) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class PublishBatch:
    """``with PublishBatch(producer, n) as batch:`` publishes made inside go out together where
    kombu and the transport can batch them (kombu 5.7+ on Redis: one pipeline, one round
    trip, and each exchange's bindings looked up once per batch), each at once elsewhere.
    A batch that could not be sent does not raise: ``error`` says why, and whether its
    messages arrived is unknown, so callers treat them as not sent (durable rows stay for
    the relay; a copy that did arrive is discarded by the inbox).
    """

    def __init__(self, producer: Any, messages: int):
        self._producer = producer
        self._messages = messages
        self._context: Any = None
        self._channel: Any = None
        self.error: BaseException | None = None

    def __enter__(self) -> "PublishBatch":
        if not can_batch_publish(self._producer):
            return self
        try:
            channel = self._producer.channel  # connects: a broker that is down leaves the publishes unbatched
        except Exception:  # noqa: BLE001 - each publish then fails on its own, as without a batch
            return self
        # room for every command of every message, so it is flushed once, at the end
        self._context = start_publish_batch(self._producer, max(1000, 8 * self._messages))
        self._channel = channel
        cache_exchange_bindings(channel)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._context is None:
            return False
        uncache_exchange_bindings(self._channel)
        if exc_type is not None:
            self._context.__exit__(exc_type, exc, tb)  # discards what was not flushed
            return False
        try:
            self._context.__exit__(None, None, None)
        except Exception as error:  # noqa: BLE001 - kombu's BatchPublishError or the broker's own error
            self.error = error
        return False


class BoundQueues:
    """``app.amqp.queues`` with each queue bound to the producer's channel on first use, for a
    loop that publishes many messages declaring the same few entities. kombu binds (copies) an
    unbound entity on every publish that declares it; a bound one is only looked up in the
    connection's cache of declared entities. The channel is taken on first use, so a broker
    that is down fails the first publish, as it would without this."""

    def __init__(self, queues: Any, producer: Any):
        self._queues, self._producer = queues, producer
        self._bound: dict[Any, Any] = {}

    def __getitem__(self, name: str) -> Any:
        """The queue called ``name``, bound (``KeyError`` when the app has no such queue)."""
        queue = self._bound.get(name)
        if queue is None:
            queue = self._bound[name] = self._queues[name].bind(self._producer.channel)
        return queue

    def bind(self, entities: list[Any]) -> list[Any]:
        """``entities`` (a captured message's ``declare``: the app's queues, or the caller's
        own entities, alive as long as the message) bound, each copied once per loop."""
        bound = []
        for entity in entities:
            copy = self._bound.get(id(entity))
            if copy is None:
                copy = self._bound[id(entity)] = entity.bind(self._producer.channel)
            bound.append(copy)
        return bound
