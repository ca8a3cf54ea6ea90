"""The shop's Celery app: ``celery -A example_project.shop.celery_app worker|beat``.

``Outbox(app)`` is called before the tasks are defined, so tasks consumed from the
durable queues (``payments``, ``cancellations``) go through the inbox.
"""

from celery import Celery

from celery_outbox import Outbox

from ..broker import register

register()  # the shopfs:// transport of the server-less demo
app = Celery("shop")
app.config_from_object("example_project.shop.settings", namespace="CELERY")
outbox = Outbox(app)

from . import tasks  # noqa: E402,F401 - registers the tasks on the app
