"""The shop's HTTP API. Every view runs in one transaction (``ATOMIC_REQUESTS``): an order
and its messages commit together, and the messages leave only after the commit.

``POST /orders`` (JSON ``{"amount": "12.50", "pay": true}``) places an order, asks for its
payment and schedules its cancellation.
"""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from .models import Order, Payment, Receipt
from .tasks import cancel_unpaid_order, charge_payment


@csrf_exempt  # an API for machines, not a form
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    try:
        body = json.loads(request.body or b"{}")
        amount = Decimal(str(body.get("amount", "0")))
    except (ValueError, InvalidOperation, AttributeError):
        return JsonResponse({"error": "the body must be JSON with a numeric amount"}, status=400)
    if not amount.is_finite() or amount <= 0:
        return JsonResponse({"error": "amount must be a positive number"}, status=400)
    order = Order.objects.create(amount=amount)
    charge = charge_payment.delay(str(order.id)) if body.get("pay", True) else None
    cancel_unpaid_order.apply_async((str(order.id),), countdown=settings.SHOP_CANCEL_UNPAID_AFTER)
    return JsonResponse({"order_id": str(order.id), "charge_task_id": charge.id if charge else None}, status=201)


@require_GET
def get_order(request: HttpRequest, order_id) -> JsonResponse:
    order = get_object_or_404(Order, pk=order_id)
    return JsonResponse({"order_id": str(order.id), "amount": str(order.amount), "status": order.status,
                         "payments": order.payments.count()})


@require_GET
def stats(request: HttpRequest) -> JsonResponse:
    by_status = dict(Order.objects.values_list("status").annotate(n=Count("id")).order_by())
    return JsonResponse({"orders": by_status, "payments": Payment.objects.count(),
                         "receipts": Receipt.objects.count()})
