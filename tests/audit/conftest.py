"""One local Spark session for the audit tests (it takes seconds to start); its log goes to a file."""

from __future__ import annotations

import os
import shutil

import pytest

from ..services import services_required

JDBC_JAR = "/usr/share/java/postgresql.jar"


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    missing = [name for name in ("pyspark", "pyarrow") if __import__("importlib").util.find_spec(name) is None]
    java = shutil.which("java") or (os.environ.get("JAVA_HOME") and os.path.join(os.environ["JAVA_HOME"], "bin/java"))
    reason = (f"the audit needs {', '.join(missing)} (pip install 'celery-outbox[spark]')" if missing
              else None if java else "the audit needs Java (a JRE 17 on PATH or JAVA_HOME)")
    if reason:
        if services_required():
            pytest.fail(reason)
        pytest.skip(reason)
    from celery_outbox.audit.job import AuditOptions
    from celery_outbox.audit.session import spark_session

    session = spark_session(AuditOptions(out="unused", master="local[2]", jdbc_url="jdbc:postgresql://unused/x",
                                         jdbc_jar=JDBC_JAR if os.path.exists(JDBC_JAR) else None)
                            if os.path.exists(JDBC_JAR) else AuditOptions(out="unused", master="local[2]"),
                            log=str(tmp_path_factory.mktemp("spark") / "spark.log"))
    session.conf.set("spark.sql.shuffle.partitions", "4")
    yield session
    session.stop()
