"""The Django project's Celery app, for worker processes started by the tests
(``celery -A tests.django_project.worker_app worker``), configured as Celery's Django guide
has it: ``DJANGO_SETTINGS_MODULE`` set, the settings read in the ``CELERY`` namespace.

``shop.place`` (an ``IdempotentTask``, optimistic) writes an order with the ORM; on the first
delivery of an order whose number ends in ``-die`` it kills its own pool process after the
ORM write, before the commit (the first death recorded as a file, so that it happens once).
"""

import os
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

app = Celery("django_worker", broker=os.environ.get("DJANGO_WORKER_BROKER_URL", "redis://127.0.0.1:6379/15"))
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(task_default_queue=os.environ.get("DJANGO_WORKER_QUEUE", "dj_worker"), worker_prefetch_multiplier=1)
outbox = Outbox(app, django_database=USING)


def first_death(number: str) -> bool:
    """True the first time only: the death is recorded before it happens."""
    try:
        os.close(os.open(DEATHS / f"{number}.died", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


@app.task(name="shop.place", base=IdempotentTask, bind=True, default_retry_delay=0.2)
def place(self, number):
    Order.objects.using(USING).create(number=number)
    if not transaction.get_connection(USING).in_atomic_block:
        raise AssertionError("the attempt is not inside Django's transaction")
    if number.endswith("-die") and first_death(number):
        os.kill(os.getpid(), 9)  # after the ORM write, before the commit
