"""The shop's tasks, found by ``app.autodiscover_tasks()``.

* ``charge_payment`` (queue ``payments``, durable): an ``IdempotentTask``. Its inbox claim,
  the payment row, the order's new status and the receipt message commit in one Django
  transaction: a redelivered or recovered copy never charges twice.
* ``send_receipt`` (queue ``receipts``, plain): plain Celery, at least once.
* ``cancel_unpaid_order`` (queue ``cancellations``, durable): sent with a countdown when the
  order is placed; held in the database until due, then cancels the order if it is still unpaid.
"""

from __future__ import annotations

import time

from celery import shared_task
from django.conf import settings

from celery_outbox import IdempotentTask

from .models import Order, Payment, Receipt


@shared_task(base=IdempotentTask, bind=True, name="shop.charge_payment")
def charge_payment(self, order_id: str) -> str:
    order = Order.objects.select_for_update().filter(pk=order_id).first()
    if order is None or order.status != Order.Status.PLACED:
        return f"order {order_id} is {order.status if order else 'unknown'}: not charged"
    time.sleep(settings.SHOP_PAYMENT_GATEWAY_SECONDS)  # the payment gateway's answer
    Payment.objects.create(order=order, amount=order.amount)
    order.status = Order.Status.PAID
    order.save(update_fields=["status"])
    send_receipt.delay(order_id)  # published after the commit
    return f"order {order_id} charged {order.amount}"


@shared_task(name="shop.send_receipt")
def send_receipt(order_id: str) -> None:
    Receipt.objects.create(order_id=order_id)


@shared_task(name="shop.cancel_unpaid_order")
def cancel_unpaid_order(order_id: str) -> str:
    cancelled = Order.objects.filter(pk=order_id, status=Order.Status.PLACED).update(status=Order.Status.CANCELLED)
    return f"order {order_id} cancelled" if cancelled else f"order {order_id} was paid"
