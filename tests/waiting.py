"""Waiting for a condition instead of sleeping: imports nothing of pytest or of the tests package,
so the install matrix's scenario (``tests/install/smoke.py``), run by a fresh environment's own
interpreter, uses it too (copied next to it)."""

from __future__ import annotations

import time


def wait_until(condition, timeout: float = 20.0, interval: float = 0.05, message="condition"):
    """Poll ``condition`` until it returns a truthy value and return that value; raise
    ``AssertionError`` naming ``message`` after ``timeout`` seconds (a callable ``message`` is
    asked then: a worker's log as it stands when the wait gave up)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            waited_for = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g} s waiting for {waited_for}")
        time.sleep(interval)
