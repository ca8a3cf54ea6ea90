"""The delivery audit on synthetic archives with known answers, and its handling of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from celery_outbox.audit.jdbc import jdbc_url_of
from celery_outbox.audit.job import (
    EXIT_BAD_INPUT,
    EXIT_CLEAN,
    EXIT_LOST,
    AuditInputError,
    AuditOptions,
    main,
    run_audit,
)

from .conftest import COMMAND_TIMEOUT, JDBC_JAR, NOW


def audit_command(tmp_path: Path, known_archive: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    """``celery outbox audit`` of the known archive in a process of its own (so it starts its own JVM),
    run as a cron job or a systemd unit runs a virtualenv's Python: by its path, with no
    ``PYSPARK_PYTHON``, and a ``python3`` first on ``PATH`` that is another interpreter (here one
    that leaves a mark and fails). Spark's Python workers must run the command's own."""
    root = Path(__file__).parents[2]
    other_python = tmp_path / "another python" / "python3"
    mark = tmp_path / "the python3 of PATH ran"
    other_python.parent.mkdir(exist_ok=True)
    other_python.write_text(f"#!/bin/sh\ntouch '{mark}'\nexit 1\n")
    other_python.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "PYSPARK_PYTHON"}
    env.update(TEST_DATABASE_URL=f"sqlite:///{tmp_path / 'store.db'}", PYTHONPATH=str(root),
               PATH=f"{other_python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    process = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", "audit", "--archive", known_archive,
         "--out", out, "--master", "local[1]", "--grace", "520w", *extra],
        env=env, cwd=root, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert not mark.exists(), "Spark ran its Python workers on the python3 of PATH, not the command's interpreter"
    return process


def test_a_known_archive_gives_exactly_the_expected_numbers(known_audit):
    summary = known_audit.summary
    assert {key: summary[key] for key in ("sent", "handled", "lost", "dead_lettered", "duplicates_discarded",
                                          "late", "stuck")} == {
        "sent": 10, "handled": 7, "lost": 1, "dead_lettered": 2, "duplicates_discarded": 5, "late": 1, "stuck": None}
    assert [example["message_id"] for example in summary["lost_examples"]] == ["m8"]
    latency = summary["latency_seconds"]
    assert latency["p50"] == pytest.approx(0.4, abs=0.01)
    assert latency["max"] == pytest.approx(120.0, abs=0.01)
    out = known_audit.out
    assert json.loads((out / "summary.json").read_text())["lost"] == 1
    by_task = {row["task_name"]: row for row in pq.read_table(out / "aggregates" / "latency_by_task").to_pylist()}
    assert by_task["shop.pay"]["count"] == 4 and by_task["shop.ship"]["count"] == 3
    assert by_task["shop.ship"]["max"] == pytest.approx(120.0, abs=0.01)
    by_hour = pq.read_table(out / "aggregates" / "latency_by_hour").to_pylist()
    assert [row["count"] for row in by_hour] == [7]
    dead = {(row["task_name"], row["exception"]): row["count"]
            for row in pq.read_table(out / "aggregates" / "dead_letters").to_pylist()}
    assert dead == {("shop.pay", "ValueError"): 1, ("shop.pay", "poison"): 1}
    throughput = pq.read_table(out / "aggregates" / "throughput").to_pylist()
    assert sum(row["sent"] for row in throughput) == 10 and sum(row["handled"] for row in throughput) == 7


def test_the_report_contains_its_plots(known_audit):
    html = (known_audit.out / "report.html").read_text()
    for figure in ("latency-plot", "throughput-plot", "dead-letters-plot"):
        start = html.index(f'id="{figure}"')
        assert "<svg" in html[start:html.index("</figure>", start)], f"{figure} has no drawing"
    assert "1 LOST" in html and "m8" in html


def test_exit_code_says_whether_anything_was_lost(spark, known_archive, tmp_path, capsys):
    as_of = ["--now", NOW.isoformat()]
    assert main(["--archive", known_archive, "--out", str(tmp_path / "a"), *as_of], spark) == EXIT_LOST
    assert "1 lost" in capsys.readouterr().out
    assert main(["--archive", known_archive, "--out", str(tmp_path / "b"), "--grace", str(10 * 86400), *as_of],
                spark) == EXIT_CLEAN
    assert main(["--archive", known_archive, "--out", str(tmp_path / "c")], spark) == EXIT_LOST
    assert "2 lost" in capsys.readouterr().out, "weeks later, m9 is past its grace period too"


def test_an_unreachable_jdbc_url_is_a_clear_error(spark, known_archive, tmp_path, capsys):
    from ..services import free_port, services_required

    if not os.path.exists(JDBC_JAR):
        reason = f"no PostgreSQL JDBC driver at {JDBC_JAR} (apt install libpostgresql-jdbc-java)"
        pytest.fail(reason) if services_required() else pytest.skip(reason)

    url = f"jdbc:postgresql://127.0.0.1:{free_port()}/nothing?user=postgres"
    assert main(["--archive", known_archive, "--out", str(tmp_path / "out"), "--jdbc-url", url,
                 "--jdbc-jar", JDBC_JAR], spark) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"cannot read the live table celery_outbox_sent at {url.split('?')[0]}: Couldn't connect" in err
    assert "Traceback" not in err


def test_spark_settings_are_reported_and_a_given_session_gets_its_partitions_back(spark, known_archive, tmp_path):
    """The summary says where the audit ran; the job's shuffle partitions do not leak into the
    caller's session."""
    before = spark.conf.get("spark.sql.shuffle.partitions")
    summary = run_audit(AuditOptions(out=str(tmp_path / "a"), archive=known_archive, now=NOW, shuffle_partitions=3),
                        spark)
    assert summary["spark"]["shuffle_partitions"] == 3
    assert summary["spark"]["master"] == spark.sparkContext.master
    assert summary["spark"]["driver_max_heap_mib"] > 0
    assert spark.conf.get("spark.sql.shuffle.partitions") == before
    assert summary["lost"] == 1, "the numbers do not depend on the partitions"


def test_sparks_default_of_200_partitions_becomes_four_per_core(spark, known_archive, known_audit, tmp_path):
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    try:
        summary = run_audit(AuditOptions(out=str(tmp_path / "a"), archive=known_archive, now=NOW), spark)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
    assert summary["spark"]["shuffle_partitions"] == 4 * spark.sparkContext.defaultParallelism
    assert known_audit.summary["spark"]["shuffle_partitions"] == int(before), "a setting of the session's own is kept"


@pytest.mark.parametrize("argv, named", [
    (["--driver-memory", "lots"], "driver memory must be a size such as 4g or 512m, not 'lots'"),
    (["--shuffle-partitions", "0"], "shuffle partitions must be at least 1, not 0"),
])
def test_bad_spark_settings_are_clear_errors(tmp_path, capsys, argv, named):
    """Checked before any Spark starts (no session is given)."""
    assert main(["--archive", str(tmp_path), "--out", str(tmp_path / "out"), *argv]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


def test_the_jdbc_url_keeps_the_tls_parameters_as_properties_and_holds_no_secret():
    url, properties = jdbc_url_of("postgresql+psycopg://app:pw-one@db.example:5433/shop?sslmode=verify-full"
                                  "&sslrootcert=/ca.pem&sslcert=/c.pem&sslkey=/k.pk8&sslpassword=pw-two")
    assert url == "jdbc:postgresql://db.example:5433/shop"
    assert properties == {"driver": "org.postgresql.Driver", "user": "app", "password": "pw-one",
                          "sslmode": "verify-full", "sslrootcert": "/ca.pem", "sslcert": "/c.pem",
                          "sslkey": "/k.pk8", "sslpassword": "pw-two"}


def test_a_parameter_jdbc_cannot_carry_is_refused_by_name_without_the_password():
    with pytest.raises(AuditInputError) as error:
        jdbc_url_of("postgresql://app:pw-one@h/shop?sslmode=require&target_session_attrs=read-write&password=pw-two")
    message = str(error.value)
    assert "target_session_attrs cannot be carried" in message
    assert "pw-" not in message


def test_spark_lists_an_archive_the_checks_could_not(spark, known_archive, tmp_path):
    """An archive on a filesystem only Spark reaches (``files`` None) is listed through Hadoop's
    filesystem; a missing one is the same clear error as a missing local one."""
    from celery_outbox.audit.inputs import Inputs

    inputs = Inputs(spark, AuditOptions(out=str(tmp_path / "out"), archive=f"file://{known_archive}"), None)
    assert (inputs.sent.count(), inputs.incoming.count(), inputs.dead.count()) == (10, 8, 2)
    with pytest.raises(AuditInputError, match=f"no archive at {tmp_path / 'nowhere'}"):
        Inputs(spark, AuditOptions(out=str(tmp_path / "out"), archive=f"file://{tmp_path / 'nowhere'}"), None)


def test_a_moment_before_1970_in_an_archive_only_spark_reaches_is_named_by_file_and_message(
        spark, known_archive, tmp_path):
    """An archive the checks could not read before Spark (``files`` None: ``s3a://`` and the like):
    a row stamped in year 1 is the input error the checks give for a local one, naming its file
    and its message, not a crash when Python takes the moment from Spark."""
    from datetime import datetime, timezone

    from celery_outbox.audit.archive import ParquetArchiver
    from celery_outbox.audit.inputs import Inputs
    from celery_outbox.vocabulary import ArchiveKind

    from .conftest import T0, sent

    forged = sent(20, T0)
    forged.sent_at = datetime(1, 1, 1, tzinfo=timezone.utc)
    ParquetArchiver(known_archive).archive(ArchiveKind.SENT, [forged])
    with pytest.raises(AuditInputError) as error:
        Inputs(spark, AuditOptions(out=str(tmp_path / "out"), archive=f"file://{known_archive}"), None)
    written = [path for path in (Path(known_archive) / "sent").rglob("*.parquet")
               if "m20" in pq.read_table(path).column("message_id").to_pylist()]
    assert len(written) == 1
    assert str(error.value) == (f"archive file file://{written[0]}, message 'm20': column 'sent_at' is "
                                "0001-01-01T00:00:00+00:00, before 1970-01-01: a corrupted or forged row "
                                "(no node's clock gave it)")


def test_file_uris_with_spaces_are_read_and_written_where_they_name(spark, known_archive, tmp_path, monkeypatch,
                                                                    capsys):
    """Not into a folder named ``file:`` under the current one; the report line names the real file."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "audit out" / "today"
    assert main(["--archive", f"file://{known_archive}", "--out", f"file://{out}", "--now", NOW.isoformat()],
                spark) == EXIT_LOST
    assert capsys.readouterr().out.splitlines()[-1] == f"report: {out / 'report.html'}"
    assert json.loads((out / "summary.json").read_text())["lost"] == 1
    assert "1 LOST" in (out / "report.html").read_text()
    assert [row["message_id"] for row in pq.read_table(out / "aggregates" / "lost").to_pylist()] == ["m8"]
    assert not (tmp_path / "file:").exists()


def test_each_stage_is_announced_as_it_begins(known_audit):
    from celery_outbox.audit.job import Stage

    assert known_audit.told == [(Stage.READING, "(all of them: no ledger yet)"), (Stage.AGGREGATING, ""),
                                (Stage.SETTLING, ""), (Stage.WRITING, f"to {known_audit.out}")]


def test_the_command_starts_spark_as_told_logs_to_a_file_and_reads_what_the_ledger_has_not_covered(
        spark, known_archive, tmp_path, capsys):
    """``celery outbox audit --driver-memory --shuffle-partitions`` sizes the JVM it starts (Spark's
    default heap would be 1g) and its shuffles; the JVM prints into spark.log in --out. Into the
    --out of an earlier run it reads only the files that run's ledger has not covered, and with
    --full all of them. One command process: each starts a JVM, the dearest step of a test."""
    out = tmp_path / "audit out"
    files = len(list(Path(known_archive).rglob("*.parquet")))
    # the first run, in this process on the shared Spark session: its ledger is the command's to read
    assert main(["--archive", known_archive, "--out", f"file://{out}", "--now", NOW.isoformat(), "--grace", "3600"],
                spark=spark) == EXIT_LOST
    process = audit_command(tmp_path, known_archive, f"file://{out}", "--driver-memory", "640m",
                            "--shuffle-partitions", "3", "--now", NOW.isoformat(), "--grace", "1h")
    assert process.returncode == EXIT_LOST, process.stderr[-3000:]
    assert "1 lost" in process.stdout, "m8, as of --now (m9 is within the grace period then)"
    facts = json.loads((out / "summary.json").read_text())["spark"]
    assert facts["master"] == "local[1]" and facts["shuffle_partitions"] == 3
    assert 400 < facts["driver_max_heap_mib"] <= 640, facts
    log = out / "spark.log"
    assert process.stderr.splitlines() == [
        f"celery-outbox audit: starting Spark (local[1]); its log: {log}",
        f"celery-outbox audit: reading the inputs (the files the ledger has not covered, of {files} covered)",
        "celery-outbox audit: aggregating",
        "celery-outbox audit: settling the ledger",
        f"celery-outbox audit: writing the outputs to {out}",
    ]
    assert log.stat().st_size > 0, "what the JVM printed is in the file"
    assert "[Stage " not in log.read_text(), "but not Spark's progress bars"
    assert process.stdout.splitlines()[-1] == f"report: {out / 'report.html'}"
    capsys.readouterr()
    # --full, in this process on the shared Spark session: a second JVM would only repeat the start-up
    assert main(["--archive", known_archive, "--out", f"file://{out}", "--now", NOW.isoformat(), "--grace", "3600",
                 "--full"], spark=spark) == EXIT_LOST
    assert "celery-outbox audit: reading the inputs (all of them: --full)" in capsys.readouterr().err.splitlines()


def test_verbose_leaves_sparks_output_on_the_console(spark, known_archive, tmp_path):
    out = tmp_path / "audit"
    process = audit_command(tmp_path, known_archive, str(out), "--verbose")
    assert process.returncode == EXIT_CLEAN, process.stderr[-3000:]
    ours = [line for line in process.stderr.splitlines() if line.startswith("celery-outbox audit: ")]
    assert ours[0] == "celery-outbox audit: starting Spark (local[1])"
    assert len(process.stderr.splitlines()) > len(ours), "the JVM's own lines are on the console"
    assert not (out / "spark.log").exists()


def test_scheduled_messages_count_their_latency_from_their_due_time_apart_from_immediate_ones(spark, tmp_path):
    """Four messages sent at once (their sends in a file of the archive's older format, without
    ``deliver_at``) and five sent with a ten-minute countdown, one of them published after its eta:
    the countdown is no latency, nor lateness, and the immediate figures hold the immediate messages
    alone."""
    import pyarrow as pa

    from celery_outbox.audit.archive import ParquetArchiver, archive_schema
    from celery_outbox.vocabulary import ArchiveKind

    from .conftest import T0, incoming

    folder = tmp_path / "archive"
    archiver = ParquetArchiver(str(folder))
    at_once = [SimpleNamespace(message_id=f"m{n}", destination="payments", task_name="shop.pay",
                               created_at=T0 + timedelta(minutes=n), sent_at=T0 + timedelta(minutes=n))
               for n in range(4)]
    older = pa.schema([field for field in archive_schema(ArchiveKind.SENT) if field.name != "deliver_at"])
    (folder / "sent" / "date=2026-11-01").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([vars(row) for row in at_once], schema=older),
                   folder / "sent" / "date=2026-11-01" / "part-older.parquet")
    due = [T0 + timedelta(minutes=10 + n) for n in range(5)]
    sent_at = [moment - timedelta(minutes=10) for moment in due[:4]] + [due[4] + timedelta(seconds=5)]
    scheduled = [SimpleNamespace(message_id=f"m{4 + n}", destination="payments", task_name="shop.pay",
                                 created_at=sent_at[n], sent_at=sent_at[n], deliver_at=due[n]) for n in range(5)]
    archiver.archive(ArchiveKind.SENT, scheduled)
    handled = [incoming(n, "handled", row.sent_at + timedelta(seconds=0.1 * (n + 1))) for n, row in enumerate(at_once)]
    handled += [incoming(4 + n, "handled", max(due[n], sent_at[n]) + timedelta(seconds=0.1 * (n + 2)))
                for n in range(5)]
    archiver.archive(ArchiveKind.INCOMING, handled)

    out = tmp_path / "out"
    summary = run_audit(AuditOptions(out=str(out), archive=str(folder), now=NOW, ledger=False), spark)

    assert summary["handled"] == 9 and summary["lost"] == 0 and summary["late"] == 0
    immediate, later = summary["latency_seconds"], summary["scheduled_latency_seconds"]
    assert immediate["p50"] == pytest.approx(0.2, rel=0.01) and immediate["max"] == pytest.approx(0.4, abs=1e-3)
    assert later["p50"] == pytest.approx(0.4, rel=0.01) and later["max"] == pytest.approx(0.6, abs=1e-3)
    rows = pq.read_table(out / "aggregates" / "latency_by_task").to_pylist()
    assert {(row["task_name"], row["timing"]): row["count"] for row in rows} == {  # the inbox's names
        ("shop.pay", "immediate"): 2, ("shop.ship", "immediate"): 2, ("shop.pay", "scheduled"): 3,
        ("shop.ship", "scheduled"): 2}
    html = (out / "report.html").read_text()
    assert '<figure id="latency-plot">' in html and '<figure id="scheduled-latency-plot">' in html
