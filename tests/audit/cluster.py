"""A real Spark standalone cluster for the audit tests: a master and one worker, started from the
Spark the pyspark package ships, bound to 127.0.0.1 on free ports, with their logs and work
folders in a temporary folder.

Each daemon binds exactly the ports it is given (``spark.port.maxRetries=0``): a port another
process took between ``free_port`` and the bind ends the daemon at once, and ``start`` tries again
on fresh ports, rather than the master moving to the next port while the worker and the test look
for it on the old one.

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
START_ATTEMPTS = 3


class SparkCluster:
    """A standalone master and one worker (``WORKER_CORES`` cores, ``WORKER_MEMORY``); ``url`` is
    the master's ``spark://`` URL, ``work`` the worker's work folder (one subfolder per app)."""

    def __init__(self, spark_home: Path, folder: Path):
        self.spark_class = str(spark_home / "bin" / "spark-class")
        self.folder = folder
        self.work = folder / "work"
        self.url = ""
        self.processes: list[subprocess.Popen] = []
        self.env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        exact_ports = "-Dspark.port.maxRetries=0"
        self.env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(folder), SPARK_WORKER_DIR=str(self.work),
                        SPARK_MASTER_OPTS=f"{exact_ports} -Dspark.master.rest.enabled=false",  # no fixed 6066
                        SPARK_WORKER_OPTS=exact_ports)

    def start(self) -> SparkCluster:
        """Start the master and the worker; return once the worker has registered. A daemon that
        exits (a port taken under it) is retried on fresh ports, ``START_ATTEMPTS`` times in all;
        a worker that never registers fails with both daemons' logs."""
        for attempt in range(1, START_ATTEMPTS + 1):
            self.port, self.webui = free_port(), free_port()
            self.url = f"spark://127.0.0.1:{self.port}"
            self._daemon("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                         "--port", str(self.port), "--webui-port", str(self.webui))
            self._daemon("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                         "--port", str(free_port()), "--webui-port", str(free_port()), "--cores", str(WORKER_CORES),
                         "--memory", WORKER_MEMORY, "--work-dir", str(self.work), self.url)
            try:
                wait_until(self._worker_alive, timeout=120, interval=0.2, message=f"a worker registered at {self.url}")
                return self
            except DaemonExited:
                self.stop()
                if attempt == START_ATTEMPTS:
                    raise
            except AssertionError as timeout:
                raise AssertionError(f"{timeout}\n{self._logs()}") from None

    def _daemon(self, name: str, main_class: str, *args: str) -> None:
        with open(self.folder / f"{name}.log", "wb") as log:
            self.processes.append(subprocess.Popen([self.spark_class, main_class, *args], env=self.env,
                                                   cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def _worker_alive(self) -> bool:
        """Whether the master's JSON page counts one alive worker; a daemon that exited fails at once."""
        for process, name in zip(self.processes, ("master", "worker"), strict=True):
            if process.poll() is not None:
                raise DaemonExited(f"the Spark {name} exited ({process.returncode}):\n{self._logs()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.webui}/json/", timeout=2) as response:
                return json.load(response).get("aliveworkers") == 1
        except OSError:  # the master's UI is not up yet
            return False
        except ValueError:  # its UI answers /json/ with the HTML page until the JSON handler is attached
            return False

    def _logs(self) -> str:
        """The end of each daemon's log, for a failure to show."""
        return "\n".join(f"--- {name}.log ---\n" + (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]
                         for name in ("master", "worker") if (self.folder / f"{name}.log").exists())

    def stop(self) -> None:
        """End the worker (and its executors) and then the master, by process group."""
        while self.processes:
            process = self.processes.pop()
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


class DaemonExited(AssertionError):
    """A Spark daemon ended while the cluster started."""
