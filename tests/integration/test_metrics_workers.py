"""Prometheus metrics on real PostgreSQL and Redis: scraped over HTTP from a real prefork worker
(``outbox_metrics_port``) and from ``celery outbox metrics``, and counted in the sending process,
checked against what the run did."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from celery_outbox.monitoring import metrics
from celery_outbox.store.base import as_utc

from ..apps.factory import make_shop, strand
from ..brokers import copy_options, purge
from ..conftest import drop_store, handled_row
from ..scenario import Scenario
from ..services import free_port, wait_until
from ..workers import WorkerProcess

ROOT = Path(__file__).parents[2]


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """The samples ``/metrics`` serves: name -> {sorted label pairs: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key))


def registry_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == name and set(labels.items()) <= set(sample.labels.items()))


def test_a_prefork_worker_serves_the_counts_of_its_pool_and_the_stores_gauges(postgres_url, redis_url,
                                                                              table_prefix, tmp_path):
    """Ten attempts handled (six on the durable queue), one failure dead-lettered and one duplicate
    discarded by a worker of two pool processes: its endpoint counts each once, whichever process ran
    it, and the gauges read the same from the store. The sending process counts what it stored and
    published."""
    port = free_port()
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, outbox_metrics_port=port)
    sender_registry = CollectorRegistry()
    sent = metrics.OutboxMetrics(sender_registry).connect(scenario.shop.outbox)
    try:
        shop, plain, durable = scenario.shop, scenario.env["TEST_QUEUE"], scenario.env["TEST_OTHER_QUEUE"]
        worker = scenario.worker(queues=[plain, durable], concurrency=2)
        assert f"celery-outbox: metrics on http://127.0.0.1:{port}/metrics" in worker.log()
        before = scrape(port)
        assert value(before, "celery_outbox_store_up") == 1
        # every known series exists at 0 before its first event, so that increase() sees that event
        started = before["celery_outbox_dead_letters_total"]
        assert started[(("reason", "failed"), ("task", "inbox.fragile"))] == 0
        assert started[(("reason", "malformed"), ("task", ""))] == 0
        assert not any(dict(key)["task"].startswith("celery.") for key in started), "Celery's own tasks"
        assert set(before["celery_outbox_claims_taken_over_total"]) == {(("reason", "dead_node"),),
                                                                         (("reason", "stale"),)}
        assert before["celery_outbox_messages_redelivered_total"][(("queue", durable), ("reason", "worker_lost"))] == 0
        assert before["celery_outbox_task_runtime_seconds_count"][(("task", "inbox.fragile"),)] == 0
        with shop.outbox.transaction():
            for n in range(5):
                shop.pay.apply_async((f"durable-{n}",), task_id=f"durable-{n}", queue=durable)
            shop.fragile.apply_async(("broken",), task_id="broken", queue=durable)
            shop.pay_eager.apply_async(("eager",), task_id="eager", queue=durable)  # its claim needs a node
            for n in range(3):
                shop.pay.apply_async((f"plain-{n}",), task_id=f"plain-{n}", queue=plain)
        shop.pay.apply_async(("copied",), queue=plain, **copy_options("copied"))
        scenario.wait_events("copied", "postrun", 1)
        shop.pay.apply_async(("copied",), queue=plain, **copy_options("copied"))  # a copy of the same send

        def settled():
            samples = scrape(port)
            done = (value(samples, "celery_outbox_claim_to_handled_seconds_count") >= 10
                    and value(samples, "celery_outbox_duplicates_discarded_total") >= 1
                    and value(samples, "celery_outbox_dead_letters_total") >= 1)
            return done and samples

        samples = wait_until(settled, timeout=60, message=f"the worker's metrics to count the run (logs in {tmp_path})")
        assert value(samples, "celery_outbox_claim_to_handled_seconds_count", task="inbox.pay") == 9
        assert value(samples, "celery_outbox_claim_to_handled_seconds_count", task="inbox.pay_eager") == 1
        # every run of a task in the pool, whatever it ended in: the failure and the discarded copy too
        assert value(samples, "celery_outbox_task_runtime_seconds_count", task="inbox.fragile") == 1
        assert value(samples, "celery_outbox_task_runtime_seconds_count", task="inbox.pay_eager") == 1
        assert value(samples, "celery_outbox_task_runtime_seconds_count", task="inbox.pay") == 10
        assert value(samples, "celery_outbox_task_runtime_seconds_sum", task="inbox.pay") > 0
        assert value(samples, "celery_outbox_duplicates_discarded_total", task="inbox.pay", queue=plain) == 1
        assert value(samples, "celery_outbox_dead_letters_total", reason="failed", task="inbox.fragile") == 1
        assert value(samples, "celery_outbox_dead_letters_total") == 1
        # the gauges: what the store holds now
        assert value(samples, "celery_outbox_dead_letter_messages", reason="failed", task="inbox.fragile") == 1
        assert value(samples, "celery_outbox_incoming_messages", status="handled", queue=durable) == 6
        assert value(samples, "celery_outbox_incoming_messages", status="dead", queue=durable) == 1
        store = shop.outbox.store
        with store.begin() as conn:
            failed_at = conn.execute(select(func.max(store.tables.dead_letters.c.failed_at))).scalar()
        assert value(samples, "celery_outbox_newest_dead_letter_timestamp_seconds") == pytest.approx(
            as_utc(failed_at).timestamp(), abs=0.001)
        assert value(samples, "celery_outbox_outgoing_messages", status="pending") == 0
        assert "celery_outbox_oldest_pending_outgoing_timestamp_seconds" not in samples, "none pending: no sample"
        assert value(samples, "celery_outbox_stuck_messages") == 0
        # the nodes by host, not by id and pid: a pool restart adds no series
        beats: dict[str, list[float]] = defaultdict(list)
        for node in store.live_nodes():
            beats[node.hostname].append(as_utc(node.heartbeat_at).timestamp())
        assert beats, "the worker's nodes"
        assert samples["celery_outbox_nodes"] == {(("hostname", host), ("tenant", "")): len(found)
                                                  for host, found in beats.items()}, "the default store's: tenant ''"
        for host, found in beats.items():
            # a heartbeat between the scrape and this read may move the least recent one on
            assert value(samples, "celery_outbox_stalest_heartbeat_timestamp_seconds", hostname=host) \
                <= min(found) + 0.001  # rounded to the millisecond
        # the sender: seven durable messages stored and the unit of work's ten sends published at its
        # commit (the two copies, sent outside a unit of work to a plain queue, are Celery's own sends)
        assert registry_value(sender_registry, "celery_outbox_messages_stored_total", queue=durable) == 7
        assert registry_value(sender_registry, "celery_outbox_messages_stored_total") == 7
        assert registry_value(sender_registry, "celery_outbox_messages_published_total") == 10
        assert registry_value(sender_registry, "celery_outbox_commit_to_publish_seconds_count", via="commit") == 10
        assert registry_value(sender_registry, "celery_outbox_messages_relayed_total") == 0
    finally:
        sent.disconnect()
        scenario.close()


def test_recovery_counts_the_claims_it_takes_over_and_the_envelopes_it_redelivers(postgres_url, redis_url,
                                                                                  table_prefix, tmp_path):
    """A worker SIGKILLed with an eager claim and an optimistic attempt in flight: the recover passes
    count the claim taken over from the dead node and its envelope published again (``worker_lost``),
    and the optimistic message, whose rolled-back claim left the sender's row, published again by
    delivery tracking (``unacknowledged``); a second worker handles each once."""
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, visibility_timeout=3600,
                        outbox_node_stale_after=1, outbox_node_stale_checks=1, outbox_recover_interval=1,
                        outbox_redeliver_after=2)
    registry = CollectorRegistry()
    counted = metrics.OutboxMetrics(registry).connect(scenario.shop.outbox)
    try:
        shop, durable = scenario.shop, scenario.env["TEST_OTHER_QUEUE"]
        scenario.worker_with_both_styles_in_flight().kill()
        scenario.worker(queues=[durable], concurrency=2)

        def recovered():
            shop.outbox.recover()
            return all(handled_row(shop.outbox.store, task_id) for task_id in ("eager-1", "optimistic-1"))

        wait_until(recovered, timeout=60, interval=0.5, message=f"both messages recovered (logs in {tmp_path})")
        assert registry_value(registry, "celery_outbox_claims_taken_over_total", reason="dead_node") >= 1
        eager, optimistic = (shop.outbox.store.get_incoming(task_id) for task_id in ("eager-1", "optimistic-1"))
        lost = registry_value(registry, "celery_outbox_messages_redelivered_total", reason="worker_lost")
        unacknowledged = registry_value(registry, "celery_outbox_messages_redelivered_total",
                                        reason="unacknowledged", queue=durable)
        assert lost == eager.recoveries >= 1
        assert unacknowledged >= optimistic.recoveries >= 1, "published again until a worker had it"
    finally:
        counted.disconnect()
        scenario.close()


def test_the_relay_and_redelivery_are_counted(postgres_url, redis_url, table_prefix):
    """Rows left after their commit are counted when the relay publishes them, with their delay
    from the commit; a sent message no inbox acknowledges is counted when it is published again."""
    shop = make_shop(redis_url, postgres_url, table_prefix, outbox_redeliver_after=0.2)
    registry = CollectorRegistry()
    counted = metrics.OutboxMetrics(registry).connect(shop.outbox)
    try:
        strand(shop, *range(4))
        assert shop.outbox.relay().published == 4
        assert registry_value(registry, "celery_outbox_messages_relayed_total", queue=shop.durable_queue) == 4
        assert registry_value(registry, "celery_outbox_commit_to_publish_seconds_count", via="relay") == 4
        assert registry_value(registry, "celery_outbox_commit_to_publish_seconds_sum", via="relay") > 0
        wait_until(lambda: shop.outbox.recover().redelivered, timeout=20, interval=0.2,
                   message="the unacknowledged messages to be redelivered")
        assert registry_value(registry, "celery_outbox_messages_redelivered_total", queue=shop.durable_queue,
                              reason="unacknowledged") == 4
    finally:
        counted.disconnect()
        purge(shop.app, shop.plain_queue, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()


def test_the_metrics_command_serves_the_stores_gauges_and_says_when_the_store_is_down(postgres_url, redis_url,
                                                                                     table_prefix, tmp_path):
    """``celery outbox metrics``: three messages stranded after their commit show as pending, with the
    age of the oldest; when the status query fails (its tables dropped) the scrape still answers, with
    store_up 0."""
    shop = make_shop(redis_url, postgres_url, table_prefix)
    port = free_port()
    env = {"TEST_BROKER_URL": redis_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": table_prefix,
           "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", "metrics",
                                "--port", str(port)], cwd=ROOT, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        shop.outbox.ready()
        strand(shop, 1, 2, 3)
        samples = wait_until(lambda: _scrape_or_none(port), timeout=60, message="the metrics command to serve")
        assert value(samples, "celery_outbox_store_up") == 1
        assert value(samples, "celery_outbox_outgoing_messages", status="pending", queue=shop.durable_queue) == 3
        outgoing = shop.outbox.store.tables.outgoing
        with shop.outbox.store.begin() as conn:
            oldest = conn.execute(select(func.min(outgoing.c.created_at)).where(outgoing.c.sent_at.is_(None))).scalar()
        assert value(samples, "celery_outbox_oldest_pending_outgoing_timestamp_seconds") == pytest.approx(
            as_utc(oldest).timestamp(), abs=0.001)
        drop_store(shop.outbox.store)
        samples = scrape(port)
        assert value(samples, "celery_outbox_store_up") == 0
        assert "celery_outbox_outgoing_messages" not in samples
    finally:
        command.terminate()
        output = command.communicate(timeout=30)[0]
        purge(shop.app, shop.plain_queue, shop.durable_queue)
        drop_store(shop.outbox.store)
        shop.outbox.engine.dispose()
    assert f"http://127.0.0.1:{port}/metrics" in output


def test_the_metrics_command_answers_while_the_database_refuses_connections(table_prefix, tmp_path):
    """A database nobody listens on: the command still serves, with store_up 0 and no gauge."""
    port = free_port()
    env = {"TEST_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=2",
           "TEST_TABLE_PREFIX": table_prefix, "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", "metrics",
                                "--port", str(port)], cwd=ROOT, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        samples = wait_until(lambda: _scrape_or_none(port) or command.poll() is not None, timeout=60,
                             message="the metrics command to serve")
        assert command.poll() is None, command.communicate()[0]
        assert value(samples, "celery_outbox_store_up") == 0
        assert "celery_outbox_outgoing_messages" not in samples
    finally:
        command.terminate()
        output = command.communicate(timeout=30)[0]
    assert "the store did not answer" in output


def _scrape_or_none(port: int):
    try:
        return scrape(port)
    except OSError:
        return None



def test_a_worker_whose_metrics_port_is_taken_stops_with_one_clear_line(postgres_url, redis_url, table_prefix,
                                                                        tmp_path):
    """The operator asked for metrics: a port another process holds stops the worker at start-up,
    naming the address, rather than running unobserved."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, outbox_metrics_port=port)
        # a temporary folder of the worker's own: the other test process's workers make theirs meanwhile
        worker_temp = tmp_path / "worker-tmp"
        worker_temp.mkdir()
        try:
            worker = WorkerProcess("tests.apps.inbox_app", {**scenario.env, "TMPDIR": str(worker_temp)},
                                   concurrency=1, queues=[scenario.env["TEST_QUEUE"]],
                                   log_path=tmp_path / "worker.log").start()
            scenario.workers.append(worker)
            assert worker.process.wait(timeout=60) != 0
            assert f"cannot serve metrics on 127.0.0.1:{port}" in worker.log()
            assert "Traceback" not in worker.log()
            assert not list(worker_temp.glob("celery-outbox-metrics-*")), \
                "the multiprocess folder the worker made is gone with it"
        finally:
            scenario.close()
