"""The shop's Celery app: ``celery -A example_project.shop.celery_app worker|beat``.

``Outbox(app)`` is called before the tasks are defined (the worker and beat import
``tasks``, Celery's ``include``, once the app is built), so tasks consumed from the durable
queues (``payments``, ``cancellations``) go through the inbox.
"""

from celery import Celery

from celery_outbox import Outbox

from ..broker import register

register()  # the shopfs:// transport of the server-less demo
app = Celery("shop", include=["example_project.shop.tasks"])
app.config_from_object("example_project.shop.settings", namespace="CELERY")
outbox = Outbox(app)
