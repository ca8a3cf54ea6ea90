"""The shop's HTTP API (Flask): ``flask --app example_project.shop.web run``.

``POST /orders`` places an order and, in the same ``outbox.transaction()``, asks for
its payment and schedules its cancellation: both messages leave only if the order
commits.
"""

from __future__ import annotations

import uuid
from decimal import Decimal

from flask import Flask, abort, jsonify, request
from sqlalchemy import func, select

from . import settings
from .celery_app import outbox
from .models import Base, Order, Payment, Receipt
from .tasks import cancel_unpaid_order, charge_payment

api = Flask("shop")


def create_tables() -> None:
    outbox.ready()
    Base.metadata.create_all(outbox.engine)


@api.post("/orders")
def place_order():
    body = request.get_json(force=True, silent=True) or {}
    try:
        amount = Decimal(str(body.get("amount", "0")))
    except ArithmeticError:
        abort(400, "amount must be a number")
    if amount <= 0:
        abort(400, "amount must be positive")
    order_id = str(uuid.uuid4())
    with outbox.transaction() as session:
        session.add(Order(id=order_id, amount=amount, status="placed"))
        charge = charge_payment.delay(order_id) if body.get("pay", True) else None
        cancel_unpaid_order.apply_async((order_id,), countdown=settings.CANCEL_UNPAID_AFTER)
    return jsonify(order_id=order_id, charge_task_id=charge.id if charge else None), 201


@api.get("/orders/<order_id>")
def get_order(order_id: str):
    with outbox.transaction() as session:
        order = session.get(Order, order_id)
        if order is None:
            abort(404)
        payments = session.scalar(select(func.count()).where(Payment.order_id == order_id))
        return jsonify(order_id=order.id, amount=str(order.amount), status=order.status, payments=payments)


@api.get("/stats")
def stats():
    with outbox.transaction() as session:
        by_status = dict(session.execute(select(Order.status, func.count()).group_by(Order.status)).all())
        return jsonify(orders=by_status,
                       payments=session.scalar(select(func.count()).select_from(Payment)),
                       receipts=session.scalar(select(func.count()).select_from(Receipt)))
