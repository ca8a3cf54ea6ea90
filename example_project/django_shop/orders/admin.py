"""The shop's orders in Django's admin, beside celery-outbox's pages (dead letters, messages, status)."""

from django.contrib import admin

from .models import Order, Payment


class PaymentInline(admin.TabularInline):
    model = Payment
    extra = 0
    readonly_fields = ["amount", "charged_at"]


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "amount", "status", "placed_at"]
    list_filter = ["status"]
    inlines = [PaymentInline]
