"""celery-outbox inside Django: ``INSTALLED_APPS += ["celery_outbox.django"]``.

Transaction boundary: every publish inside ``transaction.atomic()`` on the outbox's Django
database joins Django's transaction: a durable message's row is written through Django's own
connection and commits with the user's writes, and everything is published after Django's
commit. The store is that database (``CELERY_OUTBOX_DJANGO_DATABASE``, ``"default"``) unless
``CELERY_OUTBOX_DATABASE_URL`` says otherwise; ``manage.py migrate`` creates its tables, as
``celery outbox migrate`` does. This package imports nothing of Django until it is used.
"""
