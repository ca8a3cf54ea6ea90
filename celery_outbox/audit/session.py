"""The Spark side of the delivery audit: the session it starts when none is given, and its facts.

No transaction. No master and no log configuration are hard-coded: the master comes from
spark-submit or ``AuditOptions.master``; a JVM this process starts keeps Spark's own (or the
user's) log configuration, its output sent to a file, and under spark-submit the user's applies
unchanged. A session this process starts on a cluster ships the package to its executors
(``shipping``); on a local master the Python workers run the driver's interpreter, not the
``python3`` of ``PATH``. It also sets the shuffle partitions and reports where the job ran.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from celery_outbox.audit.options import AuditInputError, AuditOptions
from celery_outbox.audit.shipping import is_local, ship_package

__all__ = ["DEFAULT_JDBC_JAR", "PARTITIONS_PER_CORE", "jdbc_jar", "shuffle_partitions", "spark_facts",
           "spark_session", "starts_jvm"]

DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"  # Debian's libpostgresql-jdbc-java
SPARK_DEFAULT_SHUFFLE_PARTITIONS = 200
PARTITIONS_PER_CORE = 4


def jdbc_jar(options: AuditOptions) -> str | None:
    """The PostgreSQL JDBC driver jar the session loads: ``--jdbc-jar``, else Debian's when the live
    tables are read. A jar that is not there is an ``AuditInputError``."""
    jar = options.jdbc_jar or (DEFAULT_JDBC_JAR if options.jdbc_url and os.path.exists(DEFAULT_JDBC_JAR) else None)
    if options.jdbc_url and not jar:
        raise AuditInputError("--jdbc-url needs the PostgreSQL JDBC driver: give its jar with --jdbc-jar "
                              "(Debian: apt install libpostgresql-jdbc-java)")
    if jar and not os.path.exists(jar):
        raise AuditInputError(f"no JDBC driver jar at {jar}")
    return jar


def starts_jvm() -> bool:
    """Whether a session built now starts a JVM of its own: none runs in this process yet, and
    this is not a Python driver that spark-submit started (spark-submit hands it its JVM)."""
    from pyspark import SparkContext

    return SparkContext._gateway is None and "PYSPARK_GATEWAY_PORT" not in os.environ


def spark_session(options: AuditOptions, log: str | None = None):
    """The session the audit runs in, built from ``options``. With ``log`` (a local file), a JVM
    this call starts prints into that file, not onto this process's stdout and stderr: Spark's
    log, the JVM's own warnings, the Python workers it forks. A JVM this call starts with a master
    that is not local gets the package for its executors (``ship_package``); under spark-submit,
    its ``--py-files`` do that."""
    from pyspark.sql import SparkSession

    starting = starts_jvm()  # asked before getOrCreate starts one
    builder = SparkSession.builder.appName("celery-outbox-audit")
    if options.master:
        builder = builder.master(options.master)
    jar = jdbc_jar(options)
    if jar:
        builder = builder.config("spark.jars", jar).config("spark.driver.extraClassPath", jar)
    if options.driver_memory:
        builder = builder.config("spark.driver.memory", options.driver_memory)
    builder = builder.config("spark.sql.session.timeZone", "UTC").config("spark.ui.enabled", "false")
    if log is None:
        session = builder.getOrCreate()
    else:
        with _output_to(log):  # Spark's progress bars, redrawn in place, are noise in a file
            session = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    if starting:
        if is_local(session.sparkContext.master):
            _local_workers_run_this_python(session.sparkContext)
        else:
            ship_package(session)
    return session


def _local_workers_run_this_python(context) -> None:
    """The Python workers of a local JVM this process started run this interpreter, unless
    ``PYSPARK_PYTHON`` names one, or ``spark.pyspark.python`` (which PySpark reads only under
    spark-submit). Spark's default is the ``python3`` of ``PATH``: another Python when this one is
    a virtualenv's run by its path (a cron job, a systemd unit), and Spark refuses a worker of
    another minor version than its driver."""
    if "PYSPARK_PYTHON" not in os.environ:
        context.pythonExec = context.getConf().get("spark.pyspark.python") or sys.executable


@contextmanager
def _output_to(log: str) -> Iterator[None]:
    """Point this process's stdout and stderr at ``log`` (emptied first) for the block: a JVM
    started inside it inherits them and keeps them; this process gets its own back on leaving."""
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (*saved, target):
            os.close(descriptor)


def shuffle_partitions(spark, options: AuditOptions) -> int:
    """The shuffle partitions the audit uses (see ``AuditOptions.shuffle_partitions``)."""
    if options.shuffle_partitions is not None:
        return options.shuffle_partitions
    configured = int(spark.conf.get("spark.sql.shuffle.partitions"))
    if configured != SPARK_DEFAULT_SHUFFLE_PARTITIONS:
        return configured
    return PARTITIONS_PER_CORE * spark.sparkContext.defaultParallelism


def spark_facts(spark, partitions: int) -> dict[str, Any]:
    """Where the audit ran: the master, the shuffle partitions, and the driver's heap (the JVM's
    own maximum, whatever set it)."""
    heap = spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory()
    return {"master": spark.sparkContext.master, "shuffle_partitions": partitions,
            "driver_max_heap_mib": int(heap) // 2**20}
