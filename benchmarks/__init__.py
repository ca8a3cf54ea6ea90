"""Benchmarks of celery-outbox, side by side with plain Celery in the same run.

``python -m benchmarks`` (or ``tox -e bench``) runs every pair on real PostgreSQL and
Redis (RabbitMQ where it differs), prints a table of ratios (ours / plain Celery; ours / a
peer library in its ``vs peer`` block) and writes it as JSON. Not part of the test suite:
speed is measured here, never asserted in a test.
"""
