"""The Django shop under fire: ``python -m example_project.django_demo`` (or ``tox -e django-demo``).

The same fire as ``demo.py``, on the Django project of ``example_project/django_shop``: its views
place orders under ``ATOMIC_REQUESTS`` (served by Django's WSGI application), its
``IdempotentTask`` charges them with the ORM inside Django's transaction; the demo sends
duplicates, SIGKILLs the payments worker in the middle, waits for the shop to settle and prints a
summary that checks itself. The exit code is 0 only when every invariant holds.

Runs on embedded defaults (SQLite and a filesystem broker: no server). ``--database-url``
(PostgreSQL) and ``--broker-url`` (Redis or RabbitMQ) run it on real services; ``manage.py
migrate`` creates the tables.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .demo import Shop, main, tables_holding_rows

SETTINGS = "example_project.django_shop.settings"


class DjangoShop(Shop):
    """The Django shop: Django's ORM and migrations, the outbox's tables in Django's ``default`` database."""

    name = "celery-outbox Django demo"
    command = "example_project.django_demo"
    description = __doc__.splitlines()[0]
    celery_app = "example_project.django_shop"
    environment = {"DJANGO_SETTINGS_MODULE": SETTINGS}  # the shop's, whatever the caller's environment says

    def refusal(self) -> str | None:
        """On SQLite the shop's settings give the database Django 5.1's ``transaction_mode`` and
        ``init_command`` (several processes write one file): older Django refuses them."""
        import django

        if os.environ.get("SHOP_DATABASE_URL") or django.VERSION >= (5, 1):
            return None
        return (f"the shop's SQLite database needs Django 5.1 or later (its transaction_mode IMMEDIATE and WAL: "
                f"several processes write one file), and this is Django {django.get_version()}: install "
                "Django 5.1 or later, or give --database-url a PostgreSQL database")

    def start(self) -> None:
        import django

        django.setup()
        from django.core.wsgi import get_wsgi_application

        from example_project.django_shop.celery import app, outbox
        from example_project.django_shop.orders.tasks import charge_payment

        self.app, self.outbox, self.charge_payment = app, outbox, charge_payment
        self.wsgi = get_wsgi_application()

    def models(self) -> list[Any]:
        from example_project.django_shop.orders.models import Order, Payment, Receipt

        return [Receipt, Payment, Order]  # the referring tables first

    def tables_with_rows(self) -> list[str]:
        from django.db import connection
        from sqlalchemy import table

        existing = set(connection.introspection.table_names())
        return tables_holding_rows(self.outbox, [table(model._meta.db_table) for model in self.models()
                                                 if model._meta.db_table in existing])

    def create_tables(self) -> None:
        """Drop the shop's and the outbox's tables and forget their migrations, then ``migrate``."""
        from django.core.management import call_command
        from django.db import connection
        from django.db.migrations.recorder import MigrationRecorder

        existing = set(connection.introspection.table_names())
        with connection.schema_editor() as editor:
            for model in self.models():
                if model._meta.db_table in existing:
                    editor.delete_model(model)
        self.outbox.store.tables.metadata.drop_all(self.outbox.engine)
        recorder = MigrationRecorder(connection)
        if recorder.has_table():
            recorder.migration_qs.filter(app__in=["orders", "celery_outbox"]).delete()
        call_command("migrate", verbosity=0)

    def effects(self) -> tuple[dict[str, str], dict[str, int], int]:
        from django.db.models import Count

        from example_project.django_shop.orders.models import Order, Payment, Receipt

        statuses = {str(order_id): status for order_id, status in Order.objects.values_list("id", "status")}
        charges = {str(order_id): count for order_id, count in
                   Payment.objects.values_list("order_id").annotate(count=Count("id")).order_by()}
        return statuses, charges, Receipt.objects.count()


if __name__ == "__main__":
    sys.exit(main(shop=DjangoShop()))
