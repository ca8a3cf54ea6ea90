"""A small shop built on celery-outbox: orders over HTTP, payments on a durable queue, receipts, cancellations."""
