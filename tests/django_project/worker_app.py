"""The Django project's Celery app, for worker and beat processes started by the tests
(``celery -A tests.django_project.worker_app worker``), configured as Celery's Django guide
has it: ``DJANGO_SETTINGS_MODULE`` set, the settings read in the ``CELERY`` namespace.

``shop.place`` (an ``IdempotentTask``, optimistic) and ``shop.place_eager`` (the eager style)
write an order with the ORM; on the first delivery of an order whose number ends in ``-die``
they kill their own pool process after the ORM write, before the commit (the first death
recorded as a file, so that it happens once).

The environment says where and how: ``DJANGO_WORKER_DATABASE`` (the Django database of the
outbox and the orders), ``DJANGO_WORKER_QUEUE``, ``DJANGO_WORKER_BROKER_URL``,
``DJANGO_WORKER_DEATHS`` (the directory of the death records), ``DJANGO_WORKER_OUTBOX`` (more
``Outbox(app, ...)`` settings as JSON: durable queues, fast maintenance), ``DJANGO_WORKER_CONF``
(more Celery settings as JSON) and ``DJANGO_WORKER_BODY_SECONDS`` (how long a body waits before
its ORM write, so that a drill finds bodies running).
"""

import json
import os
import time
from pathlib import Path

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

import django  # noqa: E402

django.setup()

from django.db import transaction  # noqa: E402

from celery_outbox import IdempotentTask, Outbox  # noqa: E402

from .shop.models import Order  # noqa: E402

USING = os.environ.get("DJANGO_WORKER_DATABASE", "default")
DEATHS = Path(os.environ.get("DJANGO_WORKER_DEATHS", "/tmp"))
BODY_SECONDS = float(os.environ.get("DJANGO_WORKER_BODY_SECONDS", "0"))

app = Celery("django_worker", broker=os.environ.get("DJANGO_WORKER_BROKER_URL", "redis://127.0.0.1:6379/15"))
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(task_default_queue=os.environ.get("DJANGO_WORKER_QUEUE", "dj_worker"), worker_prefetch_multiplier=1,
                **json.loads(os.environ.get("DJANGO_WORKER_CONF", "{}")))
outbox = Outbox(app, django_database=USING, **json.loads(os.environ.get("DJANGO_WORKER_OUTBOX", "{}")))


def first_death(number: str) -> bool:
    """True the first time only: the death is recorded before it happens."""
    try:
        os.close(os.open(DEATHS / f"{number}.died", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def place_order(number: str) -> None:
    if BODY_SECONDS:
        time.sleep(BODY_SECONDS)  # before the write: on SQLite, two bodies wait side by side
    Order.objects.using(USING).create(number=number)
    if not transaction.get_connection(USING).in_atomic_block:
        raise AssertionError("the attempt is not inside Django's transaction")
    if number.endswith("-die") and first_death(number):
        os.kill(os.getpid(), 9)  # after the ORM write, before the commit


@app.task(name="shop.place", base=IdempotentTask, bind=True, default_retry_delay=0.2)
def place(self, number):
    place_order(number)


@app.task(name="shop.place_eager", base=IdempotentTask, bind=True, default_retry_delay=0.2)
def place_eager(self, number):
    place_order(number)


place_eager.idempotency = "eager"
