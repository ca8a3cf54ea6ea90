"""The shop's Celery app, as Celery's Django guide has it, plus ``Outbox(app)``:
``celery -A example_project.django_shop worker|beat``."""

import os

from celery import Celery

from celery_outbox import Outbox

from ..broker import register

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.django_shop.settings")
register()  # the shopfs:// transport of the server-less demo

app = Celery("django_shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
outbox = Outbox(app)
