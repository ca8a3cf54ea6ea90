"""Maintenance that beat and the CLI run: relay, recovery, cleanup, dead-letter replay and purge.

Transaction boundary: short transactions of their own, in bounded batches. Guarantee: relay and
recovery publish every stranded row again, and cleanup keeps the tables bounded.
"""
