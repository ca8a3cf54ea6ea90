"""The delivery audit over the archive and the live tables of a real PostgreSQL store, written by
the store's own statements: live dead letters and live pending rows count as archived ones do,
and the summary says what was read and what it covers."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from celery_outbox.audit.aggregates import Tracking
from celery_outbox.audit.archive import ParquetArchiver
from celery_outbox.audit.inputs import jdbc_url_of
from celery_outbox.audit.job import AuditOptions, run_audit
from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import Store, build_engine
from celery_outbox.vocabulary import Attempt, DeadLetterReason, IncomingStatus

from ..conftest import drop_store
from ..services import services_required
from .conftest import JDBC_JAR, LATENCIES, NOW, T0, incoming
from .test_audit_incremental import comparable

HOUR = timedelta(hours=1)


@pytest.fixture
def live_store(postgres_url, table_prefix):
    if not os.path.exists(JDBC_JAR):
        reason = f"no PostgreSQL JDBC driver at {JDBC_JAR} (apt install libpostgresql-jdbc-java)"
        pytest.fail(reason) if services_required() else pytest.skip(reason)
    store = Store(build_engine(postgres_url), table_prefix)
    store.migrate()
    yield store
    drop_store(store)
    store.engine.dispose()


def outgoing(message_id: str, created_at) -> dict:
    return {"message_id": message_id, "task_name": "shop.pay", "destination": "payments", "routing_key": "payments",
            "body": b"[[], {}, {}]", "content_type": "application/json", "content_encoding": "utf-8",
            "headers": "{}", "properties": "{}", "created_at": created_at}


def fill_live_tables(store: Store, archive: str) -> None:
    """Beside the known archive (m0-m9; m8 lost there), the live tables hold:

    * ``m8``'s dead letter, in the live table only (the fresh table numbers it 1, as the archive
      numbers ``m7``'s letter);
    * ``pending``: an outgoing row not sent yet (created over an hour ago: stuck);
    * ``unacked``: sent over an hour ago and not acknowledged, with no record in the ``sent``
      table (as when no archive is configured): a send, still held;
    * ``running``: sent over an hour ago (its record in the live ``sent`` table), acknowledged,
      and running in the inbox since (stuck) after an attempt ended in a retry, archived;
    * ``plain``: handled from a plain queue: an inbox row, no send record.
    """
    sent_at = T0 + HOUR
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(
            reason=DeadLetterReason.FAILED, failed_at=T0 + 2 * HOUR, message_id="m8", task_name="shop.pay",
            queue="payments", error=KeyError("card"))])
        store.insert_outgoing(conn, [outgoing("pending", sent_at)])
        unacked, running = store.insert_outgoing(conn, [outgoing("unacked", sent_at), outgoing("running", sent_at)])
        taken = store.take_outgoing(conn, [unacked, running], sent_at, NOW + HOUR)
        assert sorted(taken) == sorted([unacked, running])
        store.finish_sent(conn, [unacked], sent_at, NOW + HOUR)
        store.finish_sent(conn, [running], sent_at, NOW + HOUR, record=True)
    with store.begin() as conn:
        assert store.acknowledge_outgoing(conn, "running", "payments", Attempt(0, 0, 0)) == 1
        assert store.claim_incoming(conn, {
            "message_id": "running", "destination": "", "task_name": "shop.pay", "queue": "payments",
            "status": IncomingStatus.RUNNING.value, "retries": 1, "received_at": sent_at, "claimed_at": sent_at})
        assert store.claim_incoming(conn, {
            "message_id": "plain", "destination": "", "task_name": "shop.ship", "queue": "plain",
            "status": IncomingStatus.HANDLED.value, "received_at": sent_at, "claimed_at": sent_at,
            "handled_at": sent_at, "keep_until": NOW + HOUR})
    retried = incoming(0, IncomingStatus.RETRIED.value, sent_at + timedelta(seconds=1))
    ParquetArchiver(archive).archive("incoming", [SimpleNamespace(**{**vars(retried), "message_id": "running"})])


def test_live_dead_letters_and_pending_rows_count_as_archived_ones(spark, known_archive, live_store, postgres_url,
                                                                    table_prefix, tmp_path):
    fill_live_tables(live_store, known_archive)
    out = tmp_path / "out"
    summary = run_audit(AuditOptions(out=str(out), archive=known_archive, jdbc_url=postgres_url,
                                     jdbc_jar=JDBC_JAR, table_prefix=table_prefix, now=NOW), spark)

    assert {key: summary[key] for key in ("sent", "handled", "lost", "dead_lettered", "stuck")} == {
        "sent": 12, "handled": 8, "lost": 0, "dead_lettered": 3, "stuck": 2}, \
        "m8's live letter ends it; unacked and running are held by their live rows; pending is not sent yet"
    dead = {(row["task_name"], row["exception"]): row["count"]
            for row in pq.read_table(out / "aggregates" / "dead_letters").to_pylist()}
    assert dead == {("shop.pay", "ValueError"): 1, ("shop.pay", "poison"): 1, ("shop.pay", "KeyError"): 1}

    read = summary["inputs"]
    assert read["archive"] == {"path": known_archive, "rows": {"incoming": 17, "dead_letters": 4, "sent": 20}}
    assert read["live"]["url"] == jdbc_url_of(postgres_url)[0] and "@" not in read["live"]["url"]
    assert read["live"]["rows"] == {f"{table_prefix}sent": 1, f"{table_prefix}outgoing": 2,
                                    f"{table_prefix}dead_letters": 1, f"{table_prefix}incoming": 2}
    assert read["live"]["pending"] == {"outgoing_unsent": 1, "outgoing_unacknowledged": 1, "incoming_running": 1}
    assert read["coverage"] == {
        "durable_queues": {"tracked": Tracking.END_TO_END.value, "messages": 12},
        "plain_queues": {"tracked": Tracking.INBOX_ONLY.value, "messages": 1}}

    report = (out / "report.html").read_text()
    assert f"{table_prefix}dead_letters 1," in report
    assert "still holding 1 unsent, 1 sent and unacknowledged, 1 running" in report


def test_a_live_row_stamped_before_1970_is_an_input_error_naming_table_and_message(
        spark, live_store, postgres_url, table_prefix, tmp_path, capsys):
    """A live outgoing row created in year 1 (a forged or corrupted row; PostgreSQL keeps it): the
    audit exits 2 naming the table, the message and the column, as it does for an archive file,
    instead of crashing when Python takes the moment from Spark (exit 1 would say a message was lost)."""
    from datetime import datetime, timezone

    from celery_outbox.audit.job import EXIT_BAD_INPUT, main

    with live_store.begin() as conn:
        year_one = datetime(1, 1, 1, tzinfo=timezone.utc)
        live_store.insert_outgoing(conn, [outgoing("fine", T0), outgoing("forged", year_one)])
    assert main(["--jdbc-url", postgres_url, "--jdbc-jar", JDBC_JAR, "--table-prefix", table_prefix,
                 "--out", str(tmp_path / "out"), "--now", NOW.isoformat()], spark) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"celery-outbox audit: live table {table_prefix}outgoing, message 'forged': column 'created_at' is "
        "0001-01-01T00:00:00+00:00, before 1970-01-01: a corrupted or forged row (no node's clock gave it)")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_without_the_live_tables_the_summary_says_so(known_audit):
    summary = known_audit.summary
    assert summary["inputs"]["live"] is None
    assert summary["inputs"]["archive"]["rows"] == {"incoming": 16, "dead_letters": 4, "sent": 20}
    assert summary["inputs"]["coverage"]["plain_queues"]["messages"] == 0, "every inbox row of it has a send"
    assert "live tables not read" in (known_audit.out / "report.html").read_text()


def test_a_message_the_live_tables_still_hold_is_carried_by_the_ledger_not_settled(
        spark, known_archive, live_store, postgres_url, table_prefix, tmp_path):
    """m0 is archived and still in the live inbox (cleanup's delete has not committed yet): with no
    horizon, every other ended message settles on the first run, but m0 stays carried, so the next
    run counts it once, as a full run does."""
    fill_live_tables(live_store, known_archive)
    handled_at = T0 + timedelta(seconds=LATENCIES[0])
    with live_store.begin() as conn:
        assert live_store.claim_incoming(conn, {
            "message_id": "m0", "destination": "", "task_name": "shop.pay", "queue": "payments",
            "status": IncomingStatus.HANDLED.value, "received_at": handled_at, "claimed_at": handled_at,
            "handled_at": handled_at, "keep_until": NOW + HOUR})
    options = {"archive": known_archive, "jdbc_url": postgres_url, "jdbc_jar": JDBC_JAR, "table_prefix": table_prefix,
               "now": NOW, "horizon_seconds": 0.0}
    first = run_audit(AuditOptions(out=str(tmp_path / "out"), **options), spark)
    assert first["ledger"]["sends_settled"] > 0
    second = run_audit(AuditOptions(out=str(tmp_path / "out"), **options), spark)
    full = run_audit(AuditOptions(out=str(tmp_path / "full"), **options), spark)
    assert second["ledger"]["mode"] == "incremental" and second["ledger"]["files_read"] == 0
    assert comparable(second) == comparable(full) == comparable(first)
    assert second["handled"] == 8, "m0 once, though archived and live"
