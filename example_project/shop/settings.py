"""Celery settings of the shop, in the style Django projects write them (``namespace="CELERY"``).

Everything runs on embedded defaults: SQLite for the shop's data and the outbox, and
a filesystem broker (kombu's, with atomic writes: ``example_project/broker.py``), so the demo needs no
server. Point
``SHOP_DATABASE_URL`` and ``SHOP_BROKER_URL`` at PostgreSQL and Redis or RabbitMQ to
run the same shop on real services.
"""

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("SHOP_DATA_DIR", ".shop-data")).resolve()
BROKER_DIR = DATA_DIR / "broker"

CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL") or "shopfs://"  # see broker.py
if CELERY_BROKER_URL.startswith(("shopfs", "filesystem")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR), "data_folder_out": str(BROKER_DIR),
        "control_folder": str(DATA_DIR / "control"), "polling_interval": 0.05,
    }
    CELERY_WORKER_ENABLE_REMOTE_CONTROL = False  # the filesystem transport has no broadcast
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ROUTES = {
    "shop.charge_payment": {"queue": "payments"},
    "shop.send_receipt": {"queue": "receipts"},
    "shop.cancel_unpaid_order": {"queue": "cancellations"},
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "beat-schedule")

# celery-outbox: the same database as the shop's own tables, so an order and its messages commit together
CELERY_OUTBOX_DATABASE_URL = os.environ.get("SHOP_DATABASE_URL") or f"sqlite:///{DATA_DIR / 'shop.sqlite3'}"
# the async API's engine (asgi.py): unset, the store's URL with its async driver (aiosqlite, psycopg's
# async mode); postgresql+asyncpg://... for asyncpg
CELERY_OUTBOX_ASYNC_DATABASE_URL = os.environ.get("SHOP_ASYNC_DATABASE_URL") or None
CELERY_OUTBOX_DURABLE_QUEUES = ["payments", "cancellations"]
CELERY_OUTBOX_RECOVER_INTERVAL = float(os.environ.get("SHOP_RECOVER_INTERVAL", 5))
CELERY_OUTBOX_NODE_HEARTBEAT_INTERVAL = float(os.environ.get("SHOP_HEARTBEAT_INTERVAL", 5))
CELERY_OUTBOX_NODE_STALE_AFTER = float(os.environ.get("SHOP_NODE_STALE_AFTER", 30))
CELERY_OUTBOX_NODE_STALE_CHECKS = int(os.environ.get("SHOP_NODE_STALE_CHECKS", 3))
CELERY_OUTBOX_REDELIVER_AFTER = float(os.environ.get("SHOP_REDELIVER_AFTER", 600))
CELERY_OUTBOX_KEEP_AFTER_HANDLING = float(os.environ.get("SHOP_KEEP_AFTER_HANDLING", 7 * 24 * 3600))
CELERY_OUTBOX_CLEANUP_INTERVAL = float(os.environ.get("SHOP_CLEANUP_INTERVAL", 60))
CELERY_OUTBOX_ARCHIVE_PATH = os.environ.get("SHOP_ARCHIVE_PATH") or None  # the delivery audit's archive
# the tenants (tenants_demo.py), named in SHOP_TENANTS ("acme,globex"), each in a database of its own: an
# SQLite file beside the default store's, or on PostgreSQL a schema of the default store's database
TENANTS = [name.strip() for name in os.environ.get("SHOP_TENANTS", "").split(",") if name.strip()]


def tenant_place(name: str) -> str | dict[str, str]:
    """Where tenant ``name``'s tables are (a value of ``outbox_tenants``)."""
    if CELERY_OUTBOX_DATABASE_URL.startswith("postgresql"):
        return {"url": CELERY_OUTBOX_DATABASE_URL, "schema": f"tenant_{name}"}
    return f"sqlite:///{DATA_DIR / f'tenant-{name}.sqlite3'}"


CELERY_OUTBOX_TENANTS = {name: tenant_place(name) for name in TENANTS} or None

# the shop's own settings
CANCEL_UNPAID_AFTER = float(os.environ.get("SHOP_CANCEL_UNPAID_AFTER", 15 * 60))  # seconds
PAYMENT_GATEWAY_SECONDS = float(os.environ.get("SHOP_PAYMENT_GATEWAY_SECONDS", 0.02))
