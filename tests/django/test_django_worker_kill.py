"""A real prefork worker of the Django project (``tests/django_project/worker_app.py``), on SQLite
and PostgreSQL with Redis: a pool process killed after its task's ORM write and before the commit
loses the write with the claim; Celery sends the task again and it writes the order once."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connections

from ..brokers import purge
from ..django_project.shop.models import Order
from ..services import wait_until
from ..workers import WorkerProcess

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True), pytest.mark.worker]


def test_a_pool_process_killed_before_the_commit_writes_the_order_once(using, redis_url, tmp_path):
    queue = f"dj_worker_{uuid.uuid4().hex[:8]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
        "CELERY_OUTBOX_DJANGO_TEST_DATABASES": json.dumps(
            {alias: connections[alias].settings_dict["NAME"] for alias in ("default", "pg")}),
        "DJANGO_WORKER_DATABASE": using, "DJANGO_WORKER_QUEUE": queue, "DJANGO_WORKER_BROKER_URL": redis_url,
        "DJANGO_WORKER_DEATHS": str(tmp_path),
    }

    worker = WorkerProcess("tests.django_project.worker_app", env, concurrency=2, queues=[queue],
                           log_path=tmp_path / "worker.log").start()
    numbers = [f"order-{uuid.uuid4().hex[:6]}-{kind}" for kind in ("ok", "die", "ok", "die")]
    try:
        worker.wait_ready()
        from celery import Celery

        sender = Celery("dj_sender", broker=redis_url, set_as_current=False)
        for number in numbers:
            sender.send_task("shop.place", (number,), task_id=f"place-{number}", queue=queue)
        wait_until(lambda: Order.objects.using(using).filter(number__in=numbers).count() == len(numbers),
                   timeout=60, message=f"every order written (log: {tmp_path / 'worker.log'})")
        deaths = sorted(path.stem for path in tmp_path.glob("*.died"))
        assert deaths == sorted(n for n in numbers if n.endswith("-die")), "each dying order killed its process once"
        log = worker.log()
        assert log.count("exited with 'signal 9 (SIGKILL)'") == 2, log[-3000:]
        counts = {number: Order.objects.using(using).filter(number=number).count() for number in numbers}
        assert counts == dict.fromkeys(numbers, 1), counts
    finally:
        worker.stop()
        purge(Celery("dj_purge", broker=redis_url, set_as_current=False), queue)
