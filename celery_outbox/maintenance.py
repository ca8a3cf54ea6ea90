"""Beat tasks: ``celery_outbox.recover`` on ``outbox_recover_interval``.

Each beat task calls the same ``Outbox`` method the CLI calls; registering them
is all ``Outbox(app)`` does, so running ``celery beat`` is all a user does. Each
periodic entry expires after one interval, so a backlog of missed runs never
piles up, and is routed to ``outbox_maintenance_queue`` when that is set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["RECOVER_TASK", "register_beat_tasks", "schedule_beat_tasks"]

RECOVER_TASK = "celery_outbox.recover"


def register_beat_tasks(outbox: "Outbox") -> None:
    """Define the maintenance tasks on the app (names above)."""
    app = outbox.app

    @app.task(name=RECOVER_TASK, ignore_result=True, shared=False)
    def recover() -> dict[str, Any]:
        """Publish outgoing rows nobody published after their commit."""
        result = outbox.relay()
        return {"published": result.published, "failed": result.failed,
                "dead_lettered": result.dead_lettered, "broker_error": result.broker_error}


def schedule_beat_tasks(outbox: "Outbox") -> None:
    """Add the maintenance tasks to the beat schedule (called once the settings are read)."""
    app, settings = outbox.app, outbox.settings
    options: dict[str, Any] = {"expires": settings.recover_interval}
    if settings.maintenance_queue:
        options["queue"] = settings.maintenance_queue
    app.add_periodic_task(settings.recover_interval, app.signature(RECOVER_TASK), name=RECOVER_TASK, **options)
