"""celery-outbox inside Django: ``INSTALLED_APPS += ["celery_outbox.django"]``.

With the app installed, the outbox's message store is Django's database
``CELERY_OUTBOX_DJANGO_DATABASE`` (``"default"``) unless ``CELERY_OUTBOX_DATABASE_URL``
says otherwise; ``manage.py migrate`` creates its tables (the same tables and indexes
as ``celery outbox migrate``); and every publish inside ``transaction.atomic()`` on that
database joins Django's transaction: a durable message's row is written through
Django's own connection, and everything is published after Django's commit.

This package imports nothing of Django until it is used.
"""
