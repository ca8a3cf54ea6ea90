"""``celery outbox check``: the health check, run as a real ``celery -A ... outbox check`` subprocess
against stores holding what each condition looks for."""

from __future__ import annotations

import json
from datetime import timedelta

from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import Store, build_engine, utcnow
from celery_outbox.vocabulary import DeadLetterReason

from ..conftest import drop_store
from ..services import free_port
from .test_cli_schema import run


def outgoing_row(message_id: str, created_at) -> dict:
    return {"message_id": message_id, "task_name": "tasks.late", "destination": "orders", "body": b"[]",
            "content_type": "application/json", "content_encoding": "utf-8", "exchange": "", "routing_key": "orders",
            "headers": "{}", "properties": "{}", "created_at": created_at}


def test_a_healthy_store_passes_and_each_failed_condition_has_its_line(database_url, table_prefix):
    """Empty: OK, exit 0. Then an outgoing message pending for two hours, two dead letters of half an
    hour ago and a node silent for ten minutes: exit 1 (thresholds crossed), one line per condition,
    and the same in JSON. The liveness probe passes all along: the store answers."""
    store = Store(build_engine(database_url), table_prefix)
    store.migrate()
    try:
        healthy = run("check", url=database_url, prefix=table_prefix)
        assert (healthy.returncode, healthy.stdout.strip()) == (0, "OK"), healthy.stderr

        now = utcnow()
        with store.begin() as conn:
            store.insert_outgoing(conn, [outgoing_row("late-1", now - timedelta(hours=2))])
            store.insert_dead_letters(conn, [
                dead_letter_row(reason=DeadLetterReason.FAILED, failed_at=now - timedelta(minutes=30),
                                message_id=f"dead-{n}", task_name="tasks.broken") for n in range(2)])
        node_id = store.register_node("silent\x1b[2J@host", "host", 4242, now=now - timedelta(minutes=10))

        failed = run("check", "--min-nodes", "1", url=database_url, prefix=table_prefix)
        assert failed.returncode == 1, failed.stderr
        alive = run("check", "--liveness", "--min-nodes", "1", url=database_url, prefix=table_prefix)
        assert (alive.returncode, alive.stdout.strip()) == (0, "OK"), alive.stdout + alive.stderr
        lines = failed.stdout.splitlines()
        assert [line.split(":")[0] for line in lines] == [
            "FAIL pending_age", "FAIL dead_letters", "FAIL stuck", "FAIL node_silent", "FAIL nodes"], lines
        assert "2 dead letter(s) in the last 3600 s" in failed.stdout
        assert f"node {node_id} (silent\\x1b[2J@host, pid 4242 on host)" in failed.stdout
        assert "1 message(s) waiting longer than 3600 s" in failed.stdout
        assert "\x1b" not in failed.stdout, "message text reaches the terminal escaped"

        tolerant = run("check", "--max-pending-age", "3h", "--max-dead-letters", "2", "--stuck-after", "3h",
                       "--node-stale-after", "11m", url=database_url, prefix=table_prefix)
        assert (tolerant.returncode, tolerant.stdout.strip()) == (0, "OK"), tolerant.stdout

        as_json = run("check", "--json", "--window", "1m", "--max-pending-age", "3h", "--stuck-after", "3h",
                      url=database_url, prefix=table_prefix)
        assert as_json.returncode == 1
        report = json.loads(as_json.stdout)
        assert report["ok"] is False
        assert [(f["condition"], f["threshold"]) for f in report["failures"]] == [("node_silent", 30.0)]
        assert report["failures"][0]["value"] >= 600
    finally:
        drop_store(store)


def test_a_store_that_does_not_answer_is_one_failed_condition(table_prefix):
    """A database nobody listens on: exit 2 (not the 1 of a crossed threshold), for the liveness
    probe too, and one line that names the store, no traceback."""
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=2"
    for arguments, expected in ((["check"], "FAIL store: "), (["check", "--json"], '"condition": "store"'),
                                (["check", "--liveness"], "FAIL store: ")):
        result = run(*arguments, url=url, prefix=table_prefix)
        assert result.returncode == 2, result.stderr
        assert expected in result.stdout
        assert "Traceback" not in result.stdout + result.stderr


def test_a_locked_table_is_a_failed_condition_within_the_timeout(postgres_url, table_prefix):
    """``VACUUM FULL``, a migration or ``LOCK TABLE`` holds an outbox table: the check answers
    within ``--timeout``, exit 2 and one line saying why, instead of hanging past a probe's limit;
    the liveness probe, which reads no table, passes (no restart for a maintenance lock)."""
    import psycopg

    store = Store(build_engine(postgres_url), table_prefix)
    store.migrate()
    try:
        for table in (store.tables.outgoing.name, store.tables.schema.name):
            with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql")) as holder:
                holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
                result = run("check", "--timeout", "2s", url=postgres_url, prefix=table_prefix)
                alive = run("check", "--liveness", "--timeout", "2s", url=postgres_url, prefix=table_prefix)
            assert (alive.returncode, alive.stdout.strip()) == (0, "OK"), (table, alive.stdout, alive.stderr)
            assert result.returncode == 2, result.stderr
            assert "FAIL store: the message store did not answer within 2 s: a table of it is locked" \
                in result.stdout, (table, result.stdout, result.stderr)
    finally:
        drop_store(store)
