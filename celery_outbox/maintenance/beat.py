"""Beat tasks: ``celery_outbox.recover`` and ``celery_outbox.cleanup``.

Each beat task calls the same function the CLI calls (``recover.recover`` and
``cleanup.cleanup``); registering them is all ``Outbox(app)`` does, so running ``celery beat`` is
all a user does. Transaction boundary: those of the functions they call. Each periodic entry
expires after one interval, so missed runs never pile up, and is routed to
``outbox_maintenance_queue`` when that is set. Both are safe to run on several workers at once.
"""

from __future__ import annotations

from typing import Any

from ..core.runtime import Runtime
from .cleanup import cleanup
from .recover import recover

__all__ = ["CLEANUP_TASK", "RECOVER_TASK", "register_beat_tasks", "schedule_beat_tasks"]

RECOVER_TASK = "celery_outbox.recover"
CLEANUP_TASK = "celery_outbox.cleanup"


def register_beat_tasks(runtime: Runtime) -> None:
    """Define the maintenance tasks on the app (names above)."""
    app = runtime.app

    @app.task(name=RECOVER_TASK, ignore_result=True, shared=False)
    def recover_task() -> dict[str, Any]:
        """Dead nodes, released claims, unsent and due outgoing rows, redelivery, stranded envelopes."""
        return recover(runtime).as_dict()

    @app.task(name=CLEANUP_TASK, ignore_result=True, shared=False)
    def cleanup_task() -> dict[str, Any]:
        """Delete ended inbox rows past their keep-until and dead letters past retention; archive sent records."""
        return cleanup(runtime).as_dict()


def schedule_beat_tasks(runtime: Runtime) -> None:
    """Add the maintenance tasks to the beat schedule (called once the settings are read)."""
    app, settings = runtime.app, runtime.settings
    for name, interval in ((RECOVER_TASK, settings.recover_interval), (CLEANUP_TASK, settings.cleanup_interval)):
        options: dict[str, Any] = {"expires": interval}
        if settings.maintenance_queue:
            options["queue"] = settings.maintenance_queue
        app.add_periodic_task(interval, app.signature(name), name=name, **options)
