"""Routing: a message is durable when the route it is published with reaches a durable queue,
however that route was chosen. Fast checks on kombu's in-memory transport and SQLite; the same
routes with real workers on Redis and RabbitMQ are in tests/integration/test_routing_workers.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue, binding

from celery_outbox import Outbox
from celery_outbox.errors import UndecidableRoute
from celery_outbox.message.routing import published_route, queue_of, reached_queues
from celery_outbox.producer import publish_hook as publish_hook_module
from celery_outbox.producer.unit_of_work import current_unit_of_work

from ...brokers import nothing_more, receive
from ...conftest import unsent_rows


@dataclass
class Routes:
    app: Celery
    outbox: Outbox
    names: dict[str, str]
    task: Any


def make_routes(database_url: str, prefix: str, durable: tuple[str, ...] = ("pay", "audit", "mirror", "multi"),
                default: str = "plain") -> Routes:
    """Queues of every exchange type; ``durable`` names the durable ones (by their short name)."""
    suffix = uuid.uuid4().hex[:8]
    n = {key: f"{key}_{suffix}" for key in ("plain", "pay", "other", "audit", "mirror", "hdr", "multi",
                                            "pay_ex", "pay_key", "other_key", "events", "fan", "hdr_ex")}
    pay_exchange = Exchange(n["pay_ex"], "direct")
    app = Celery(f"routes_{suffix}", broker="memory://", set_as_current=False)
    app.conf.update(
        task_default_queue=n[default],
        task_queues=[
            Queue(n["plain"]),
            Queue(n["pay"], pay_exchange, routing_key=n["pay_key"]),
            Queue(n["other"], pay_exchange, routing_key=n["other_key"]),
            Queue(n["audit"], Exchange(n["events"], "topic"), routing_key="payment.#"),
            Queue(n["mirror"], Exchange(n["fan"], "fanout")),
            Queue(n["hdr"], Exchange(n["hdr_ex"], "headers"), queue_arguments=None),
            Queue(n["multi"], bindings=[binding(Exchange(n["events"], "topic"), routing_key="*.refund")]),
        ],
        task_routes=[
            {"routes.by_dict": {"queue": n["pay"]}, "routes.glob_*": {"queue": n["pay"]},
             "routes.by_exchange": {"exchange": n["pay_ex"], "routing_key": n["pay_key"]}},
            _router_function(n), _RouterClass(n),
        ],
        outbox_database_url=database_url,
        outbox_table_prefix=prefix,
        outbox_durable_queues=[n[key] for key in durable],
    )
    outbox = Outbox(app)
    outbox.ready()
    with app.connection_for_write() as connection:  # as the workers consuming them would
        for queue in app.amqp.queues.values():
            if queue.exchange.type != "headers":  # kombu's virtual transports have no headers exchange
                queue(connection.default_channel).declare()

    @app.task(name="routes.task", shared=False)
    def task(x):
        return x

    for name in ("routes.by_dict", "routes.glob_payment", "routes.by_exchange", "routes.by_function",
                 "routes.by_class"):
        app.task(name=name, shared=False)(_identity)
    return Routes(app, outbox, n, task)


def _identity(x):
    return x


def _router_function(n: dict[str, str]):
    def route(name, args, kwargs, options, task=None, **_):
        if name == "routes.by_function":
            return {"exchange": n["events"], "exchange_type": "topic", "routing_key": "payment.card"}
        return None

    return route


class _RouterClass:
    def __init__(self, n: dict[str, str]):
        self.n = n

    def route_for_task(self, task, args=None, kwargs=None):
        return {"queue": self.n["pay"]} if task == "routes.by_class" else None


@pytest.fixture
def routes(sqlite_url, table_prefix):
    return make_routes(sqlite_url, table_prefix)


def _send(routes: Routes, way: str) -> Any:
    """Send one message to the durable queue ``pay`` (or ``audit``/``mirror``/``multi``) by ``way``."""
    n, app = routes.names, routes.app
    ways = {
        "queue name": lambda: routes.task.apply_async((1,), queue=n["pay"]),
        "Queue object": lambda: routes.task.apply_async((1,), queue=app.amqp.queues[n["pay"]]),
        "exchange and routing key": lambda: routes.task.apply_async((1,), exchange=n["pay_ex"],
                                                                     routing_key=n["pay_key"]),
        "Exchange object": lambda: routes.task.apply_async((1,), exchange=Exchange(n["pay_ex"], "direct"),
                                                            routing_key=n["pay_key"]),
        "send_task by exchange": lambda: app.send_task("routes.task", (1,), exchange=n["pay_ex"],
                                                       routing_key=n["pay_key"]),
        "task_routes dict": lambda: app.tasks["routes.by_dict"].delay(1),
        "task_routes glob": lambda: app.tasks["routes.glob_payment"].delay(1),
        "task_routes exchange": lambda: app.tasks["routes.by_exchange"].delay(1),
        "router function": lambda: app.tasks["routes.by_function"].delay(1),
        "router class": lambda: app.tasks["routes.by_class"].delay(1),
        "topic exchange": lambda: routes.task.apply_async((1,), exchange=n["events"], routing_key="payment.card.visa"),
        "fanout exchange": lambda: routes.task.apply_async((1,), exchange=n["fan"], routing_key="anything"),
        "queue binding": lambda: routes.task.apply_async((1,), exchange=n["events"], routing_key="card.refund"),
    }
    return ways[way]()


#: each way to route, and the durable queue it reaches
WAYS = {
    "queue name": "pay", "Queue object": "pay", "exchange and routing key": "pay", "Exchange object": "pay",
    "send_task by exchange": "pay", "task_routes dict": "pay", "task_routes glob": "pay",
    "task_routes exchange": "pay", "router function": "audit", "router class": "pay", "topic exchange": "audit",
    "fanout exchange": "mirror", "queue binding": "multi",
}


@pytest.mark.parametrize("way", WAYS)
def test_a_message_routed_to_a_durable_queue_is_durable_inside_a_unit_of_work(sqlite_url, table_prefix, way):
    routes = make_routes(sqlite_url, table_prefix)
    queue = routes.names[WAYS[way]]
    with routes.outbox.transaction():
        result = _send(routes, way)
        (message,) = [m for m in current_unit_of_work().pending if m.message_id == result.id]
        assert (message.durable, message.destination) == (True, queue)
    (received,) = receive(routes.app, queue, 1)
    assert received.id == result.id, "the message lands in the durable queue it was stored for"


@pytest.mark.parametrize("way", WAYS)
def test_a_message_routed_to_a_durable_queue_is_stored_outside_a_unit_of_work(sqlite_url, table_prefix, way,
                                                                               monkeypatch):
    """Outside a unit of work the route is resolved before Celery's sender runs: the message is
    stored (here it stays, as if the process died right after storing it)."""
    routes = make_routes(sqlite_url, table_prefix)
    monkeypatch.setattr(routes.outbox.publisher, "publish_committed", lambda messages, producer=None: None)
    _send(routes, way)
    assert routes.outbox.store.count_outgoing() == 1
    assert _destinations(routes) == [routes.names[WAYS[way]]]


@pytest.mark.parametrize("way", WAYS)
def test_a_message_routed_to_a_plain_queue_is_plain_celery(sqlite_url, table_prefix, way):
    routes = make_routes(sqlite_url, table_prefix, durable=("plain",))
    outside = _send(routes, way)
    with routes.outbox.transaction():
        inside = _send(routes, way)
        assert not [m for m in current_unit_of_work().pending if m.durable]
    assert unsent_rows(routes.outbox.store) == 0 and _destinations(routes) == []
    received = receive(routes.app, routes.names[WAYS[way]], 2)
    assert [m.id for m in received] == [outside.id, inside.id]


@pytest.mark.parametrize("way", WAYS)
def test_the_predicted_route_is_the_route_celery_publishes_with(routes, way, monkeypatch):
    """``published_route`` mirrors Celery's sender: for every way, what it predicts from the
    router's options is the exchange and routing key Celery's sender publishes with."""
    predicted, published = [], []
    real = publish_hook_module.published_route

    def recording(amqp, options):
        predicted.append(real(amqp, options))
        return predicted[-1]

    monkeypatch.setattr(publish_hook_module, "published_route", recording)
    from celery.signals import before_task_publish

    def on_publish(exchange, routing_key, **_):
        published.append((exchange.name if isinstance(exchange, Exchange) else exchange or "", routing_key or ""))

    before_task_publish.connect(on_publish, weak=False)
    try:
        _send(routes, way)
    finally:
        before_task_publish.disconnect(on_publish)
    assert predicted == published and len(published) == 1


def test_the_default_queue_decides_when_it_is_durable(sqlite_url, table_prefix, monkeypatch):
    routes = make_routes(sqlite_url, table_prefix, durable=("pay",), default="pay")
    monkeypatch.setattr(routes.outbox.publisher, "publish_committed", lambda messages, producer=None: None)
    routes.task.delay(1)
    assert _destinations(routes) == [routes.names["pay"]]


def test_a_message_routed_by_exchange_away_from_a_durable_default_queue_is_not_durable(sqlite_url, table_prefix):
    """The default queue object rides along in the options, but the exchange and routing key
    send the message elsewhere: the resolved route decides, not the queue option."""
    routes = make_routes(sqlite_url, table_prefix, durable=("plain",))
    n = routes.names
    with routes.outbox.transaction():
        result = routes.task.apply_async((1,), exchange=n["pay_ex"], routing_key=n["other_key"])
        assert not [m for m in current_unit_of_work().pending if m.durable]
    assert unsent_rows(routes.outbox.store) == 0
    assert [m.id for m in receive(routes.app, n["other"], 1)] == [result.id]
    assert nothing_more(routes.app, n["plain"])


def test_a_routing_key_alone_on_a_direct_exchange_goes_to_the_queue_celery_picks(routes):
    """Celery sends a routing key given without an exchange to the queue it resolved, by name."""
    n = routes.names
    with routes.outbox.transaction():
        result = routes.task.apply_async((1,), queue=n["plain"], routing_key=n["pay_key"])
        assert not [m for m in current_unit_of_work().pending if m.durable]
    assert [m.id for m in receive(routes.app, n["plain"], 1)] == [result.id]


def test_a_headers_exchange_bound_to_a_durable_queue_fails_at_the_call(sqlite_url, table_prefix):
    routes = make_routes(sqlite_url, table_prefix, durable=("hdr",))
    with pytest.raises(UndecidableRoute, match=routes.names["hdr_ex"]):
        routes.task.apply_async((1,), exchange=routes.names["hdr_ex"], routing_key="x")
    assert unsent_rows(routes.outbox.store) == 0


def test_a_headers_exchange_without_a_durable_queue_is_plain_celery(routes):
    assert routes.task.apply_async((1,), exchange=routes.names["hdr_ex"], routing_key="x").id


@pytest.mark.parametrize(("binding_key", "routing_key", "reached"), [
    ("payment.#", "payment", True), ("payment.#", "payment.card.visa", True), ("payment.#", "refund.card", False),
    ("payment.*", "payment.card", True), ("payment.*", "payment", False), ("payment.*", "payment.card.x", False),
    ("#", "", True), ("#.refund", "card.refund", True), ("*.refund", "refund", False), ("a.#.z", "a.z", True),
    ("a.#.z", "a.b.c.z", True), ("a.#.z", "a.b.c", False),
])
def test_topic_bindings_match_word_by_word(binding_key, routing_key, reached):
    queue = Queue("q", Exchange("events", "topic"), routing_key=binding_key)
    assert reached_queues({"q": queue}, "events", routing_key) == (["q"] if reached else [])


@pytest.mark.parametrize("way", WAYS)
def test_the_consumer_finds_the_queue_the_producer_stored_for(routes, way):
    """The worker sees only the exchange and routing key of a delivery: it resolves them to the
    same durable queue as the producer."""
    with routes.outbox.transaction():
        result = _send(routes, way)
        (message,) = [m for m in current_unit_of_work().pending if m.message_id == result.id]
    delivery_info = {"exchange": message.exchange, "routing_key": message.routing_key}
    durable = routes.outbox.settings.durable_queues
    assert queue_of(delivery_info, routes.app, durable) == message.destination == routes.names[WAYS[way]]


def test_the_consumer_prefers_the_queue_it_consumes(sqlite_url, table_prefix):
    """A message that reaches two queues: the worker consuming only the non-durable one runs it as
    plain Celery; one consuming the durable one runs it through the inbox."""
    routes = make_routes(sqlite_url, table_prefix, durable=("audit",))
    n, queues = routes.names, routes.app.amqp.queues
    delivery_info = {"exchange": n["events"], "routing_key": "payment.refund"}  # audit (durable) and multi
    durable = routes.outbox.settings.durable_queues
    queues.select([n["multi"]])
    assert queue_of(delivery_info, routes.app, durable) == n["multi"]
    queues.select([n["multi"], n["audit"]])
    assert queue_of(delivery_info, routes.app, durable) == n["audit"]


def test_the_consumer_reads_the_default_exchange_routing_key_as_the_queue(routes):
    assert queue_of({"exchange": "", "routing_key": routes.names["pay"]}, routes.app) == routes.names["pay"]
    assert queue_of({"exchange": "nowhere", "routing_key": "x"}, routes.app) is None
    assert queue_of(None, routes.app) is None


def test_the_route_of_an_exchange_given_with_the_default_queue(routes):
    n = routes.names
    assert published_route(routes.app.amqp, {"exchange": n["pay_ex"], "routing_key": n["pay_key"],
                                              "queue": routes.app.amqp.queues[n["plain"]]}) == (n["pay_ex"],
                                                                                                n["pay_key"])


def _destinations(routes: Routes) -> list[str]:
    table = routes.outbox.store.tables.outgoing
    with routes.outbox.engine.connect() as conn:
        return [row.destination for row in conn.execute(table.select())]
