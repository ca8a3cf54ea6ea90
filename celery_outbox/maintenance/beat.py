"""Beat tasks: ``celery_outbox.recover`` and ``celery_outbox.cleanup``.

Each beat task calls the same function the CLI calls (``recover.recover`` and
``cleanup.cleanup``); registering them is all ``Outbox(app)`` does, so running ``celery beat`` is
all a user does. Transaction boundary: those of the functions they call. Each periodic entry
expires after one interval, so missed runs never pile up, and is routed to
``outbox_maintenance_queue`` when that is set. Both are safe to run on several workers at once.
With tenants (``outbox_tenants``), the periodic run works on the default store and sends one
task of its kind per tenant, each working on that tenant's store alone: a tenant whose database
is down, slow or locked fails or delays its own task, never another tenant's; the tenants' order
turns each run, so none is always last.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.runtime import Runtime
from ..core.tenancy import using_tenant
from .cleanup import cleanup
from .recover import recover

__all__ = ["CLEANUP_TASK", "RECOVER_TASK", "register_beat_tasks", "schedule_beat_tasks"]

RECOVER_TASK = "celery_outbox.recover"
CLEANUP_TASK = "celery_outbox.cleanup"


def register_beat_tasks(runtime: Runtime) -> None:
    """Define the maintenance tasks on the app (names above)."""
    app = runtime.app

    @app.task(name=RECOVER_TASK, ignore_result=True, shared=False)
    def recover_task(tenant: str | None = None) -> dict[str, Any]:
        """Dead nodes, released claims, unsent and due outgoing rows, redelivery, stranded envelopes
        (of ``tenant``'s store; without one, of the default store, and one task per tenant sent)."""
        if tenant is None:
            send_per_tenant(runtime, RECOVER_TASK, runtime.settings.recover_interval)
        with using_tenant(tenant):
            return {"tenant": tenant, **recover(runtime).as_dict()}

    @app.task(name=CLEANUP_TASK, ignore_result=True, shared=False)
    def cleanup_task(tenant: str | None = None) -> dict[str, Any]:
        """Delete ended inbox rows past their keep-until and dead letters past retention; archive sent records
        (per tenant, as ``recover_task``)."""
        if tenant is None:
            send_per_tenant(runtime, CLEANUP_TASK, runtime.settings.cleanup_interval)
        with using_tenant(tenant):
            return {"tenant": tenant, **cleanup(runtime).as_dict()}


def send_per_tenant(runtime: Runtime, name: str, interval: float, turn: int | None = None) -> list[str]:
    """Send the maintenance task ``name`` once for each tenant, each expiring after ``interval``
    as the periodic entry does; returns the tenants in the order sent. Asking ``outbox_tenants``
    fails this run (the next one asks again); the default store's pass runs after this either way.

    The order turns by one tenant each interval (``turn``: the interval's number since the epoch,
    the same in every process), so when workers fall behind and the last tasks of a run expire,
    they are not the same tenants' every time: each tenant is first once in every ``len(tenants)``
    runs."""
    tenants = runtime.tenants()
    if tenants:
        start = (int(time.time() // interval) if turn is None else turn) % len(tenants)
        tenants = tenants[start:] + tenants[:start]
    options = maintenance_options(runtime, interval)
    for tenant in tenants:
        runtime.app.signature(name, kwargs={"tenant": tenant}, **options).apply_async()
    return tenants


def maintenance_options(runtime: Runtime, interval: float) -> dict[str, Any]:
    """The sending options of a maintenance task run every ``interval`` seconds."""
    options: dict[str, Any] = {"expires": interval}
    if runtime.settings.maintenance_queue:
        options["queue"] = runtime.settings.maintenance_queue
    return options


def schedule_beat_tasks(runtime: Runtime) -> None:
    """Add the maintenance tasks to the beat schedule (called once the settings are read)."""
    app, settings = runtime.app, runtime.settings
    for name, interval in ((RECOVER_TASK, settings.recover_interval), (CLEANUP_TASK, settings.cleanup_interval)):
        app.add_periodic_task(interval, app.signature(name), name=name, **maintenance_options(runtime, interval))
