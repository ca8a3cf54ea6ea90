"""The core every side stands on: runtime, settings, sessions, node, crash points, integration seam.

No transaction of its own.
"""
