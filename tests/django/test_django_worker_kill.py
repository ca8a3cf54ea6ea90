"""A real prefork worker of the Django project (``tests/django_project/worker_app.py``), on SQLite
and PostgreSQL with Redis: a pool process killed after its task's ORM write and before the commit
loses the write (and, in the optimistic style, the claim with it; in the eager style the claim,
committed before the body, stays running); Celery sends the task again (or the pool puts back a
job whose start it had not yet read), the new attempt takes the claim over and writes the order
once. Nothing is left running or owned."""

from __future__ import annotations

import pytest

from ..services import wait_until
from .drills import Project, Shop, numbers_of

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True), pytest.mark.worker]


def deaths_seen(log: str) -> int:
    """Pool processes the worker's main process saw killed.

    Their tasks run again one of two ways, and the test accepts both: an accepted job is sent again
    as a new attempt (``retry_on_worker_lost``, logged as a retry), and a job whose child died before
    the main process read that it accepted it is put back by the pool, with no retry logged."""
    return log.count("exited with 'signal 9 (SIGKILL)'")


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_pool_process_killed_before_the_commit_writes_the_order_once(using, redis_url, tmp_path, style):
    project = Project(tmp_path, using, redis_url)
    shop = Shop(project)
    worker = project.worker("worker").start()
    numbers = [f"{number}-{kind}" for number, kind in zip(numbers_of(4), ("ok", "die", "ok", "die"), strict=True)]
    try:
        worker.wait_ready()
        shop.place(numbers, style)
        # the worker's main process may tell of a death after the next attempt has written the order
        wait_until(lambda: deaths_seen(worker.log()) == 2 and shop.settled(numbers), timeout=60,
                   message=f"both deaths seen, every order written, nothing pending (log: {worker.log_path})")
        deaths = sorted(path.stem for path in tmp_path.glob("*.died"))
        assert deaths == sorted(n for n in numbers if n.endswith("-die")), "each dying order killed its process once"
        assert deaths_seen(worker.log()) == 2, worker.log()[-3000:]
        shop.assert_each_order_once(numbers)
    finally:
        worker.stop()
        project.purge()
        shop.close()
