"""Crash points: make the process die at a chosen boundary, to drill recovery.

No transaction. ``crashpoint(name)`` exits the process at once (``os._exit``: no cleanup, no
commit, no ack) the n-th time it reaches ``name`` when ``CELERY_OUTBOX_CRASHPOINT=<name>[:<n>]``
is set (the first time without ``:<n>``); with ``@<tenant>``, counting only the times it reaches
it working for that tenant (``using_tenant``). Read once per process, unset it costs one
comparison. The points and where each sits are in docs/faults.md (Crash drills).
"""

from __future__ import annotations

import os
import sys
import threading

from .tenancy import current_tenant, valid_tenant_name

__all__ = ["CRASHPOINTS", "ENVIRONMENT_VARIABLE", "EXIT_CODE", "crashpoint"]

ENVIRONMENT_VARIABLE = "CELERY_OUTBOX_CRASHPOINT"
EXIT_CODE = 86
CRASHPOINTS = frozenset({
    "after_claim", "before_commit", "after_commit", "after_publish",
    "during_relay", "during_recover", "during_cleanup",
})


def _parse(value: str | None) -> tuple[str, int, str | None] | None:
    if not value:
        return None
    spec, _, tenant = value.partition("@")
    name, _, count = spec.partition(":")
    if name not in CRASHPOINTS:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={value!r} names no crash point; known: {', '.join(sorted(CRASHPOINTS))}"
        )
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: the count after ':' must be a whole number") from None
    if n < 1:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: the count after ':' must be at least 1")
    if "@" in value and not valid_tenant_name(tenant):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: after '@' comes a tenant name")
    return name, n, tenant or None


_armed = _parse(os.environ.get(ENVIRONMENT_VARIABLE))
_hits = 0
_lock = threading.Lock()


def crashpoint(name: str) -> None:
    """Exit the process at once if ``name`` is the armed crash point and its count is reached."""
    global _hits
    if _armed is None or _armed[0] != name or (_armed[2] is not None and current_tenant() != _armed[2]):
        return
    with _lock:
        _hits += 1
        if _hits >= _armed[1]:
            sys.stderr.write(f"celery-outbox: crash point {name} reached, exiting with {EXIT_CODE}\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
