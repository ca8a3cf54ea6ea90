"""Real Celery worker processes for tests: started as `celery worker` subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[1]


class WorkerProcess:
    ready_line = " ready."

    def __init__(self, app_module: str, env: dict[str, str], pool: str = "prefork", concurrency: int = 2,
                 queues: list[str] | None = None, log_path: Path | None = None):
        self.command = [
            sys.executable, "-m", "celery", "-A", app_module, "worker", "-P", pool, "-c", str(concurrency),
            "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "INFO",
            "-n", f"test-{uuid.uuid4().hex[:8]}@%h",  # unique node names: RabbitMQ's pidbox queue is exclusive
        ]
        if queues:
            self.command += ["-Q", ",".join(queues)]
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def hostname(self) -> str:
        """The worker's node name, for control commands sent to it alone."""
        return self.command[self.command.index("-n") + 1].replace("%h", socket.gethostname())

    def start(self) -> "WorkerProcess":
        from .services import refuse_in_fast_layer

        refuse_in_fast_layer(f"starts {self.command[3:6]}")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60) -> "WorkerProcess":
        """Wait until the worker says it is ready to consume (needs a log_path)."""
        from .services import wait_until

        wait_until(lambda: self.ready_line in self.log() or self.process.poll() is not None, timeout=timeout,
                   message=f"{self.command[5]} to be ready (log: {self.log_path})")
        assert self.process.poll() is None, f"the worker exited with {self.process.returncode}: {self.log()[-2000:]}"
        return self

    def stop(self, timeout: float = 30, cold: bool = False) -> int | None:
        """Warm shutdown (SIGTERM; SIGQUIT for a cold one) and wait; SIGKILL the group if it does not stop."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGQUIT if cold else signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children: a crash, no cleanup."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


class BeatProcess(WorkerProcess):
    """A real ``celery beat`` process with its schedule file in a test's directory."""

    ready_line = "beat: Starting..."

    def __init__(self, app_module: str, env: dict[str, str], log_path: Path):
        self.command = [sys.executable, "-m", "celery", "-A", app_module, "beat", "-l", "INFO",
                        "--schedule", str(log_path.with_suffix(".schedule"))]
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
        self.log_path = log_path
        self.process = None
