"""The install matrix's app: a durable queue consumed by an ``IdempotentTask``, configured from the
environment (``SMOKE_DATABASE_URL``, ``SMOKE_BROKER_URL``, ``SMOKE_DIR``; ``SMOKE_DJANGO=1`` runs it
inside a Django project with ``celery_outbox.django`` installed). It imports only what the install
line under test provides: celery-outbox, Celery, SQLAlchemy and the line's extras."""

from __future__ import annotations

import os

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Table, insert

DIR = os.environ["SMOKE_DIR"]
NAME = os.environ["SMOKE_NAME"]  # unique to a run: its queues and tables, on servers other runs share
QUEUE, MAINTENANCE_QUEUE = f"{NAME}_durable", f"{NAME}_maintenance"
BROKER_URL = os.environ["SMOKE_BROKER_URL"]
DJANGO = os.environ.get("SMOKE_DJANGO") == "1"

if DJANGO:
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["celery_outbox.django"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.path.join(DIR, "django.sqlite3"),
                               "OPTIONS": {"timeout": 30}}},
        USE_TZ=True,
    )
    django.setup()

if BROKER_URL.startswith("shopfs"):  # the demo's server-less broker (example_project/broker.py)
    from example_project.broker import register

    register()

app = Celery("smoke_app", broker=BROKER_URL)
app.conf.update(
    outbox_durable_queues=[QUEUE],
    outbox_maintenance_queue=MAINTENANCE_QUEUE,
    outbox_table_prefix=f"{NAME}_outbox_",
    task_default_queue=QUEUE,
    broker_transport_options={"data_folder_in": os.path.join(DIR, "broker"),
                              "data_folder_out": os.path.join(DIR, "broker")},
    broker_connection_retry_on_startup=True,
)
if not DJANGO:
    app.conf.outbox_database_url = os.environ["SMOKE_DATABASE_URL"]
if os.environ.get("SMOKE_ASYNC_DATABASE_URL"):
    app.conf.outbox_async_database_url = os.environ["SMOKE_ASYNC_DATABASE_URL"]
if os.environ.get("SMOKE_METRICS_PORT"):
    app.conf.outbox_metrics_port = int(os.environ["SMOKE_METRICS_PORT"])

from celery_outbox import IdempotentTask, Outbox  # noqa: E402  (after Django's settings)

outbox = Outbox(app)

effects = Table(f"{NAME}_effects", MetaData(), Column("id", Integer, primary_key=True, autoincrement=True),
                Column("order_id", Integer, nullable=False))


@app.task(base=IdempotentTask, bind=True, name="smoke.record")
def record(self, order_id):
    """One row per message, committed with the inbox claim."""
    if DJANGO:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {effects.name} (order_id) VALUES (%s)", [order_id])
    else:
        self.connection.execute(insert(effects).values(order_id=order_id))
