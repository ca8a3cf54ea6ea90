"""A real prefork worker of the Django project (``tests/django_project/worker_app.py``), on SQLite
and PostgreSQL with Redis: a pool process killed after its task's ORM write and before the commit
loses the write (and, in the optimistic style, the claim with it; in the eager style the claim,
committed before the body, stays running); Celery sends the task again, the new attempt takes the
claim over and writes the order once. Nothing is left running or owned."""

from __future__ import annotations

import pytest

from ..services import wait_until
from .drills import Project, Shop, numbers_of

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True), pytest.mark.worker]


def answered(log: str) -> int:
    """Pool processes the worker saw killed and whose task it sent again (``retry_on_worker_lost``)."""
    return min(log.count("exited with 'signal 9 (SIGKILL)'"),
               log.count("Retry in 0.2s: WorkerLostError('Worker exited prematurely: signal 9 (SIGKILL)"))


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
        wait_until(lambda: answered(worker.log()) == 2 and shop.settled(numbers), timeout=60,
                   message=f"both deaths answered, every order written, nothing pending (log: {worker.log_path})")
        deaths = sorted(path.stem for path in tmp_path.glob("*.died"))
        assert deaths == sorted(n for n in numbers if n.endswith("-die")), "each dying order killed its process once"
        assert worker.log().count("exited with 'signal 9 (SIGKILL)'") == 2, worker.log()[-3000:]
        shop.assert_each_order_once(numbers)
    finally:
        worker.stop()
        project.purge()
        shop.close()
