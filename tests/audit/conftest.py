"""One local Spark session for the audit tests (it takes seconds to start; its log goes to a file),
a Spark standalone cluster, an archive with known answers, and one audit of it that the tests
which only read an audit's outputs share."""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from celery_outbox.audit.archive import ParquetArchiver

from ..services import services_required

JDBC_JAR = "/usr/share/java/postgresql.jar"
# Seconds an audit test may take: Spark's jobs on a shared two-core host, beside the other
# worker's tests, can take several times the suite's 300. A test stopped by pytest-timeout in
# the middle of a py4j call also leaves the worker's shared Spark session unusable (py4j
# reads the interrupted call's answer as the next one's), which fails every audit test after it.
AUDIT_TIMEOUT = 900
# Seconds a command an audit test runs (the job, spark-submit) may take: below the test's own
# limit, so that a slow command fails with its output rather than stopping the test mid-call.
COMMAND_TIMEOUT = AUDIT_TIMEOUT - 100

# The tests' JVMs (the shared session's, each command's, spark-submit's, the cluster's daemons) live
# for seconds on tens of rows: there the JIT's optimizing tier and the parallel collector's threads
# only add CPU, about 40 % of an audit's on this suite's host, which every other test waits for.
# spark-submit (SPARK_SUBMIT_OPTS) and spark-class (SPARK_DAEMON_JAVA_OPTS) read these when they
# start a JVM; no answer of the job depends on them. A value set in the environment is kept.
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# A driver's SQL settings for tens of rows, as system properties (a driver's SparkConf reads the
# spark.* ones): each query's expressions evaluated as they stand, not compiled to Java code first
# (Janino's compiles are most of a small query's CPU: about 30 % of an audit's), no whole-stage code
# generation, no adaptive re-planning. The answers depend on none of them; CI's demos (`tox -e demo`,
# `tox -e django-demo`, outside pytest) run the audit command with Spark's defaults.
TINY_DATA_SQL = {"spark.sql.codegen.factoryMode": "NO_CODEGEN", "spark.sql.codegen.wholeStage": "false",
                 "spark.sql.adaptive.enabled": "false"}
os.environ.setdefault("SPARK_SUBMIT_OPTS", " ".join([SHORT_LIVED_JVM, *(f"-D{k}={v}" for k, v in
                                                                      TINY_DATA_SQL.items())]))
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", SHORT_LIVED_JVM)


def pytest_collection_modifyitems(items) -> None:
    """Give the audit tests ``AUDIT_TIMEOUT`` instead of the suite's default."""
    here = Path(__file__).parent
    for item in items:
        if item.path.parent == here and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(AUDIT_TIMEOUT))


def require_spark() -> None:
    """Skip when pyspark, pyarrow or Java is missing (fail under CELERY_OUTBOX_REQUIRE_SERVICES=1)."""
    missing = [name for name in ("pyspark", "pyarrow") if __import__("importlib").util.find_spec(name) is None]
    java = shutil.which("java") or (os.environ.get("JAVA_HOME") and os.path.join(os.environ["JAVA_HOME"], "bin/java"))
    reason = (f"the audit needs {', '.join(missing)} (pip install 'celery-outbox[spark]')" if missing
              else None if java else "the audit needs Java (a JRE 17 on PATH or JAVA_HOME)")
    if reason:
        if services_required():
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    require_spark()
    from celery_outbox.audit.job import AuditOptions
    from celery_outbox.audit.session import spark_session

    session = spark_session(AuditOptions(out="unused", master="local[1]", jdbc_url="jdbc:postgresql://unused/x",
                                         jdbc_jar=JDBC_JAR if os.path.exists(JDBC_JAR) else None)
                            if os.path.exists(JDBC_JAR) else AuditOptions(out="unused", master="local[1]"),
                            log=str(tmp_path_factory.mktemp("spark") / "spark.log"))
    # The tests' archives hold tens of rows: what a test waits for is Spark's fixed cost per task and
    # per query (one thread, one shuffle partition: about 15 % less of the JVM's CPU than two),
    # which code generation and adaptive execution only add to (compiling, re-planning); set here too
    # for a SPARK_SUBMIT_OPTS of the environment's own.
    session.conf.set("spark.sql.shuffle.partitions", "1")
    for name, value in TINY_DATA_SQL.items():
        session.conf.set(name, value)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A Spark standalone master and one worker on 127.0.0.1 (``SparkCluster``), up for the session."""
    require_spark()
    import pyspark

    from .cluster import SparkCluster

    cluster = SparkCluster(Path(pyspark.__file__).parent, tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


T0 = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
NOW = T0 + timedelta(hours=3)
LATENCIES = [0.1, 0.2, 0.3, 0.4, 0.5, 120.0, 0.7]  # messages m0..m6 handled; m5 is late


def sent(n: int, at: datetime) -> SimpleNamespace:
    return SimpleNamespace(message_id=f"m{n}", destination="payments", task_name="shop.pay" if n % 2 == 0 else
                           "shop.ship", created_at=at, sent_at=at)


def incoming(n: int, status: str, handled_at: datetime, duplicates: int = 0) -> SimpleNamespace:
    return SimpleNamespace(message_id=f"m{n}", destination="", task_name="shop.pay" if n % 2 == 0 else "shop.ship",
                           queue="payments", status=status, retries=0, nesting=0, replays=0, duplicates=duplicates,
                           recoveries=0, received_at=handled_at, claimed_at=handled_at, handled_at=handled_at)


def dead_letter(dead_id: int, message_id: str, reason: str, exception: str | None) -> SimpleNamespace:
    return SimpleNamespace(id=dead_id, message_id=message_id, destination="", task_name="shop.pay", queue="payments",
                           reason=reason, exception_type=exception, exception_message="boom", retries=0, nesting=0,
                           replays=0, failed_at=T0 + timedelta(minutes=30), replay_count=0)


@pytest.fixture
def known_archive(tmp_path):
    return write_known_archive(tmp_path)


@pytest.fixture(scope="session")
def known_audit(spark, tmp_path_factory) -> SimpleNamespace:
    """One audit of the known archive as of ``NOW`` on the shared session, for the tests that only
    read what it made: ``summary``, its ``out`` folder and the stages it ``told`` (stage, detail)."""
    from celery_outbox.audit.job import AuditOptions, run_audit

    folder = tmp_path_factory.mktemp("known-audit")
    out, told = folder / "out", []
    summary = run_audit(AuditOptions(out=str(out), archive=write_known_archive(folder), now=NOW), spark,
                        lambda stage, detail: told.append((stage, detail)))
    return SimpleNamespace(summary=summary, out=out, told=told)


def write_known_archive(folder: Path) -> str:
    """m0-m6 handled (m5 late), m7 dead-lettered, m8 lost, m9 sent within the grace period; every
    batch archived twice, as an at-least-once archive may; in a folder whose name has a space."""
    archiver = ParquetArchiver(str(folder / "outbox archive"))
    sends = [sent(n, T0 + timedelta(minutes=n)) for n in range(9)] + [sent(9, NOW - timedelta(minutes=10))]
    handled = [incoming(n, "handled", T0 + timedelta(minutes=n, seconds=LATENCIES[n]),
                        duplicates={0: 3, 1: 2}.get(n, 0)) for n in range(7)]
    handled.append(incoming(7, "dead", T0 + timedelta(minutes=7, seconds=1)))
    letters = [dead_letter(1, "m7", "failed", "ValueError"), dead_letter(2, "p1", "poison", None)]
    for _ in range(2):
        archiver.archive("sent", sends)
        archiver.archive("incoming", handled)
        archiver.archive("dead_letters", letters)
    return str(folder / "outbox archive")
