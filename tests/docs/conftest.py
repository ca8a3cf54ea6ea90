"""Fixtures of the tests that run the docs as written: a directory to run them in, with this
interpreter's ``python`` and ``celery`` first on ``PATH``, as a user's virtual environment has."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ..services import require
from .quickstart import QUEUES


class Shell:
    """Runs a doc's commands in ``cwd``, each as a user types it, and its background processes."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        self.env.pop("DJANGO_SETTINGS_MODULE", None)
        self.background: list[subprocess.Popen] = []

    def run(self, command: str, timeout: float = 120, env: dict[str, str] | None = None, exits: int = 0) -> str:
        """Run ``command``; fail with its output unless it exits with ``exits``; return its output."""
        done = subprocess.run(["bash", "-c", command], cwd=self.cwd, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == exits, f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def start(self, command: str, log: str) -> Path:
        """Start ``command`` in the background (a terminal of its own); its output goes to ``log``."""
        path = self.cwd / log
        with open(path, "ab") as out:
            self.background.append(subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.cwd, env=self.env,
                                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        return path

    def stop(self) -> None:
        for process in self.background:  # a warm shutdown, as Ctrl-C in its terminal asks for it
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.background:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


@pytest.fixture
def shell(tmp_path):
    runner = Shell(tmp_path)
    yield runner
    runner.stop()


@pytest.fixture
def clean_services():
    """No role or database ``shop`` (the Quickstart's) before or after, and no message in its queues."""
    import psycopg

    admin = require("postgres").replace("postgresql+psycopg", "postgresql")
    require("redis")

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS shop WITH (FORCE)")
            conn.execute("DROP ROLE IF EXISTS shop")
        broker = redis.Redis.from_url("redis://localhost:6379/0")
        broker.delete(*QUEUES, "unacked", "unacked_index")

    drop()
    yield
    drop()
