"""What operators watch: Prometheus metrics, OpenTelemetry traces and the health check.

No transaction that writes: each reads what the other sides announce or store; none of them
writes a row or changes an outcome.
"""
