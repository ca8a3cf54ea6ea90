"""The delivery audit on a real Spark standalone cluster (``spark_cluster``): submitted by the
command and by spark-submit (which gives the master: none is hard-coded), its code shipped to the
executors as a zip, its summary the same as local mode's on the same archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from celery_outbox.audit.shipping import ZIP_NAME, is_local, package_zip

from .conftest import COMMAND_TIMEOUT, write_known_archive

ROOT = Path(__file__).parents[2]
EXIT_LOST = 1  # the known archive, weeks after its sends, has m8 and m9 lost
#: what legitimately differs between two runs: when each ran, and where (the master, its partitions)
PER_RUN = ("generated_at", "spark")


def driver_env(tmp_path: Path) -> dict[str, str]:
    """The driver's environment: the project importable, the venv's Python for the executors, and
    the driver reachable on 127.0.0.1, where the cluster listens."""
    return dict(os.environ, TEST_DATABASE_URL=f"sqlite:///{tmp_path / 'store.db'}", PYTHONPATH=str(ROOT),
                PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")


def audit_command(tmp_path: Path, archive: str, out: Path, master: str) -> dict:
    """``celery outbox audit`` of ``archive`` on ``master`` in a process of its own; its summary."""
    process = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "outbox", "audit", "--archive", archive,
         "--out", str(out), "--master", master],
        env=driver_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert process.returncode == EXIT_LOST, process.stderr[-3000:] + _tail(out / "spark.log")
    return json.loads((out / "summary.json").read_text())


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def without_run(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key not in PER_RUN}


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> str:
    return write_known_archive(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def local_summary(spark, archive, tmp_path_factory) -> dict:
    """The summary of ``archive`` in local mode (the tests' shared session), with the command's
    defaults: what the cluster's must equal."""
    from celery_outbox.audit.job import AuditOptions, run_audit

    summary = run_audit(AuditOptions(out=str(tmp_path_factory.mktemp("local") / "out"), archive=archive), spark)
    assert summary["lost"] == 2 and summary["handled"] == 7, summary
    return summary


def test_the_command_audits_on_a_cluster_as_in_local_mode(spark_cluster, archive, local_summary, tmp_path):
    summary = audit_command(tmp_path, archive, tmp_path / "out", spark_cluster.url)
    assert summary["spark"]["master"] == spark_cluster.url
    assert without_run(summary) == without_run(local_summary)
    fetched = list(spark_cluster.work.glob(f"app-*/*/{ZIP_NAME}"))
    assert fetched, "an executor fetched the package's zip the command shipped"


def test_spark_submit_audits_on_a_cluster_with_the_zip_as_py_files(spark_cluster, archive, local_summary, tmp_path):
    import pyspark

    import celery_outbox.audit.job as job

    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    out = tmp_path / "out"
    process = subprocess.run(
        [str(spark_submit), "--master", spark_cluster.url, "--py-files", package_zip(str(tmp_path)), job.__file__,
         "--archive", archive, "--out", str(out)],
        env=driver_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert process.returncode == EXIT_LOST, process.stderr[-3000:]
    assert "2 lost" in process.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["spark"]["master"] == spark_cluster.url
    assert without_run(summary) == without_run(local_summary)


def test_executors_import_the_package_from_the_shipped_zip(spark_cluster, tmp_path):
    """The audit runs no Python on executors today; a function over rows would, and would import
    celery_outbox from the zip the driver shipped, first on the executor's path, not from whatever
    the executor's own Python has installed."""
    probe = ("import sys\n"
             "from celery_outbox.audit.options import AuditOptions\n"
             "from celery_outbox.audit.session import spark_session\n"
             "spark = spark_session(AuditOptions(out='unused', master=sys.argv[1]))\n"
             "where = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__('os').path.abspath(\n"
             "    __import__('celery_outbox.audit.location').__file__)).first()\n"
             "print('executor:', where)\n"
             "spark.stop()\n")
    process = subprocess.run([sys.executable, "-c", probe, spark_cluster.url], env=driver_env(tmp_path),
                             cwd=tmp_path, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert process.returncode == 0, process.stderr[-3000:]
    where = process.stdout.splitlines()[-1].removeprefix("executor: ")
    assert f"{ZIP_NAME}/celery_outbox/__init__.py" in where, where
    assert where.startswith(str(spark_cluster.work)), "the executor's own copy, fetched into its work folder"


def test_local_mode_ships_nothing(spark):
    assert not [path for path in spark.sparkContext.listFiles if path.endswith(ZIP_NAME)]


def test_the_zip_holds_the_package_without_bytecode(tmp_path):
    with zipfile.ZipFile(package_zip(str(tmp_path))) as archive:
        names = archive.namelist()
    assert "celery_outbox/__init__.py" in names and "celery_outbox/audit/job.py" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


@pytest.mark.parametrize("master, local", [("local", True), ("local[2]", True), ("local[*]", True),
                                           ("spark://127.0.0.1:7077", False), ("yarn", False)])
def test_only_a_local_master_runs_without_shipping(master, local):
    assert is_local(master) is local
