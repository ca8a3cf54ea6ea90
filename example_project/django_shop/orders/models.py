"""The shop's tables: orders, payments, receipts (Django ORM, in the database of the outbox's tables)."""

import uuid

from django.db import models


class Order(models.Model):
    class Status(models.TextChoices):
        PLACED = "placed"
        PAID = "paid"
        CANCELLED = "cancelled"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PLACED)
    placed_at = models.DateTimeField(auto_now_add=True)


class Payment(models.Model):
    """One row per charge. No unique key on purpose: a double charge would show as two rows."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    charged_at = models.DateTimeField(auto_now_add=True)


class Receipt(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="receipts")
    sent_at = models.DateTimeField(auto_now_add=True)
