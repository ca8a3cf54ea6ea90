"""Django settings of the example shop.

Everything runs on embedded defaults: SQLite for the shop's data and the outbox, and a
filesystem broker (kombu's, with atomic writes: ``example_project/broker.py``), so the demo
needs no server. ``SHOP_DATABASE_URL`` (a PostgreSQL URL) and ``SHOP_BROKER_URL`` (Redis or
RabbitMQ) run the same shop on real services; the ``SHOP_*`` timings are the demo's.
"""

import os
from pathlib import Path

from sqlalchemy.engine import make_url

DATA_DIR = Path(os.environ.get("SHOP_DATA_DIR", ".shop-data")).resolve()


def database(url: str | None) -> dict:
    """Django's DATABASES entry for a PostgreSQL URL, or the SQLite file in ``DATA_DIR``."""
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(DATA_DIR / "shop.sqlite3"),
            "ATOMIC_REQUESTS": True,
            # several processes write one file: a transaction takes the write lock when it begins
            # (as the outbox's own SQLite transactions do) and waits for it, in WAL mode
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30,
                        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"},
        }
    parsed = make_url(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database, "USER": parsed.username or "", "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "", "PORT": str(parsed.port or ""),
        "ATOMIC_REQUESTS": True,  # each view in one transaction: its messages leave after its commit
        "CONN_MAX_AGE": 60, "CONN_HEALTH_CHECKS": True,
    }


SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "the example shop: not a secret")
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "example_project.django_shop.urls"
WSGI_APPLICATION = "example_project.django_shop.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_outbox.django",  # the outbox's tables (manage.py migrate) and its admin
    "example_project.django_shop.orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "/static/"
DATABASES = {"default": database(os.environ.get("SHOP_DATABASE_URL"))}

# Celery, read by celery.py in the CELERY namespace
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL") or "shopfs://"  # see example_project/broker.py
if CELERY_BROKER_URL.startswith(("shopfs", "filesystem")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(DATA_DIR / "broker"), "data_folder_out": str(DATA_DIR / "broker"),
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

# celery-outbox: its tables live in Django's "default" database (CELERY_OUTBOX_DJANGO_DATABASE),
# so an order, its payment message and the payment's inbox claim commit in Django's transactions
CELERY_OUTBOX_DURABLE_QUEUES = ["payments", "cancellations"]
CELERY_OUTBOX_RECOVER_INTERVAL = float(os.environ.get("SHOP_RECOVER_INTERVAL", 5))
CELERY_OUTBOX_NODE_HEARTBEAT_INTERVAL = float(os.environ.get("SHOP_HEARTBEAT_INTERVAL", 5))
CELERY_OUTBOX_NODE_STALE_AFTER = float(os.environ.get("SHOP_NODE_STALE_AFTER", 30))
CELERY_OUTBOX_NODE_STALE_CHECKS = int(os.environ.get("SHOP_NODE_STALE_CHECKS", 3))
CELERY_OUTBOX_REDELIVER_AFTER = float(os.environ.get("SHOP_REDELIVER_AFTER", 600))
CELERY_OUTBOX_KEEP_AFTER_HANDLING = float(os.environ.get("SHOP_KEEP_AFTER_HANDLING", 7 * 24 * 3600))
CELERY_OUTBOX_CLEANUP_INTERVAL = float(os.environ.get("SHOP_CLEANUP_INTERVAL", 60))
CELERY_OUTBOX_ARCHIVE_PATH = os.environ.get("SHOP_ARCHIVE_PATH") or None  # the delivery audit's archive

# the shop's own settings
SHOP_CANCEL_UNPAID_AFTER = float(os.environ.get("SHOP_CANCEL_UNPAID_AFTER", 15 * 60))  # seconds
SHOP_PAYMENT_GATEWAY_SECONDS = float(os.environ.get("SHOP_PAYMENT_GATEWAY_SECONDS", 0.02))
