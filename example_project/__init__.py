"""The example shop: a Flask API, Celery tasks and celery-outbox, with a demo that breaks it on purpose."""
