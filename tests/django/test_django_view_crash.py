"""A process running a Django view's atomic block dies at Django's commit (``os._exit`` at a
crash point), on SQLite and PostgreSQL with Redis: before the commit nothing is stored or
published; after it, the durable message's row, written with the commit marked sent, is
published by redelivery once due, and a real worker of the project writes the order once.
Nothing is left pending."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_outbox.core.crashpoints import EXIT_CODE

from ..brokers import nothing_more
from ..services import wait_until
from .drills import Project, Shop, numbers_of

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True), pytest.mark.worker]

ROOT = Path(__file__).resolve().parents[2]


def run_view(project: Project, number: str, crashpoint: str) -> subprocess.CompletedProcess:
    """The view's work (``tests/django_project/crashing_view.py``) in a process of its own."""
    env = {**os.environ, **project.env(), "CELERY_OUTBOX_CRASHPOINT": crashpoint, "PYTHONPATH": str(ROOT)}
    script = "import sys; from tests.django_project.crashing_view import main; main(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", script, number], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("crashpoint", ["before_commit", "after_commit"])
def test_a_view_process_dying_at_djangos_commit_loses_nothing(using, redis_url, tmp_path, crashpoint):
    project = Project(tmp_path, using, redis_url, durable=True, maintenance=True)
    shop = Shop(project)
    (number,) = numbers_of(1)
    try:
        done = run_view(project, number, crashpoint)
        assert done.returncode == EXIT_CODE, done.stderr
        if crashpoint == "before_commit":
            assert not any(shop.pending().values()), shop.pending()
            assert nothing_more(shop.app, project.queue), "nothing published"
            return
        (row,) = shop.read(f"SELECT message_id, sent_at IS NOT NULL FROM {shop.store.tables.outgoing.name}")
        assert row == (f"place-{number}", True), "committed with Django's commit, marked sent"
        assert nothing_more(shop.app, project.queue), "the process died before the publish"
        wait_until(lambda: shop.outbox.recover().redelivered == 1, timeout=30,
                   message="redelivery to publish the row once due")
        worker = project.worker("worker").start()
        try:
            worker.wait_ready()
            wait_until(lambda: shop.settled([number]), timeout=60,
                       message=f"the order written, nothing pending (log: {worker.log_path})")
        finally:
            worker.stop()
        shop.assert_each_order_once([number])
    finally:
        shop.close()
        project.purge()
