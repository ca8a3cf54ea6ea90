"""The fault drills of an asyncio producer: async units of work under crashes, cancellations,
loops shut down mid-publish, terminated connections and a broker out of reach.

The shop of tests/apps/fault_app.py runs with its producer placing orders in async units of work
(``FAULT_ASYNC``: batches of orders at once, ``outbox.abegin()`` and ``outbox.atransaction()`` in
turn), real workers and beat on PostgreSQL and Redis (see ``harness``). The faults hit the producer
alone: the consumers' drills are in test_crash_scenarios.py and test_connection_faults.py. Each
prints the drills' one line; the invariants are those of ``harness.assert_invariants``: nothing
lost, effects exactly once, nothing pending.
"""

from __future__ import annotations

import re

import pytest

from celery_outbox.core.crashpoints import ENVIRONMENT_VARIABLE

from ..conftest import SUMMARY_LINE
from ..services import free_port, require
from .chaos import ConnectionKiller
from .harness import FaultRun, assert_invariants, play

ORDERS = 80


@pytest.fixture
def services():
    return require("redis"), require("postgres")


def async_driver_conf(driver: str, database_url: str) -> dict[str, str]:
    """The settings that put the producer's async units of work on ``driver``."""
    if driver == "psycopg":
        return {}
    return {"outbox_async_database_url": database_url.replace("+psycopg", "+asyncpg")}


@pytest.mark.parametrize(("crashpoint", "driver"), [("after_commit:9", "psycopg"), ("after_commit:9", "asyncpg")],
                         ids=["after_commit", "after_commit-asyncpg"])
def test_an_async_producer_dying_at_a_crash_point_loses_nothing(services, tmp_path, record_property, crashpoint,
                                                                driver):
    """The producer process dies (``os._exit``) after a commit, every ninth time, in the middle of a
    batch of concurrent async units (on psycopg's async mode and on asyncpg): the rows stored
    marked sent name a node recovery declares dead, and it sends them. The supervisor starts it
    again, as a service manager would. The points before the commit and after the publish are the
    sync units' code (``_store_durable``, ``Publisher.publish_committed``), drilled in
    test_crash_scenarios.py; a unit cut off before its commit is drilled by the cancellations."""
    redis_url, database_url = services
    run = FaultRun(f"async producer, {crashpoint} ({driver})", tmp_path, redis_url, database_url, orders=ORDERS,
                   async_producer="1", **async_driver_conf(driver, database_url))
    run.producer_env[ENVIRONMENT_VARIABLE] = crashpoint
    outcome = play(run, record_property)
    assert outcome.kills > 0, f"{outcome.line()}: the crash point never fired"
    assert_invariants(outcome)


def test_an_async_producer_whose_units_are_cancelled_and_whose_loops_shut_down_loses_nothing(
        services, tmp_path, record_property):
    """The producer cancels each batch's units still running 0 to 60 ms after it starts: before
    their commits (rolled back: placed again later), while the COMMIT's answer is awaited, or
    after it, while the publishing threads publish (the publish goes on); every other batch, it
    lets ``asyncio.run`` shut the loop down on them instead. Cancelled units both committed and
    did not."""
    redis_url, database_url = services
    run = FaultRun("async producer, units cancelled and loops shut down", tmp_path, redis_url, database_url,
                   orders=ORDERS, async_producer="cancel")
    def cancellations() -> tuple[int, int]:
        counts = re.findall(r"cancelled units committed (\d+), not committed (\d+)", run._log_text("producer"))
        return tuple(map(int, counts[-1])) if counts else (0, 0)

    outcome = play(run, record_property, more_faults=lambda: sum(cancellations()))
    committed, not_committed = cancellations()
    record_property(SUMMARY_LINE, f"  cancelled units: {committed} had committed, {not_committed} had not")
    assert committed > 0 and not_committed > 0, f"cancelled: committed {committed}, not committed {not_committed}"
    assert_invariants(outcome)


def test_an_async_producer_whose_connections_are_terminated_loses_nothing(services, tmp_path, record_property):
    """From a tenth of the orders paid to nine tenths, one of the producer's database sessions
    (its async units' and its publishing threads') is terminated every 0.02 to 0.1 s
    (``pg_terminate_backend``): a unit whose connection dropped before or during its COMMIT is
    placed again, or, when the COMMIT went through, its rows are sent."""
    redis_url, database_url = services
    run = FaultRun("async producer, connections terminated at random", tmp_path, redis_url, database_url,
                   orders=ORDERS, pace=0.02, async_producer="1")
    killer = ConnectionKiller(database_url, {"producer": run.application_name("producer")}, run.count_fault,
                              interval=(0.02, 0.1), kinds=("producer",))
    run.at_progress(0.1, killer.start).at_progress(0.9, killer.stop)
    try:
        outcome = play(run, record_property)
    finally:
        killer.stop()
    assert killer.killed.get("producer", 0) > 0, f"no producer connection terminated: {dict(killer.killed)}"
    assert_invariants(outcome)


def test_an_async_producer_that_cannot_reach_the_broker_loses_nothing(services, tmp_path, record_property):
    """The producer's broker URL points at a port nobody listens on: every publish after an async
    commit fails in the publishing threads, the loop is never blocked by it, and the relay sends
    every committed message."""
    redis_url, database_url = services
    run = FaultRun("async producer, broker out of reach", tmp_path, redis_url, database_url, orders=ORDERS,
                   async_producer="1", producer_broker_url=f"redis://127.0.0.1:{free_port()}/0")
    outcome = play(run, record_property)
    assert_invariants(outcome)
