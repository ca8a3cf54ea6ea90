"""Django's async views (``async def view(request)``), served by Django's async test client and by
its ASGI handler (as an ASGI server runs it: each request's sync code in a thread of its own), on
SQLite and PostgreSQL, with a real Redis broker. A send inside ``transaction.atomic()`` reached
through ``sync_to_async`` joins Django's transaction as in a sync view: the durable row commits with
the order and the messages go out after the commit, or nothing on a rollback. A send in the async
view itself, after the async ORM's calls (autocommit: Django's async ORM has no transactions), is
stored in a transaction of its own and published, from the event loop's thread, without Django's
``SynchronousOnlyOperation``. Django refuses an async view under ``ATOMIC_REQUESTS``."""

from __future__ import annotations

import asyncio
from contextlib import nullcontext
from typing import Any, Callable
from urllib.parse import urlsplit

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connections, transaction
from django.http import HttpResponse
from django.test import AsyncClient
from django.urls import path

from ..brokers import nothing_more, receive
from ..django_project.shop.models import Order
from .test_django_transactions import order_id, outgoing_rows

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)

# the test's shop (the ``shop`` fixture), for the views; what ``place_order`` saw inside its block
SHOP: dict[str, Any] = {}
SEEN: list[dict[str, Any]] = []


async def notify(number: str) -> None:
    """An async helper that sends the order's payment (a durable queue) and receipt (a plain one)."""
    shop = SHOP["shop"]
    shop.pay.apply_async((number,), task_id=f"pay-{number}")
    shop.email.delay(number)


def place_order(number: str, using: str, fail: bool, from_coroutine: bool) -> None:
    """The view's unit of work, sync: the order, its payment and its receipt in one atomic block,
    sent by the block or by a coroutine it runs with ``async_to_sync``; what the block's
    connection (and on PostgreSQL another one) and the broker see before its end."""
    shop = SHOP["shop"]
    with transaction.atomic(using=using):
        Order.objects.using(using).create(number=number)
        if from_coroutine:
            async_to_sync(notify)(number)
        else:
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
            shop.email.delay(number)
        rows = outgoing_rows(shop, through_django=True)
        if connections[using].vendor == "postgresql":  # SQLite's other connections wait for the block's lock
            rows += outgoing_rows(shop)
        SEEN.append({"rows": rows,
                     "published": not (nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain))})
        if fail:
            raise RuntimeError("the order fails after sending")


def non_atomic(view: Callable[..., Any]) -> Callable[..., Any]:
    """Exempt ``view`` from the project's ``ATOMIC_REQUESTS`` on both databases: Django refuses to
    serve an async view under it."""
    return transaction.non_atomic_requests(using="default")(transaction.non_atomic_requests(using="pg")(view))


@non_atomic
async def atomic_block_view(request, number: str, using: str) -> HttpResponse:
    await sync_to_async(place_order)(number, using, bool(request.GET.get("fail")), bool(request.GET.get("coroutine")))
    return HttpResponse("placed")


@non_atomic
async def async_orm_view(request, number: str, using: str) -> HttpResponse:
    shop = SHOP["shop"]
    orders = Order.objects.using(using)
    await orders.acreate(number=number)
    order = await orders.aget(number=number)
    shop.pay.apply_async((order.number,), task_id=f"pay-{order.number}")
    shop.email.delay(order.number)
    SEEN.append({"sent": order.number, "orders": await orders.filter(number=number).acount()})
    if request.GET.get("fail"):
        raise RuntimeError("the view fails after sending")
    return HttpResponse("placed")


async def atomic_requests_view(request, number: str, using: str) -> HttpResponse:
    SHOP["shop"].pay.apply_async((number,), task_id=f"pay-{number}")
    return HttpResponse("placed")


urlpatterns = [
    path("async/atomic/<str:number>/<str:using>/", atomic_block_view),
    path("async/orm/<str:number>/<str:using>/", async_orm_view),
    path("async/atomic-requests/<str:number>/<str:using>/", atomic_requests_view),
]


@pytest.fixture
def views(shop, settings):
    """This module's views served for ``shop``."""
    settings.ROOT_URLCONF = __name__
    SHOP["shop"] = shop
    SEEN.clear()
    yield shop
    SHOP.clear()


def through_async_client(url: str) -> int:
    """GET ``url`` with Django's ``AsyncClient`` (its sync parts run in the test's thread); the
    response's status (500 for a view that raised)."""
    return async_to_sync(AsyncClient(raise_request_exception=False).get)(url).status_code


def through_asgi_handler(url: str) -> int:
    """GET ``url`` through Django's ``ASGIHandler`` on an event loop of its own, as an ASGI server
    calls it; the response's status."""
    from django.core.handlers.asgi import ASGIHandler

    parts = urlsplit(url)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": parts.path, "raw_path": parts.path.encode(), "query_string": parts.query.encode(),
             "root_path": "", "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 40000),
             "server": ("testserver", 80)}

    async def request() -> int:
        sent: list[dict[str, Any]] = []
        body = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if body:
                return body.pop()
            await asyncio.Event().wait()  # the client stays until the response is sent
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await ASGIHandler()(scope, receive, send)
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    return asyncio.run(request())


@pytest.fixture(params=[through_async_client, through_asgi_handler], ids=["AsyncClient", "ASGIHandler"])
def get(request, views) -> Callable[[str], int]:
    """GET a URL of this module's views, through Django's async test client or its ASGI handler."""
    return request.param


def committed_together(shop, number: str) -> bool:
    """On PostgreSQL, whether the order's row and its payment's outgoing row carry one transaction id."""
    with connections[shop.using].cursor() as cursor:
        cursor.execute(f"SELECT xmin::text FROM {Order._meta.db_table} WHERE number = %s", [number])
        (order_xid,) = cursor.fetchone()
        cursor.execute(f"SELECT xmin::text FROM {shop.outbox.store.tables.outgoing.name} WHERE message_id = %s",
                       [f"pay-{number}"])
        return cursor.fetchone() == (order_xid,)


# the block sends, or a coroutine it runs with async_to_sync sends (on the view's event loop)
SENDERS = {"the block sends": "", "a coroutine in the block sends": "coroutine=1&"}


@pytest.mark.parametrize("sender", list(SENDERS.values()), ids=list(SENDERS))
def test_an_atomic_block_through_sync_to_async_stores_the_message_with_its_commit_and_publishes_after_it(get, sender):
    shop, number = SHOP["shop"], order_id()
    assert get(f"/async/atomic/{number}/{shop.using}/?{sender}") == 200
    assert SEEN == [{"rows": [], "published": False}], "inside the block: no row, on any connection; nothing out"
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]
    assert outgoing_rows(shop) == [f"pay-{number}"]
    assert Order.objects.using(shop.using).filter(number=number).exists()
    if shop.using == "pg":
        assert committed_together(shop, number), "the row committed in the order's transaction"
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


@pytest.mark.parametrize("sender", list(SENDERS.values()), ids=list(SENDERS))
def test_an_atomic_block_through_sync_to_async_that_rolls_back_stores_and_publishes_nothing(get, sender):
    shop, number = SHOP["shop"], order_id()
    assert get(f"/async/atomic/{number}/{shop.using}/?{sender}fail=1") == 500
    assert SEEN == [{"rows": [], "published": False}], "the block sent, then raised"
    assert outgoing_rows(shop) == []
    assert not Order.objects.using(shop.using).filter(number=number).exists()
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


def test_a_send_after_the_async_orms_calls_is_stored_in_its_own_transaction_and_published(get):
    """No atomic block: the async ORM's ``acreate`` committed on its own, and the durable send,
    made on the event loop's thread, is stored in a transaction of its own (on PostgreSQL, not the
    order's) and published; Django raises no ``SynchronousOnlyOperation``."""
    shop, number = SHOP["shop"], order_id()
    assert get(f"/async/orm/{number}/{shop.using}/") == 200
    assert SEEN == [{"sent": number, "orders": 1}]
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]
    assert outgoing_rows(shop) == [f"pay-{number}"]
    if shop.using == "pg":
        assert not committed_together(shop, number), "autocommit: the order and the row commit apart"
    assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)


def test_an_async_view_that_fails_after_its_autocommitted_writes_keeps_them_and_its_messages(get):
    """Outside an atomic block nothing is rolled back: the order stays, and so its messages go out."""
    shop, number = SHOP["shop"], order_id()
    assert get(f"/async/orm/{number}/{shop.using}/?fail=1") == 500
    assert SEEN == [{"sent": number, "orders": 1}]
    assert Order.objects.using(shop.using).filter(number=number).exists()
    assert outgoing_rows(shop) == [f"pay-{number}"]
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]


def test_django_refuses_an_async_view_under_atomic_requests_before_it_sends(views):
    """The project's databases have ``ATOMIC_REQUESTS``: Django raises rather than serve the async
    view outside the transaction it asks for; the view never runs, nothing is sent."""
    shop, number = views, order_id()
    with pytest.raises(RuntimeError, match="You cannot use ATOMIC_REQUESTS with async views"):
        async_to_sync(AsyncClient().get)(f"/async/atomic-requests/{number}/{shop.using}/")
    assert outgoing_rows(shop) == []
    assert nothing_more(shop.app, shop.durable)


@pytest.mark.parametrize("rolls_back", [False, True], ids=["commits", "rolls back"])
def test_a_send_in_a_coroutine_that_async_to_sync_runs_inside_an_atomic_block_joins_it(views, rolls_back):
    """``async_to_sync`` runs the coroutine on an event loop in another thread, whose Django
    connection has no block open: its send is captured in the waiting thread's block all the same,
    stored with its commit and published after it, or dropped with its rollback."""
    shop, number = views, order_id()
    with pytest.raises(RuntimeError) if rolls_back else nullcontext():
        with transaction.atomic(using=shop.using):
            Order.objects.using(shop.using).create(number=number)
            async_to_sync(notify)(number)
            assert outgoing_rows(shop, through_django=True) == [], "written with the COMMIT, not before"
            assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)
            if rolls_back:
                raise RuntimeError("the block fails after the coroutine sent")
    if rolls_back:
        assert outgoing_rows(shop) == [] and not Order.objects.using(shop.using).filter(number=number).exists()
        assert nothing_more(shop.app, shop.durable) and nothing_more(shop.app, shop.plain)
        return
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]
    assert [m.args for m in receive(shop.app, shop.plain, 1)] == [[number]]
    assert outgoing_rows(shop) == [f"pay-{number}"]
    if shop.using == "pg":
        assert committed_together(shop, number), "the row committed in the order's transaction"
