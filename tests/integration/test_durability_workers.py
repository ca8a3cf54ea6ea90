"""Durability on real PostgreSQL and Redis with real worker and beat processes: a SIGKILLed worker's
messages recovered by another, concurrent recover runs, durable scheduling, dead-letter replay."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from kombu.messaging import Producer
from sqlalchemy import func, insert, select

from celery_outbox.maintenance.relay import redeliver
from celery_outbox.store import as_utc, utcnow

from ..apps.factory import make_shop, strand
from ..brokers import copy_options, nothing_more, purge, receive
from ..conftest import drop_store, handled_row, outgoing_rows, unsent_rows
from ..scenario import Scenario
from ..services import wait_until

ROOT = Path(__file__).parents[2]


def test_a_sigkilled_workers_messages_are_delivered_by_another_worker(postgres_url, redis_url, table_prefix,
                                                                        tmp_path):
    """Both styles in flight on a durable queue when the whole worker is SIGKILLed. Redis would give the
    messages back only after its one-hour visibility timeout: recovery, run by celery beat, re-publishes
    them and a second worker runs each exactly once. The eager claim committed the envelope, which
    recovery publishes again once the dead node's claim is released; the optimistic attempt committed
    nothing, and its rollback left the sender's outgoing row, which delivery tracking publishes again
    (here after two seconds)."""
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, visibility_timeout=3600,
                        outbox_recover_interval=1, outbox_node_stale_after=2, outbox_redeliver_after=2)
    try:
        shop, durable = scenario.shop, scenario.env["TEST_OTHER_QUEUE"]
        victim = scenario.worker_with_both_styles_in_flight()
        assert shop.outbox.store.get_incoming("eager-1").owner != 0, "the eager claim is owned by the victim"
        assert shop.outbox.store.get_incoming("optimistic-1") is None, "the optimistic claim is not committed"
        victim.kill()

        scenario.worker(queues=[scenario.env["TEST_QUEUE"], durable], concurrency=2)
        scenario.beat()
        for task_id in ("eager-1", "optimistic-1"):
            row = wait_until(lambda task_id=task_id: handled_row(shop.outbox.store, task_id), timeout=60,
                             message=f"{task_id} to be recovered and handled (logs in {tmp_path})")
            assert row.recoveries >= 1 and row.owner == 0
            assert len(shop.effects(task_id)) == 1, "effects exactly once"
            # the postrun event is written just after the commit that marked the row handled
            states = [e.state for e in scenario.wait_events(task_id, "postrun", 1)]
            assert states[0] == "SUCCESS" and set(states[1:]) <= {"IGNORED"}
        assert shop.outbox.store.live_nodes() and all(
            n.dead_at is None for n in shop.outbox.store.live_nodes()), "the dead nodes were forgotten"
    finally:
        scenario.close()


def test_two_concurrent_recover_runs_publish_each_row_once(postgres_url, redis_url, table_prefix, tmp_path):
    shop = make_shop(redis_url, postgres_url, table_prefix)
    shop.outbox.ready()
    try:
        sent = {result.id for result in strand(shop, *range(3000))}
        assert unsent_rows(shop.outbox.store) == 3000
        env = {"TEST_BROKER_URL": redis_url, "TEST_DATABASE_URL": postgres_url, "TEST_TABLE_PREFIX": table_prefix,
               "TEST_RELAY_BATCH_SIZE": "50"}
        context = multiprocessing.get_context("spawn")
        barrier, results = context.Barrier(2), context.Queue()
        from ..apps.recover_runner import run

        runs = [context.Process(target=run, args=(env, barrier, results)) for _ in range(2)]
        for process in runs:
            process.start()
        outcomes = [results.get(timeout=120) for _ in runs]
        for process in runs:
            process.join(timeout=60)
            assert process.exitcode == 0
        published = [outcome["published"] for outcome in outcomes]
        assert sum(published) == 3000, published
        assert all(count > 0 for count in published), f"both runs took part: {published}"
        received = [message.id for message in receive(shop.app, shop.durable_queue, 3000, timeout=30)]
        assert len(received) == 3000 and set(received) == sent, "each row published exactly once"
        assert nothing_more(shop.app, shop.durable_queue)
        assert unsent_rows(shop.outbox.store) == 0
    finally:
        purge(shop.app, shop.durable_queue)
        drop_store(shop.outbox.store)


def test_a_long_countdown_to_a_durable_queue_goes_out_once_in_its_window_with_its_eta(postgres_url, redis_url,
                                                                                      table_prefix):
    """Held in the outgoing table until its eta is ``outbox_release_ahead`` (2 s here) away, then
    published once by a recover pass, with the eta the sender set: the worker holds it until
    then, as in Celery (tests/integration/test_schedules_and_events.py runs it on a worker)."""
    shop = make_shop(redis_url, postgres_url, table_prefix, outbox_recover_interval=1, outbox_release_ahead=2)
    shop.outbox.ready()
    try:
        with shop.outbox.transaction():
            result = shop.durable.apply_async(("later",), countdown=4)
        eta = as_utc(_deliver_at(shop))
        assert nothing_more(shop.app, shop.durable_queue), "held in the database, not in the broker"
        assert shop.outbox.recover().relay.published == 0, "not before its window"
        wait_until(lambda: utcnow() >= eta - timedelta(seconds=2), timeout=10, message="the window to open")
        assert shop.outbox.recover().relay.published == 1
        (message,) = receive(shop.app, shop.durable_queue, 1)
        assert (message.id, message.args) == (result.id, ["later"])
        assert datetime.fromisoformat(message.headers["eta"]) == eta, "the broker sees the eta that was sent"
        assert shop.outbox.recover().relay.published == 0
        assert nothing_more(shop.app, shop.durable_queue), "published once"
    finally:
        purge(shop.app, shop.durable_queue)
        drop_store(shop.outbox.store)


def _deliver_at(shop):
    table = shop.outbox.store.tables.outgoing
    with shop.outbox.store.begin() as conn:
        return conn.execute(select(table.c.deliver_at)).scalar_one()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.inbox_app", "outbox", *args],
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_dead_letter_replay_round_trip(postgres_url, redis_url, table_prefix, tmp_path):
    """A task fails for good, an operator lists and inspects the dead letter, fixes the data and
    replays it: the task runs again as a new attempt and succeeds; a second replay of the handled
    message is discarded."""
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path)
    try:
        shop = scenario.shop
        scenario.worker()
        shop.fragile.apply_async(("order-9",), task_id="order-9")
        assert [e.state for e in scenario.wait_events("order-9", "postrun", 1)] == ["FAILURE"]
        assert shop.outbox.store.get_incoming("order-9").status == "dead"

        listed = cli(scenario.env, "dead-letters", "list", "--task", "inbox.fragile", "--since", "1h")
        assert listed.returncode == 0, listed.stderr
        assert "order-9" in listed.stdout and "LookupError" in listed.stdout
        (letter,) = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter(task="inbox.fragile"))
        shown = cli(scenario.env, "dead-letters", "show", str(letter.id))
        assert shown.returncode == 0, shown.stderr
        assert "order 9" not in shown.stdout and "order order-9 has no fix yet" in shown.stdout
        assert "Traceback" in shown.stdout

        with shop.outbox.engine.begin() as conn:
            conn.execute(insert(shop.metadata.tables[f"{table_prefix}effects"]).values(order_id="fixed:order-9",
                                                                                        attempt=0))
        replayed = cli(scenario.env, "dead-letters", "replay", str(letter.id))
        assert replayed.returncode == 0, replayed.stderr
        assert "replayed 1 dead letter(s)" in replayed.stdout
        assert [e.state for e in scenario.wait_events("order-9", "postrun", 2)] == ["FAILURE", "SUCCESS"]
        assert len(shop.effects("order-9")) == 1
        row = shop.outbox.store.get_incoming("order-9")
        assert (row.status, row.replays) == ("handled", 1)
        letter = shop.outbox.store.get_dead_letter(letter.id)
        assert letter.replay_count == 1 and as_utc(letter.replayed_at) > utcnow() - timedelta(minutes=5)

        again = cli(scenario.env, "dead-letters", "replay", "--all", "--task", "inbox.fragile")
        assert again.returncode == 0, again.stderr
        assert [e.state for e in scenario.wait_events("order-9", "postrun", 3)] == ["FAILURE", "SUCCESS", "IGNORED"]
        assert len(shop.effects("order-9")) == 1, "a replay of a handled message is a duplicate"

        purged = cli(scenario.env, "dead-letters", "purge", "--older-than", "0s")
        assert purged.returncode == 0, purged.stderr
        assert "purged 1 dead letter(s)" in purged.stdout
        assert shop.outbox.store.count_dead_letters() == 0
    finally:
        scenario.close()


def test_recover_and_cleanup_commands_print_what_they_did(postgres_url, redis_url, table_prefix, tmp_path):
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path)
    try:
        store = scenario.shop.outbox.store
        now = utcnow()
        with store.begin() as conn:
            for n in range(3):
                store.insert_incoming(conn, dict(message_id=f"old{n}", destination="", status="handled",
                                                 received_at=now, keep_until=now - timedelta(seconds=1)))
        recovered = cli(scenario.env, "recover")
        assert recovered.returncode == 0, recovered.stderr
        assert "nodes declared dead: none" in recovered.stdout and "relay: published 0" in recovered.stdout
        cleaned = cli(scenario.env, "cleanup", "--json")
        assert cleaned.returncode == 0, cleaned.stderr
        assert json.loads(cleaned.stdout)["incoming_deleted"] == 3
        assert store.count_incoming() == 0
    finally:
        scenario.close()


def redelivery_due(store) -> bool:
    """Whether every sent outgoing row has come due for its redelivery, read without a lock."""
    with store.engine.connect() as conn:
        table = store.tables.outgoing
        waiting = select(func.count()).select_from(table).where(table.c.redeliver_at > utcnow())
        return conn.execute(waiting).scalar() == 0


@pytest.mark.parametrize("relay_pass", ["relay", "redeliver"])
def test_outbox_stale_time_hands_the_rows_of_a_hung_relay_to_another(postgres_url, table_prefix, relay_pass):
    """A relay whose publish hangs on the broker holds its rows' locks; with outbox_outbox_stale_time
    PostgreSQL ends its idle transaction and a second relay publishes the rows. The same for
    delivery tracking's pass (``redeliver``), whose rows an inbox's claim would otherwise wait for:
    a row sent once, not acknowledged past ``outbox_redeliver_after``."""
    shop = make_shop("memory://", postgres_url, table_prefix, outbox_outbox_stale_time=1,
                     outbox_redeliver_after=0.1)
    shop.outbox.ready()
    runtime = shop.outbox.runtime

    def one_pass() -> int:
        if relay_pass == "relay":
            return shop.outbox.relay().published
        return redeliver(runtime)[0]

    real_publish = Producer.publish
    hung, release = threading.Event(), threading.Event()

    def publish(self, body, *args, **kwargs):
        if threading.current_thread().name == "hung-relay":
            hung.set()
            release.wait(60)
        return real_publish(self, body, *args, **kwargs)

    errors: list[BaseException] = []

    def hung_relay():
        try:
            one_pass()
        except BaseException as exc:  # noqa: BLE001 - its database session was ended: expected
            errors.append(exc)

    try:
        (sent,) = strand(shop, "stuck")
        published_before = 0
        if relay_pass == "redeliver":  # sent once, then due for its redelivery
            assert shop.outbox.relay().published == published_before + 1
            published_before = 1
            wait_until(lambda: outgoing_rows(shop.outbox.store) == (1, 0) and redelivery_due(shop.outbox.store),
                       timeout=10, message="the sent row to come due for its redelivery")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Producer, "publish", publish)
            thread = threading.Thread(target=hung_relay, name="hung-relay")
            thread.start()
            assert hung.wait(30)
            assert one_pass() == 0, "the hung pass still holds the row"
            wait_until(lambda: one_pass() == 1, timeout=30, message="PostgreSQL to end the idle relay transaction")
            release.set()
            thread.join(60)
        assert len(errors) == 1 and "idle-in-transaction timeout" in str(errors[0]), errors
        assert unsent_rows(shop.outbox.store) == 0
        expected = published_before + 2
        assert [m.id for m in receive(shop.app, shop.durable_queue, expected)] == [sent.id] * expected, \
            "at least once: both passes published it, the inbox discards the copy"
    finally:
        release.set()
        drop_store(shop.outbox.store)


def test_a_message_the_broker_lost_is_redelivered_and_acknowledged_by_the_inbox(postgres_url, redis_url,
                                                                                 table_prefix, tmp_path):
    """The broker loses a sent durable message (its queue is purged, as a Redis restart without
    persistence would). Delivery tracking publishes it again; a real worker handles it once and its
    inbox acknowledges the outgoing row, so nothing is left."""
    scenario = Scenario(redis_url, postgres_url, table_prefix, tmp_path, outbox_redeliver_after=1)
    try:
        shop, durable = scenario.shop, scenario.env["TEST_OTHER_QUEUE"]
        lost = shop.pay.apply_async(("lost-1",), task_id="lost-1", queue=durable)
        kept = shop.pay.apply_async(("kept-1",), **copy_options("kept-1"), queue=durable)
        store = shop.outbox.store
        assert store.count_outgoing() == 2 and unsent_rows(store) == 0, "both sent, waiting for their inbox"
        assert {m.id for m in receive(shop.app, durable, 2)} == {lost.id, kept.id}  # taken, never acked: lost
        scenario.worker(queues=[durable])
        # kept-1 reached its worker after all
        shop.pay.apply_async(("kept-1",), **copy_options("kept-1"), queue=durable)
        scenario.wait_events("kept-1", "postrun", 1)
        wait_until(lambda: shop.outbox.recover().redelivered >= 1 or store.get_incoming("lost-1") is not None,
                   timeout=30, message="recovery to redeliver lost-1")
        scenario.wait_events("lost-1", "postrun", 1)
        wait_until(lambda: store.count_outgoing() == 0, timeout=30, message="the inbox to acknowledge both rows")
        assert len(shop.effects("lost-1")) == 1 and len(shop.effects("kept-1")) == 1
        assert store.get_incoming("lost-1").recoveries == 1, "the inbox counts the redelivery as a recovery"
        assert store.get_incoming("kept-1").recoveries == 0
    finally:
        scenario.close()
