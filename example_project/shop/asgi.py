"""The shop's HTTP API, async (FastAPI): ``uvicorn example_project.shop.asgi:api``.

The same API as the Flask one (``web.py``), on the same tables and tasks. Each endpoint runs in
``async with outbox.atransaction() as session:`` (the ``unit_of_work`` dependency): an
``AsyncSession`` whose transaction commits when the endpoint returns, before the response is sent.
``POST /orders`` writes the order and, in that transaction, asks for its payment and schedules its
cancellation: both messages leave only if the order commits, published after the commit by the
outbox's publishing threads, never on the event loop.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Annotated, AsyncIterator

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from . import settings
from .celery_app import outbox
from .models import Order, Payment, Receipt
from .tasks import cancel_unpaid_order, charge_payment

api = FastAPI(title="shop")


async def unit_of_work() -> AsyncIterator[AsyncSession]:
    """The request's unit of work: committed when the endpoint returns (rolled back if it raises);
    what it sent is published after that commit."""
    async with outbox.atransaction() as session:
        yield session


# scope="function": the block ends (commits, and publishes) before the response is sent, so a
# client told 201 knows its order committed; FastAPI's default ends it after the response.
UnitOfWork = Annotated[AsyncSession, Depends(unit_of_work, scope="function")]


class NewOrder(BaseModel):
    amount: Decimal = Field(gt=0, max_digits=10, decimal_places=2)
    pay: bool = True


@api.post("/orders", status_code=201)
async def place_order(order: NewOrder, session: UnitOfWork) -> dict[str, str | None]:
    order_id = str(uuid.uuid4())
    session.add(Order(id=order_id, amount=order.amount, status="placed"))
    charge = charge_payment.delay(order_id) if order.pay else None  # captured: sent after the commit
    cancel_unpaid_order.apply_async((order_id,), countdown=settings.CANCEL_UNPAID_AFTER)
    return {"order_id": order_id, "charge_task_id": charge.id if charge else None}


@api.get("/orders/{order_id}")
async def get_order(order_id: str, session: UnitOfWork) -> dict[str, str | int]:
    order = await session.get(Order, order_id)
    if order is None:
        raise HTTPException(404)
    payments = await session.scalar(select(func.count()).where(Payment.order_id == order_id))
    return {"order_id": order.id, "amount": str(order.amount), "status": order.status, "payments": payments}


@api.get("/stats")
async def stats(session: UnitOfWork) -> dict[str, object]:
    by_status = dict((await session.execute(select(Order.status, func.count()).group_by(Order.status))).all())
    return {"orders": by_status,
            "payments": await session.scalar(select(func.count()).select_from(Payment)),
            "receipts": await session.scalar(select(func.count()).select_from(Receipt))}
