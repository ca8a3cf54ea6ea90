"""Tenants whose store is down, as the worker's main process last saw them.

A pool process that cannot reach its delivery's tenant store parks the message in the default
store (``AttemptRecords.park``) and tells the main process so (``Parked``, an ``Ignore``: Celery
acks the message). The main process then parks that tenant's next messages itself, from the
consumer (``MessageGuard``), for ``TENANT_DOWN_PAUSE`` seconds: they take no pool slot and no
prefetch slot while their store is down, so the other tenants' messages keep their pace. After the
pause one message goes to the pool again and finds out. No transaction: a dictionary in memory.
"""

from __future__ import annotations

import threading
import time

from celery.exceptions import Ignore

__all__ = ["TENANT_DOWN_PAUSE", "Parked", "TenantOutages"]

# Seconds the main process parks a tenant's messages itself after a pool process found its store down
TENANT_DOWN_PAUSE = 5.0


class Parked(Ignore):
    """The attempt's tenant store is down and its message is parked in the default store: Celery
    acks it (as for ``Ignore``), and the worker's main process learns that the tenant is down."""


class TenantOutages:
    """The tenants whose store a pool process found down, each until its pause ends."""

    def __init__(self, pause: float = TENANT_DOWN_PAUSE):
        self.pause = pause
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def down(self, tenant: str) -> None:
        """``tenant``'s store was found down just now."""
        with self._lock:
            self._until[tenant] = time.monotonic() + self.pause

    def is_down(self, tenant: str | None) -> bool:
        """Whether ``tenant``'s messages are parked without a try (its pause has not ended)."""
        if tenant is None:
            return False
        with self._lock:
            until = self._until.get(tenant)
            if until is None:
                return False
            if time.monotonic() < until:
                return True
            del self._until[tenant]  # the pause is over: the next message tries the store
            return False
