"""Prometheus metrics for an application that serves its own ``/metrics`` (the ``metrics`` extra).

``celery_outbox.metrics.install(outbox)`` counts the signals of the process it runs in.
"""

from .monitoring.metrics import OutboxMetrics, install

__all__ = ["OutboxMetrics", "install"]
