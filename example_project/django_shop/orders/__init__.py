"""The shop's orders: the ORM models, the API's views and the Celery tasks."""
