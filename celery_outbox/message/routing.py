"""Which declared queues a message reaches, decided from the exchange and routing key it goes with.

No transaction: pure functions of the app's declared queues. Guarantee: the producer
(``published_route``, ``reached_queues``, ``durable_destination``) and the consumer
(``queue_of``) resolve a route with the same steps, following the bindings of the declared queues
as the broker does; a route to a durable queue these rules cannot decide (a ``headers``
exchange) raises ``UndecidableRoute`` at the call rather than guess the message's durability.
The binding rules and what is not followed are in docs/publishing.md (Routing).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from celery import Celery
from celery.app.amqp import AMQP
from kombu import Exchange, Queue

from ..errors import UndecidableRoute

__all__ = ["published_route", "exchange_name", "reached_queues", "durable_destination", "queue_of"]

_KNOWN_TYPES = frozenset({"direct", "topic", "fanout"})


def published_route(amqp: AMQP, options: Mapping[str, Any]) -> tuple[str, str]:
    """The exchange name and routing key Celery's ``send_task_message`` publishes with, given the
    options the app's router resolved (``queue``, ``exchange``, ``routing_key``, ``exchange_type``)."""
    queue, exchange = options.get("queue"), options.get("exchange")
    routing_key, exchange_type = options.get("routing_key"), options.get("exchange_type")
    if queue is None and exchange is None:
        queue = amqp.default_queue
    queue_name = queue
    if isinstance(queue, str):
        queue = amqp.queues[queue]
    elif queue is not None:
        queue_name = queue.name
    if exchange_type is None:
        exchange_type = getattr(getattr(queue, "exchange", None), "type", "direct")
    if (not exchange or not routing_key) and exchange_type == "direct":
        return "", queue_name or ""
    if exchange is None:
        exchange = queue.exchange.name or amqp.default_exchange
        routing_key = routing_key or queue.routing_key or amqp.app.conf.task_default_routing_key
    return exchange_name(exchange), routing_key or ""


def exchange_name(exchange: Any) -> str:
    """The name of an exchange given as an ``Exchange`` or a name."""
    if isinstance(exchange, Exchange):
        return exchange.name or ""
    return exchange or ""


def reached_queues(queues: Mapping[str, Queue], exchange: str, routing_key: str) -> list[str]:
    """The names of the declared ``queues`` a message published to ``exchange`` with
    ``routing_key`` reaches (through the default exchange, the queue the routing key names),
    counting a queue bound to an exchange of a type not followed here as reached."""
    if not exchange:
        return [routing_key] if routing_key else []
    return [queue.name for queue in queues.values() if _reaches(queue, exchange, routing_key) is not False]


def durable_destination(queues: Mapping[str, Queue], durable: frozenset[str], exchange: str,
                        routing_key: str) -> str | None:
    """The first declared durable queue the route reaches, or None. Raises ``UndecidableRoute``
    when it goes through an exchange of a type not followed here that a durable queue is bound to."""
    if not exchange:
        return routing_key if routing_key in durable else None
    for queue in queues.values():
        if queue.name not in durable:
            continue
        reaches = _reaches(queue, exchange, routing_key)
        if reaches is None:
            raise UndecidableRoute(
                f"celery-outbox: durable queue {queue.name!r} is bound to the exchange {exchange!r}, whose type "
                "celery-outbox does not follow (only direct, topic and fanout exchanges, and the default one): "
                "its durability cannot be decided; route messages for a durable queue by queue name or through "
                "one of those exchanges")
        if reaches:
            return queue.name
    return None


def queue_of(delivery_info: Mapping[str, Any] | None, app: Celery,
             durable: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The queue a delivered message came from, decided from its exchange and routing key as the
    producer decides it: among the reached queues this worker consumes (all declared ones when it
    consumes none of them), a ``durable`` one first; None for a route to no declared queue."""
    delivery_info = delivery_info if isinstance(delivery_info, Mapping) else {}
    exchange = exchange_name(delivery_info.get("exchange"))
    routing_key = delivery_info.get("routing_key")
    routing_key = routing_key if isinstance(routing_key, str) else ""
    if not exchange:
        return routing_key or None
    queues = app.amqp.queues
    reached = (reached_queues(queues.consume_from, exchange, routing_key)
               or reached_queues(queues, exchange, routing_key))
    return next((name for name in reached if name in durable), reached[0] if reached else None)


def _reaches(queue: Queue, exchange: str, routing_key: str) -> bool | None:
    """Whether a message published to ``exchange`` with ``routing_key`` reaches ``queue``; None
    when the queue is bound to that exchange and the exchange's type is not followed here."""
    undecided = False
    for bound, binding_key in _bindings(queue):
        if bound.name != exchange:
            continue
        kind = bound.type or "direct"
        if kind not in _KNOWN_TYPES:
            undecided = True
        elif kind == "fanout" or _key_matches(kind, binding_key or "", routing_key):
            return True
    return None if undecided else False


def _bindings(queue: Queue) -> Iterator[tuple[Exchange, str]]:
    """The exchanges a declared queue is bound to, with their binding keys."""
    if queue.exchange is not None and queue.exchange.name:
        yield queue.exchange, queue.routing_key
    for binding in queue.bindings or ():
        if binding.exchange is not None and binding.exchange.name:
            yield binding.exchange, binding.routing_key


def _key_matches(kind: str, binding_key: str, routing_key: str) -> bool:
    if kind == "direct":
        return binding_key == routing_key
    return _topic_matches(binding_key.split("."), routing_key.split("."))


def _topic_matches(pattern: list[str], words: list[str]) -> bool:
    """AMQP topic matching: ``*`` matches one word, ``#`` zero or more."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_topic_matches(rest, words[skip:]) for skip in range(len(words) + 1))
    return bool(words) and head in ("*", words[0]) and _topic_matches(rest, words[1:])
