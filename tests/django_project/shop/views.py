"""A view under ``ATOMIC_REQUESTS``: the order and its payment message commit together."""

from django.http import HttpResponse

from .models import Order

# the task the view sends, set by the test that serves it
SEND = {}


def place_order(request, order_id: str, using: str):
    Order.objects.using(using).create(number=order_id)
    SEND["payment"].apply_async((order_id,), task_id=f"pay-{order_id}")
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after sending")
    return HttpResponse("placed")
