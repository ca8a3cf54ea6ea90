"""The beat tasks (``celery_outbox.maintenance.beat``): recover and cleanup scheduled on their
intervals, each run expiring after its interval, on the maintenance queue."""

from __future__ import annotations

from ...apps.factory import make_shop


def test_both_beat_tasks_are_scheduled_with_expiry(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix, outbox_maintenance_queue="maintenance",
                     outbox_cleanup_interval=120)
    schedule = shop.app.conf.beat_schedule
    assert schedule["celery_outbox.recover"]["schedule"] == 5.0
    assert schedule["celery_outbox.cleanup"]["schedule"] == 120
    for name in ("celery_outbox.recover", "celery_outbox.cleanup"):
        assert schedule[name]["task"] == name
        assert schedule[name]["options"] == {"expires": schedule[name]["schedule"], "queue": "maintenance"}
        assert name in shop.app.tasks
