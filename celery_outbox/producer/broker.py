"""Talking to the broker without hanging on it: a reachability check, its errors, one publish loop.

No transaction: the callers hold theirs. Every path publishing stored messages goes through
``Outlet.publish_each``: the commit-time publisher (its durable messages), the relay, redelivery
and the re-publish of stranded envelopes. A message with no row (not durable) goes alone with
Celery's retry policy (``Publisher._publish_plain``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Generic, Iterator, Sequence, TypeVar

from kombu.exceptions import OperationalError as KombuOperationalError

from ..core.crashpoints import crashpoint
from ..message.envelope import OutgoingMessage
from ..monitoring import tracing
from .celery_internals import (
    cache_exchange_bindings,
    can_batch_publish,
    keep_redis_client,
    kept_pooled_producer,
    start_publish_batch,
    uncache_exchange_bindings,
    unkeep_redis_client,
)

__all__ = ["BoundQueues", "Outlet", "PublishBatch", "PublishPass", "connection_errors", "connect_quickly", "outlet"]

T = TypeVar("T")


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
    trip, and each exchange's bindings looked up once per batch), each at once elsewhere,
    and for a single message (``n`` of 1), which a pipeline of its own only costs CPU.
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
        if self._messages < 2 or not can_batch_publish(self._producer):
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
    """``app.amqp.queues`` with each queue bound to the producer's channel, for publishes that
    declare the same few entities. kombu binds (copies) an unbound entity on every publish that
    declares it; a bound one is only looked up in the connection's cache of declared entities.
    The copies live on the channel (``_BINDINGS``), so an entity is copied once per channel, not
    once per publish: a channel that is replaced (a reconnection) takes its copies with it. The
    channel is taken on first use, so a broker that is down fails the first publish, as it would
    without this."""

    def __init__(self, queues: Any, producer: Any):
        self._queues, self._producer = queues, producer
        self._channel: Any = None
        self._copies: dict[int, tuple[Any, Any]] = {}

    def __getitem__(self, name: str) -> Any:
        """The queue called ``name``, bound (``KeyError`` when the app has no such queue)."""
        return self._bound(self._queues[name])

    def bind(self, entities: list[Any]) -> list[Any]:
        """``entities`` (a captured message's ``declare``: the app's queues, or the caller's
        own entities) bound, each copied once per channel."""
        return [self._bound(entity) for entity in entities]

    def _bound(self, entity: Any) -> Any:
        """The copy of ``entity`` bound to the producer's channel. The copies are keyed by the
        entity's ``id()`` and hold the entity, so no other entity can take its id while its copy
        is kept; at ``MAX_BINDINGS`` copies (a caller making new entities for every call) they
        start afresh."""
        channel = self._producer.channel  # a revived producer has a new one
        if channel is not self._channel:
            self._channel, self._copies = channel, _bindings_of(channel)
        kept = self._copies.get(id(entity))
        if kept is not None and kept[0] is entity:
            return kept[1]
        if len(self._copies) >= MAX_BINDINGS:
            self._copies.clear()
        copy = entity.bind(channel)
        self._copies[id(entity)] = (entity, copy)
        return copy


# Bound copies one channel keeps (``BoundQueues``): far more than an app has queues
MAX_BINDINGS = 256
# The attribute of a channel that holds its bound copies
_BINDINGS = "_celery_outbox_bindings"


def _bindings_of(channel: Any) -> dict[int, tuple[Any, Any]]:
    """The bound copies ``channel`` keeps, by the ``id()`` of their entity; a dict of the caller's
    own when the channel takes no attribute."""
    copies = getattr(channel, _BINDINGS, None)
    if copies is None:
        copies = {}
        try:
            setattr(channel, _BINDINGS, copies)
        except AttributeError:  # a channel class with __slots__: copies last one loop
            pass
    return copies


@dataclass
class PublishPass(Generic[T]):
    """What one ``Outlet.publish_each`` did with its ``(item, message)`` pairs: each is published,
    failed for a reason of its own (with the error), or not sent because the broker failed."""

    published: list[tuple[T, OutgoingMessage]] = field(default_factory=list)
    failed: list[tuple[T, OutgoingMessage, BaseException]] = field(default_factory=list)
    not_sent: list[tuple[T, OutgoingMessage]] = field(default_factory=list)
    broker_error: BaseException | None = None

    @property
    def broker_error_text(self) -> str | None:
        """The broker error as ``Type: message``, or None."""
        error = self.broker_error
        return None if error is None else f"{type(error).__name__}: {error}"

    def errors(self) -> dict[int, BaseException]:
        """The error of each message not published, keyed by the message's ``id()``."""
        errors = {id(message): exc for _, message, exc in self.failed}
        if self.broker_error is not None:
            errors.update((id(message), self.broker_error) for _, message in self.not_sent)
        return errors


class Outlet:
    """One producer of the app and what a publish loop needs with it: the broker's error types,
    the app's queues bound to it, a quick reachability check."""

    def __init__(self, app: Any, producer: Any):
        self.producer = producer
        self.broker_errors = connection_errors(producer.connection)
        self.queues = app.amqp.queues
        self.bound = BoundQueues(self.queues, producer)

    def unreachable(self) -> str | None:
        """Why the broker does not answer (one quick attempt), or None when it does."""
        return connect_quickly(self.producer.connection)

    def publish_each(self, pairs: Sequence[tuple[T, OutgoingMessage]], crash_point: str | None = None,
                     step: tracing.Step = tracing.Step.PUBLISH) -> PublishPass[T]:
        """Publish each pair's message in order, without retries, batched where the transport can
        (``PublishBatch``). A publish that fails for a reason of its own (the message) is
        ``failed`` and the loop goes on; a broker error stops it: that message and the rest are
        ``not_sent``. When the batch could not be flushed, nothing of it counts as published
        (``not_sent``; ``broker_error`` says why). Once the batch is flushed, ``crash_point`` is
        passed once per published message. Each message's publish is a span of ``step``
        (``tracing.PublishSpans``)."""
        result: PublishPass[T] = PublishPass()
        spans = tracing.PublishSpans(step)
        with PublishBatch(self.producer, len(pairs)) as batch:
            for index, (item, message) in enumerate(pairs):
                spans.start(message)
                try:
                    message.publish(self.producer, retry=False, entities=self.bound)
                except self.broker_errors as exc:
                    result.broker_error = exc
                    result.not_sent = list(pairs[index:])
                    break
                except Exception as exc:  # noqa: BLE001 - the message's own failure: the caller counts it
                    result.failed.append((item, message, exc))
                else:
                    result.published.append((item, message))
        if batch.error is not None:
            result.broker_error = batch.error
            result.not_sent = result.published + result.not_sent
            result.published = []
        if spans:
            spans.end(result.errors())
        if crash_point is not None:
            for _ in result.published:
                crashpoint(crash_point)
        return result


@contextmanager
def outlet(app: Any, producer: Any = None) -> Iterator[Outlet]:
    """An ``Outlet`` on ``producer``, or on a producer kept on one of the app's pooled broker
    connections for the block (``kept_pooled_producer``: waiting ``broker_pool_acquire_timeout``
    for one, as Celery's own publishes do). On Redis, the block's commands share one client of
    the channel's pool (``keep_redis_client``)."""
    with _producer_for(app, producer) as acquired:
        channel = keep_redis_client(acquired)
        try:
            yield Outlet(app, acquired)
        finally:
            if channel is not None:
                unkeep_redis_client(channel)


def _producer_for(app: Any, producer: Any) -> ContextManager[Any]:
    """``producer``, or one kept on a pooled connection of the app for the block."""
    if producer is not None:
        return nullcontext(producer)
    return kept_pooled_producer(app)
