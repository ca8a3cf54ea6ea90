"""A real Spark standalone cluster for the audit tests: a master and one worker, started from the
Spark the pyspark package ships, bound to 127.0.0.1 on free ports, with their logs and work
folders in a temporary folder.

The daemons run without the project on their PYTHONPATH and outside its folder, so executors
import celery_outbox only from what the driver ships them. Each runs in a process group of its
own (the worker's executors are in the worker's), which ``stop`` ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

from ..services import free_port, wait_until

WORKER_CORES = 1
WORKER_MEMORY = "1g"


class SparkCluster:
    """A standalone master and one worker (``WORKER_CORES`` cores, ``WORKER_MEMORY``); ``url`` is
    the master's ``spark://`` URL, ``work`` the worker's work folder (one subfolder per app)."""

    def __init__(self, spark_home: Path, folder: Path):
        self.spark_class = str(spark_home / "bin" / "spark-class")
        self.folder = folder
        self.work = folder / "work"
        self.port, self.webui = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen] = []
        self.env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        self.env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(folder), SPARK_WORKER_DIR=str(self.work))

    def start(self) -> SparkCluster:
        """Start the master and the worker; return once the worker has registered."""
        self._daemon("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                     "--port", str(self.port), "--webui-port", str(self.webui))
        self._daemon("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                     "--port", str(free_port()), "--webui-port", str(free_port()), "--cores", str(WORKER_CORES),
                     "--memory", WORKER_MEMORY, "--work-dir", str(self.work), self.url)
        wait_until(self._worker_alive, timeout=120, interval=0.2, message=f"a worker registered at {self.url}")
        return self

    def _daemon(self, name: str, main_class: str, *args: str) -> None:
        with open(self.folder / f"{name}.log", "wb") as log:
            self.processes.append(subprocess.Popen([self.spark_class, main_class, *args], env=self.env,
                                                   cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def _worker_alive(self) -> bool:
        """Whether the master's JSON page counts one alive worker; a daemon that exited fails at once."""
        for process, name in zip(self.processes, ("master", "worker"), strict=True):
            if process.poll() is not None:
                log = (self.folder / f"{name}.log").read_text(errors="replace")
                raise AssertionError(f"the Spark {name} exited ({process.returncode}): {log[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.webui}/json/", timeout=2) as response:
                return json.load(response).get("aliveworkers") == 1
        except OSError:  # the master's UI is not up yet
            return False
        except ValueError:  # its UI answers /json/ with the HTML page until the JSON handler is attached
            return False

    def stop(self) -> None:
        """End the worker (and its executors) and then the master, by process group."""
        for process in reversed(self.processes):
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
