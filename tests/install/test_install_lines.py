"""Each install line the docs give, in a fresh virtual environment with exactly that line
installed, runs the smoke scenario (``smoke.py``) against the services that line is for: a unit of
work that commits and one that rolls back, the docs' ``migrate``, a worker and beat, a durable
message consumed by an ``IdempotentTask`` and its copy discarded. The bare line runs on SQLite with
the demos' filesystem broker and on RabbitMQ, with no redis package installed.

The environments install from one wheelhouse that pip builds for every extra at once (the same
resolution as from the package index, without asking it once per line)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..services import free_port, require
from ..workers import ROOT

pytestmark = [pytest.mark.install, pytest.mark.worker]

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Line:
    extras: str  # "" for the bare line
    store: str  # "sqlite" or "postgres"
    broker: str  # "shopfs" (the demos' filesystem broker), "redis" or "rabbitmq"
    django: bool = False
    metrics: bool = False
    asyncio: str | None = None  # the async driver the smoke's async units of work use (None: none run)
    also: tuple[str, ...] = ()  # packages the docs' line installs beside the extras
    imports: tuple[str, ...] = ()  # what the line must make importable
    absent: tuple[str, ...] = ()  # what it must not install

    @property
    def spec(self) -> str:
        return f"{ROOT}[{self.extras}]" if self.extras else str(ROOT)

    def __str__(self) -> str:
        return f"{self.extras or 'bare'}-{self.store}-{self.broker}"


LINES = [
    Line("", "sqlite", "shopfs", absent=("redis", "psycopg", "django", "prometheus_client", "pyspark", "flask")),
    Line("", "sqlite", "rabbitmq", absent=("redis",)),
    Line("postgres", "postgres", "rabbitmq", imports=("psycopg",), absent=("redis",)),
    Line("redis", "sqlite", "redis", imports=("redis", "packaging")),
    Line("postgres,redis", "postgres", "redis", imports=("psycopg", "redis")),
    Line("django,redis", "sqlite", "redis", django=True, imports=("django", "redis")),
    Line("django", "sqlite", "rabbitmq", django=True, imports=("django",), absent=("redis",)),
    Line("metrics", "sqlite", "rabbitmq", metrics=True, imports=("prometheus_client",)),
    Line("otel", "sqlite", "rabbitmq", imports=("opentelemetry.trace",), absent=("opentelemetry.sdk",)),
    Line("postgres,redis,otel", "postgres", "redis", also=("opentelemetry-sdk",), imports=("opentelemetry.sdk",)),
    Line("spark", "sqlite", "shopfs", imports=("pyspark", "pyarrow")),
    Line("demo", "sqlite", "shopfs", imports=("flask", "pyspark")),
    Line("asyncio", "sqlite", "shopfs", asyncio="aiosqlite", imports=("aiosqlite", "greenlet"),
         absent=("asyncpg", "psycopg")),
    Line("postgres,asyncio", "postgres", "rabbitmq", asyncio="psycopg", imports=("psycopg", "greenlet")),
    Line("asyncpg", "postgres", "rabbitmq", asyncio="asyncpg", imports=("asyncpg", "psycopg", "greenlet")),
]


def documented_lines() -> set[str]:
    """The extras of every ``pip install`` line in README.md and docs/, and every extra setup.cfg
    names (each one is a line a user may install alone) but the contributors' (unit, test, bench)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in re.findall(r"pip install [^\n`]*", page.read_text()):
            if "tox" in line.split():
                continue
            match = re.search(r"-e [\"']?\.[^\s\"'\[]*(?:\[([^\]]*)\])?", line) or re.search(
                r"celery-outbox(?:\[([^\]]*)\])? @ git\+file:", line)
            assert match, f"{page.name}: {line!r} does not install from a clone, as the README's Install says"
            found.add(match.group(1) or "")
    config = (ROOT / "setup.cfg").read_text().split("[options.extras_require]", 1)[1].split("\n[", 1)[0]
    found |= {name for name in re.findall(r"^(\w+) =", config, re.M) if name not in ("unit", "test", "bench")}
    return found


def test_every_documented_install_line_is_in_the_matrix():
    assert documented_lines() <= {line.extras for line in LINES}


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory) -> Path:
    """Wheels of celery-outbox's dependencies with every extra, and of its build requirements: built
    once per run, by the first test process that needs them (pip builds the checkout in its tree,
    which two builds at once would share), under a lock the others wait on."""
    import fcntl

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one per run, whichever xdist worker asks
    folder = shared / "wheelhouse"
    with open(shared / "wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            every = ",".join(sorted({extra for line in LINES for extra in line.extras.split(",") if extra}))
            also = sorted({package for line in LINES for package in line.also})
            pip = [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(folder)]
            subprocess.run([*pip, f"{ROOT}[{every}]", *also, "setuptools>=64", "wheel"], check=True, timeout=900)
            for built in folder.glob("celery_outbox-*"):
                built.unlink()  # each line installs the checkout itself
            (folder / "complete").touch()
    return folder


def excerpt(log: str) -> str:
    """A log's end, or, where faulthandler wrote the stacks of a process that hung, the stacks from
    their innermost frames on (the frames a hang is in)."""
    stacks = log.find("Fatal Python error")
    return log[-3000:] if stacks < 0 else log[stacks:stacks + 12000]


def service_urls(line: Line, name: str) -> dict[str, str]:
    env = {}
    if line.store == "postgres":
        env["SMOKE_DATABASE_URL"] = require("postgres")
    if line.broker == "shopfs":
        env["SMOKE_BROKER_URL"] = "shopfs://"
    else:
        env["SMOKE_BROKER_URL"] = require(line.broker)
    return env


@pytest.mark.parametrize("line", LINES, ids=str)
def test_an_install_line_runs_a_worker_beat_and_the_inbox(line, wheelhouse, tmp_path):
    name = f"smoke{uuid.uuid4().hex[:8]}"
    env = {"SMOKE_NAME": name, "SMOKE_DIR": str(tmp_path), "SMOKE_DATABASE_URL": f"sqlite:///{tmp_path}/outbox.sqlite3",
           **service_urls(line, name), "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    if line.django:
        env["SMOKE_DJANGO"] = "1"
    if line.metrics:
        env["SMOKE_METRICS_PORT"] = str(free_port())
    if line.asyncio:
        env["SMOKE_ASYNC"] = "1"
    if line.asyncio == "asyncpg":
        env["SMOKE_ASYNC_DATABASE_URL"] = env["SMOKE_DATABASE_URL"].replace("+psycopg", "").replace(
            "postgresql://", "postgresql+asyncpg://", 1)
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip costs each environment seconds): this process's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", "--no-index",
           "--find-links", str(wheelhouse)]
    installed = subprocess.run([*pip, "-e", line.spec, *line.also], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, f"pip install -e {line.spec}: {installed.stdout}\n{installed.stderr}"
    for module in line.imports + line.absent:
        found = subprocess.run([str(python), "-c", f"import importlib.util as u; print(bool(u.find_spec({module!r})))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert found == ("True" if module in line.imports else "False"), f"{line}: {module} installed is {found}"
    scenario = tmp_path / "scenario"
    scenario.mkdir()
    for file in (HERE / "smoke.py", HERE / "smoke_app.py", HERE.parent / "waiting.py"):
        shutil.copy(file, scenario / file.name)
    if line.broker == "shopfs":
        (scenario / "example_project").mkdir()
        (scenario / "example_project" / "__init__.py").write_text("")
        shutil.copy(ROOT / "example_project" / "broker.py", scenario / "example_project" / "broker.py")
    try:
        ran = subprocess.run([str(python), str(scenario / "smoke.py")], cwd=scenario, env=env, capture_output=True,
                             text=True, timeout=240)
    finally:
        forget(line, name, env)
    logs = "\n".join(f"--- {log.name}\n{excerpt(log.read_text(errors='replace'))}" for log in tmp_path.glob("*.log"))
    assert ran.returncode == 0 and "smoke: ok" in ran.stdout, f"{line}:\n{ran.stdout}\n{ran.stderr}\n{logs}"


def forget(line: Line, name: str, env: dict[str, str]) -> None:
    """Delete the run's queues and tables from the servers other runs share."""
    if line.broker in ("redis", "rabbitmq"):
        from kombu import Connection

        with Connection(env["SMOKE_BROKER_URL"]) as connection:
            channel = connection.default_channel
            for queue in (f"{name}_durable", f"{name}_maintenance"):
                try:
                    channel.queue_delete(queue)
                except Exception:  # noqa: BLE001 - a queue the run never declared
                    channel = connection.channel()
    if line.store == "postgres":
        from sqlalchemy import create_engine, inspect, text

        engine = create_engine(env["SMOKE_DATABASE_URL"])
        with engine.begin() as conn:
            for table in inspect(conn).get_table_names():
                if table.startswith(name):
                    conn.execute(text(f'DROP TABLE "{table}" CASCADE'))
        engine.dispose()

