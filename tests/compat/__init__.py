"""The compatibility suite: Celery's user-visible behaviours with and without celery-outbox."""
