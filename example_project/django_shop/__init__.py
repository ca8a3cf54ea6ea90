"""The example shop as a Django project: orders written with the ORM, payments on a durable queue,
the outbox and the inbox inside Django's own transactions, the admin as the dashboard."""

# as Celery's Django guide has it: the app is loaded with Django, so that @shared_task uses it
from .celery import app as celery_app

__all__ = ["celery_app"]
