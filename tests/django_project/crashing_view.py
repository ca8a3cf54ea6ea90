"""A Django view's work in a process of its own, for crash drills: inside
``transaction.atomic()``, send ``shop.place`` for an order, as a view does. Run with
``CELERY_OUTBOX_CRASHPOINT`` set, the process dies at that point (``os._exit``): at
``before_commit``, as Django's commit is about to insert the durable message; at
``after_commit``, once the commit is made and before the publish.

The environment is a drill's worker's (``tests/django/drills.py``: ``Project.env``)."""

from __future__ import annotations

import sys

from django.db import transaction

from .worker_app import USING, app


def main(number: str) -> None:
    with transaction.atomic(using=USING):
        app.send_task("shop.place", (number,), task_id=f"place-{number}")
    sys.exit(0)  # not reached when the crash point fires
