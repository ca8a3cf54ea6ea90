"""Bad input is refused before any JVM starts: one line on stderr naming what and where, exit code 2,
and no Spark session asked for. No Spark here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import celery_outbox.audit.job as job
from celery_outbox.audit.archive import ParquetArchiver, archive_schema
from celery_outbox.audit.checks import check_inputs
from celery_outbox.audit.job import EXIT_BAD_INPUT, AuditOptions, main, run_audit
from celery_outbox.vocabulary import ArchiveKind

from .conftest import T0, sent


class SparkAskedFor(Exception):
    """What the spy on session creation raises: the run got past its checks."""


@pytest.fixture
def sessions(monkeypatch) -> list[str | None]:
    """The log file of every Spark session the audit asks for (none is started)."""
    asked: list[str | None] = []

    def spy(options, log=None):
        asked.append(log)
        raise SparkAskedFor

    monkeypatch.setattr(job, "spark_session", spy)
    return asked


@pytest.fixture
def archive(tmp_path) -> str:
    """A valid archive, in a folder whose name has a space."""
    folder = tmp_path / "outbox data" / "archive"
    ParquetArchiver(str(folder)).archive("sent", [sent(1, T0)])
    return str(folder)


def refused(argv: list[str], capsys) -> str:
    """The one line ``main`` prints refusing ``argv``."""
    assert main(argv) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    return line


@pytest.mark.parametrize("as_uri", [True, False], ids=["file-uri", "path"])
def test_a_missing_archive_is_one_line_and_no_spark(tmp_path, capsys, sessions, as_uri):
    missing = tmp_path / "no such" / "archive"
    line = refused(["--archive", f"file://{missing}" if as_uri else str(missing), "--out", str(tmp_path / "out")],
                   capsys)
    assert line.startswith(f"celery-outbox audit: no archive at {missing}: ")
    assert sessions == []


def test_an_empty_archive_is_one_line_and_no_spark(tmp_path, capsys, sessions):
    (tmp_path / "archive" / "incoming").mkdir(parents=True)
    line = refused(["--archive", str(tmp_path / "archive"), "--out", str(tmp_path / "out")], capsys)
    assert line.startswith(f"celery-outbox audit: the archive at {tmp_path / 'archive'} is empty")
    assert sessions == []


def test_a_partition_with_a_bad_schema_is_named_and_no_spark(archive, tmp_path, capsys, sessions):
    bad = Path(archive) / "incoming" / "date=2026-11-02"
    bad.mkdir(parents=True)
    pq.write_table(pa.table({"message_id": [1, 2], "status": ["handled", "handled"]}), bad / "part-bad.parquet")
    line = refused(["--archive", archive, "--out", str(tmp_path / "out")], capsys)
    assert f"archive file {bad / 'part-bad.parquet'} has a bad schema" in line
    assert sessions == []


def test_a_moment_before_1970_is_named_by_file_and_row_and_no_spark(archive, tmp_path, capsys, sessions):
    """A row stamped in year 1 (corrupted, or forged): Spark would read it, and the job would crash
    turning it into local time, with the exit code that means a message was lost."""
    from datetime import datetime, timezone

    folder = Path(archive) / "sent" / "date=2026-11-02"
    folder.mkdir(parents=True)
    schema = archive_schema(ArchiveKind.SENT)
    moments = [T0, datetime(1, 1, 1, tzinfo=timezone.utc), T0]
    rows = [{name: getattr(sent(n, at), name, None) for name in schema.names} for n, at in enumerate(moments)]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "part-year-one.parquet")
    line = refused(["--archive", archive, "--out", str(tmp_path / "out")], capsys)
    assert line == (f"celery-outbox audit: archive file {folder / 'part-year-one.parquet'}, row 1: column "
                    "'created_at' is 0001-01-01T00:00:00+00:00, before 1970-01-01: a corrupted or forged row "
                    "(no node's clock gave it)"), line
    assert sessions == []


@pytest.mark.parametrize("url, named", [
    ("postgresql://db.example:notaport/shop", "--jdbc-url has a port that is not a number"),
    ("postgresql://app:pw-one@db.example:99999/shop", "--jdbc-url postgresql://app:***@db.example:99999/shop: "
                                                      "port 99999 is out of range"),
    ("jdbc:mysql://db.example/shop?password=pw-one", "--jdbc-url jdbc:mysql://db.example/shop is not a PostgreSQL "
                                                     "JDBC URL"),
    ("jdbc:postgresql://db.example:x/shop?password=pw-one", "--jdbc-url jdbc:postgresql://db.example:x/shop: port"),
    ("not a url at all", "--jdbc-url is not a database URL"),
])
def test_a_malformed_jdbc_url_is_one_line_without_its_password_and_no_spark(archive, tmp_path, capsys, sessions,
                                                                              url, named):
    line = refused(["--archive", archive, "--out", str(tmp_path / "out"), "--jdbc-url", url], capsys)
    assert line.startswith(f"celery-outbox audit: {named}")
    assert "pw-one" not in line
    assert sessions == []


def test_an_out_that_is_a_file_is_one_line_and_no_spark(archive, tmp_path, capsys, sessions):
    (tmp_path / "taken").write_text("")
    line = refused(["--archive", archive, "--out", f"file://{tmp_path / 'taken'}"], capsys)
    assert line == f"celery-outbox audit: --out {tmp_path / 'taken'} is a file, not a folder"
    assert sessions == []


def test_a_good_local_archive_passes_the_checks_and_spark_is_asked_for(archive, tmp_path, sessions):
    with pytest.raises(SparkAskedFor):
        run_audit(AuditOptions(archive=f"file://{archive}", out=str(tmp_path / "out dir")))
    assert len(sessions) == 1
    assert (tmp_path / "out dir").is_dir(), "made before Spark, for its log"


def test_an_archive_only_spark_reaches_is_left_to_spark_not_refused(tmp_path, sessions):
    options = AuditOptions(archive="s3a://bucket/outbox", out=str(tmp_path / "out"))
    assert check_inputs(options) is None
    with pytest.raises(SparkAskedFor):
        run_audit(options)
    assert len(sessions) == 1


def test_a_jvm_started_for_a_local_out_logs_into_it_and_for_another_into_a_named_temporary_file(
        archive, tmp_path, monkeypatch, capsys, sessions):
    monkeypatch.setattr(job, "starts_jvm", lambda: True)
    with pytest.raises(SparkAskedFor):
        main(["--archive", archive, "--out", f"file://{tmp_path / 'out dir'}", "--master", "local[1]"])
    assert sessions == [str(tmp_path / "out dir" / "spark.log")]
    with pytest.raises(SparkAskedFor):
        main(["--archive", archive, "--out", "s3a://bucket/audit", "--master", "local[1]"])
    log = sessions[1]
    assert os.path.isfile(log) and not log.startswith(str(tmp_path))
    os.remove(log)
    assert capsys.readouterr().err.splitlines() == [
        f"celery-outbox audit: starting Spark (local[1]); its log: {tmp_path / 'out dir' / 'spark.log'}",
        f"celery-outbox audit: starting Spark (local[1]); its log: {log}"]


def test_verbose_or_a_running_jvm_leaves_the_log_where_spark_puts_it(archive, tmp_path, monkeypatch, sessions):
    monkeypatch.setattr(job, "starts_jvm", lambda: True)
    with pytest.raises(SparkAskedFor):
        main(["--archive", archive, "--out", str(tmp_path / "out"), "--verbose"])
    monkeypatch.setattr(job, "starts_jvm", lambda: False)  # spark-submit's JVM
    with pytest.raises(SparkAskedFor):
        main(["--archive", archive, "--out", str(tmp_path / "out")])
    assert sessions == [None, None]


def test_the_celery_command_prints_exactly_one_line_for_a_missing_archive(tmp_path):
    """The real command, in a process of its own: its whole stderr is the one line."""
    root = Path(__file__).parents[2]
    env = dict(os.environ, TEST_DATABASE_URL=f"sqlite:///{tmp_path / 'store.db'}", PYTHONPATH=str(root))
    missing = tmp_path / "no such archive"
    process = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", "audit", "--archive", str(missing),
         "--out", f"file://{tmp_path / 'out'}"],
        env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert process.returncode == EXIT_BAD_INPUT
    assert process.stderr.splitlines() == [
        f"celery-outbox audit: no archive at {missing}: set outbox_archive_path and let cleanup run, "
        "or give the path cleanup writes to"]


def test_a_missing_jdbc_driver_jar_is_one_line_and_no_spark(archive, tmp_path, capsys, sessions):
    line = refused(["--archive", archive, "--out", str(tmp_path / "out"), "--jdbc-url", "jdbc:postgresql://h/shop",
                    "--jdbc-jar", str(tmp_path / "no driver.jar")], capsys)
    assert line == f"celery-outbox audit: no JDBC driver jar at {tmp_path / 'no driver.jar'}"
    assert sessions == []
