"""Fault drills inside Django: real worker and beat processes of the Django project
(``tests/django_project/worker_app.py``) on Redis, whose ``IdempotentTask`` bodies write orders with
the ORM, under the faults the SQLAlchemy side is drilled against (``tests/faults``):

* the database refusing connections for 10 s: the worker's Django database and the outbox's store
  (the same database) both reached through a proxy that cuts every connection and refuses new ones;
* a failover: the PostgreSQL server (a throwaway one) restarted mid-run and again between two
  tasks, every connection cut; the next attempts get fresh connections, whether the worker's Django
  connections are closed after each task (Celery's Django fixup) or kept (``CONN_MAX_AGE``);
* a whole worker (its main process and its pool) SIGKILLed while attempts run in it, on a durable
  queue whose broker gives nothing back for an hour: beat's recovery declares the dead nodes dead,
  releases their eager claims and re-publishes the envelopes, for a second worker to run.

Each ends with every order written once (``Order.number`` is unique: a second write would fail its
task and leave a dead letter) and nothing pending: no inbox row running or owned by a node, no
outgoing row, no dead letter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from ..services import TcpProxy, wait_until
from ..throwaway import ThrowawayPostgres, ThrowawayRedis
from ..workers import ROOT
from .drills import Project, Shop, caught_running, numbers_of, start_all, stop_all

OUTAGE_SECONDS = 10.0
STYLES = ["optimistic", "eager"]

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True), pytest.mark.worker]


def alternating(numbers: list[str]) -> list[str]:
    """A style per order: both styles, one order in two each."""
    return [STYLES[n % 2] for n in range(len(numbers))]


def written_at_least(shop: Shop, count: int):
    return lambda: len(shop.orders()) >= count


@pytest.mark.parametrize("using", ["pg"], indirect=True)
def test_database_refusing_connections_for_ten_seconds(using, redis_url, tmp_path):
    """Forty orders in both styles on a durable queue; the worker, the maintenance worker and beat
    reach PostgreSQL (Django's connection and the outbox's alike) through a proxy that, once ten
    orders are written, cuts every connection and refuses new ones for 10 s. Claims, bodies and
    commits that meet it send their message back to the broker; eager claims that could not be
    released are released by their node's heartbeat once the database answers."""
    from django.db import connections

    settings = connections[using].settings_dict
    proxy = TcpProxy(settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432)).start()
    project = Project(tmp_path, using, redis_url, durable=True, maintenance=True, body_seconds=0.1,
                      database_settings={using: {"HOST": "127.0.0.1", "PORT": str(proxy.port)}})
    shop = Shop(project)  # the test's own connections go straight to the server
    numbers = numbers_of(40)
    processes = [project.beat(), project.worker("worker"), project.maintenance_worker()]
    try:
        start_all(processes)
        shop.place(numbers, alternating(numbers))
        wait_until(written_at_least(shop, 10), timeout=30, message="ten orders written")
        proxy.stop()
        outage_ends = time.monotonic() + OUTAGE_SECONDS
        assert len(shop.orders()) < len(numbers), "the outage came after the last order"
        wait_until(lambda: "goes back to the broker" in project.log("worker"), timeout=OUTAGE_SECONDS,
                   message="an attempt meeting the outage")
        time.sleep(max(outage_ends - time.monotonic(), 0))  # the rest of the outage
        proxy.start()
        wait_until(lambda: shop.settled(numbers), timeout=60,
                   message=f"every order written, nothing pending (logs in {tmp_path})")
        shop.assert_each_order_once(numbers)
    finally:
        stop_all(processes)
        proxy.stop()
        project.purge()
        shop.close()


# How a worker keeps its Django connections: Celery's Django fixup closes them before and after each
# task (its default), or keeps them (``CELERY_DB_REUSE_MAX``) for Django's ``CONN_MAX_AGE`` to decide
# (None: persistent).
CONNECTIONS = {
    "closed after each task": ({}, {}),
    "persistent": ({"CONN_MAX_AGE": None}, {"CELERY_DB_REUSE_MAX": 1000}),
}


@pytest.mark.parametrize("using", ["pg"], indirect=True)
@pytest.mark.parametrize("kept", list(CONNECTIONS))
def test_postgres_restarted_mid_run_and_between_tasks(using, redis_url, tmp_path, kept):
    """The worker's Django database and the outbox's store on a throwaway PostgreSQL server, restarted
    twice (a fast shutdown: every session ended, the liveness locks of the nodes with them): once
    while 24 orders in both styles run on a durable queue (attempts that meet it send their message
    back), and once more while the worker waits between tasks, before 16 more orders come. The next
    attempts get fresh connections, Django's and the outbox's, whether the worker's Django
    connections are closed after each task or kept."""
    database, conf = CONNECTIONS[kept]
    with ThrowawayPostgres() as postgres:
        project = Project(tmp_path, using, redis_url, durable=True, maintenance=True, body_seconds=0.1, conf=conf,
                          database_settings={using: {"HOST": "127.0.0.1", "PORT": str(postgres.port),
                                                     "NAME": "test", **database}})
        migrate = subprocess.run([sys.executable, "-m", "django", "migrate", "--database", using, "-v", "0"],
                                 env=dict(project.env(), PYTHONPATH=str(ROOT)), cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        shop = Shop(project, database_url=postgres.url)
        first, then = numbers_of(24), numbers_of(16)
        processes = [project.beat(), project.worker("worker"), project.maintenance_worker()]
        try:
            start_all(processes)
            shop.place(first, alternating(first))
            wait_until(written_at_least(shop, 8), timeout=30, message="eight orders written")
            postgres.restart()
            assert len(shop.orders()) < len(first), "the restart came after the last order"
            wait_until(lambda: shop.settled(first), timeout=60,
                       message=f"every order written, nothing pending (logs in {tmp_path})")
            assert "goes back to the broker" in project.log("worker"), "no attempt met the restart"
            postgres.restart()
            shop.place(then, alternating(then))
            wait_until(lambda: shop.settled(first + then), timeout=60,
                       message=f"every order written after the second restart, nothing pending (logs in {tmp_path})")
            shop.assert_each_order_once(first + then)
        finally:
            stop_all(processes)
            project.purge()
            shop.close()


@pytest.mark.parametrize("style", STYLES)
def test_recovery_takes_over_the_attempts_of_a_killed_node(using, tmp_path, style):
    """Eight orders, two bodies at a time, each a second long. The first worker is SIGKILLed (its
    whole process group) at a moment when two attempts run in it (one on SQLite in the optimistic
    style), their bodies not committed: in the eager style their envelopes and claims committed by
    its pool processes' nodes; in the optimistic style their envelopes committed (SQLite) or the
    sender's outgoing rows held by their open transactions (PostgreSQL). The broker, a Redis of the
    drill's own, would give their messages back only after an hour (a shared one may give them back
    sooner: another consumer's shorter visibility timeout restores every consumer's unacked
    messages). Beat's recovery, run by the maintenance worker, brings them back to a second worker
    (eager: once the dead nodes are declared dead and their claims released; optimistic on
    PostgreSQL: by delivery tracking, the killed transactions having left the sender's rows): each
    order is written once."""
    with ThrowawayRedis(tmp_path / "redis", persistent=False) as redis:
        # the orders wait for the first worker to start: published again only if they wait longer
        project = Project(tmp_path, using, redis.url, durable=True, maintenance=True, body_seconds=1.0,
                          outbox={"redeliver_after": 10},
                          conf={"broker_transport_options": {"visibility_timeout": 3600}})
        shop = Shop(project)
        numbers = numbers_of(8)
        first, second = project.worker("first"), project.worker("second")
        processes = [project.beat(), project.maintenance_worker()]
        try:
            for process in processes:
                process.start()
            # placed before the first worker takes them: on SQLite its bodies would keep the writer waiting
            shop.place(numbers, style)
            processes.append(first.start())
            for process in processes:
                process.wait_ready()
            # on SQLite an optimistic attempt holds the write lock from its claim to its commit: one at a time
            stranded = caught_running(first, shop, bodies=1 if using == "default" and style == "optimistic" else 2)
            first.kill()
            written = shop.orders()
            assert not written.keys() & set(stranded), f"bodies of the stranded attempts committed: {written}"
            processes.append(second.start())
            wait_until(lambda: shop.settled(numbers), timeout=60,
                       message=f"every order written, nothing pending (logs in {tmp_path})")
            shop.assert_each_order_once(numbers)
            recovered = {message_id: shop.store.get_incoming(message_id).recoveries for message_id in stranded}
            assert all(recovered.values()), f"attempts not brought back by recovery or tracking: {recovered}"
            if style == "eager":
                declared = re.findall(r"'nodes_declared_dead': \[\d", project.log("maintenance"))
                assert declared, "recovery declared no node dead"
        finally:
            stop_all(processes)
            shop.close()
