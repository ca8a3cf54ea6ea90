"""The shop's tasks.

* ``charge_payment`` (queue ``payments``, durable): an ``IdempotentTask``. The payment
  row, the order's new status and the receipt message commit together with the inbox
  claim: a redelivered or recovered copy never charges twice.
* ``send_receipt`` (queue ``receipts``, plain): plain Celery, at least once.
* ``cancel_unpaid_order`` (queue ``cancellations``, durable): sent with a countdown when
  the order is placed; held in the database until due, then cancels the order if it
  is still unpaid.
"""

from __future__ import annotations

import time

from celery_outbox import IdempotentTask

from . import settings
from .celery_app import app, outbox
from .models import Order, Payment, Receipt


@app.task(base=IdempotentTask, bind=True, name="shop.charge_payment")
def charge_payment(self, order_id: str) -> str:
    order = self.session.get(Order, order_id)
    if order is None or order.status != "placed":
        return f"order {order_id} is {order.status if order else 'unknown'}: not charged"
    time.sleep(settings.PAYMENT_GATEWAY_SECONDS)  # the payment gateway's answer
    self.session.add(Payment(order_id=order_id, amount=order.amount))
    order.status = "paid"
    send_receipt.delay(order_id)  # published after the commit
    return f"order {order_id} charged {order.amount}"


@app.task(name="shop.send_receipt")
def send_receipt(order_id: str) -> None:
    with outbox.transaction() as session:
        session.add(Receipt(order_id=order_id))


@app.task(name="shop.cancel_unpaid_order")
def cancel_unpaid_order(order_id: str) -> str:
    with outbox.transaction() as session:
        order = session.get(Order, order_id)
        if order is not None and order.status == "placed":
            order.status = "cancelled"
            return f"order {order_id} cancelled"
    return f"order {order_id} was paid"
