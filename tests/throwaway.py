"""Private, throwaway PostgreSQL, Redis and RabbitMQ instances for fault-injection tests.

Each instance listens on 127.0.0.1 and a free port, keeps its data in a directory of its own and
never touches the shared services of the machine. Every class offers:

- ``start()``: start (or do nothing when running) and return ``self`` once the service answers;
- ``stop()``: a clean stop that returns once the process has exited;
- ``restart()``: stop then start on the same port and data directory, so data that the service
  persists survives;
- ``url``: the URL a client connects with (fixed for the instance's lifetime);
- ``close()``: stop and delete the data directory; idempotent and safe if never started.

Used as a context manager, an instance is started on entry and closed on exit. A missing binary skips
the test (fails it under ``CELERY_OUTBOX_REQUIRE_SERVICES=1``); a failed start raises an
AssertionError with the tail of the service's own log.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from .services import free_port, services_required, wait_until

RUNNING_AS_ROOT = os.geteuid() == 0


def _unavailable(reason: str) -> None:
    if services_required():
        pytest.fail(f"{reason}; CELERY_OUTBOX_REQUIRE_SERVICES=1 demands it")
    pytest.skip(reason)


def _gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie nobody reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _children(pid: int) -> list[int]:
    children = []
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat_path) as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat_path.split("/")[2]))
    return children


class _Throwaway:
    """Shared lifecycle: subclasses provide ``start``, ``stop``, ``close``, ``url`` and ``log``."""

    url: str
    log: Path | None = None
    process: subprocess.Popen | None = None

    def start(self) -> _Throwaway:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def restart(self) -> _Throwaway:
        self.stop()
        return self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _spawn(self, command: list[str], **options) -> None:
        """Run ``command`` in a process group of its own, its output appended to ``self.log``."""
        assert self.log is not None
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, **options)

    def _failure(self, message: str, lines: int = 40) -> AssertionError:
        tail = "(no log)"
        if self.log is not None and self.log.exists():
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return AssertionError(f"{type(self).__name__}: {message}\n--- last lines of {self.log} ---\n{tail}")

    def _await_answer(self, answers, timeout: float, what: str) -> None:
        """Poll ``answers`` until it is true; on timeout or an early exit, kill the process and raise."""
        try:
            wait_until(lambda: not self._running() or answers(), timeout=timeout, interval=0.1, message=what)
        except AssertionError as exc:
            self._kill_process()
            raise self._failure(str(exc)) from None
        if not self._running():
            code = self.process.returncode if self.process else None
            self.process = None
            raise self._failure(f"the process exited with code {code} before {what}")

    def _kill_process(self) -> None:
        """SIGKILL the whole process group (a service may have started helpers), then reap it."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
            self.process = None


class ThrowawayRedis(_Throwaway):
    """A private redis-server on a free port, its data in a directory of its own under ``tmp_path``.

    ``persistent=True``: append-only file on, so what was written before a ``stop()`` is there after
    ``start()``. ``persistent=False``: no append-only file and no snapshots, so a restart starts empty,
    as a Redis without persistence does.
    """

    def __init__(self, tmp_path: Path, persistent: bool = True):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            _unavailable("redis-server is not installed")
        self.persistent = persistent
        self.port = free_port()
        self.dir = Path(tmp_path) / f"redis-{self.port}"
        self.log = self.dir / "redis.log"
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> ThrowawayRedis:
        if self._running():
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes" if self.persistent else "no", "--save", ""]
        self._spawn([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", *persistence,
                     "--dir", str(self.dir), "--daemonize", "no"])
        self._await_answer(self._answers, timeout=20, what=f"redis-server on port {self.port} to answer")
        return self

    def stop(self) -> None:
        """SIGTERM: redis-server flushes its append-only file and exits."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self._kill_process()
            shutil.rmtree(self.dir, ignore_errors=True)


def _postgres_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        bindir = Path(result.stdout.strip())
        if result.returncode == 0 and (bindir / "initdb").exists():
            return bindir
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


class ThrowawayPostgres(_Throwaway):
    """A private PostgreSQL cluster on 127.0.0.1 and a free port, with trust auth for ``postgres`` and
    a database ``test``; fsync stays on, so ``kill()`` is a real crash that ``start()`` recovers from.

    The cluster lives in a new directory under /tmp (the ``postgres`` user must reach it when the
    tests run as root, and pytest's tmp_path is private to root); ``initdb`` runs on the first
    ``start()``. As root, every server program runs as ``postgres`` through ``runuser``.
    """

    def __init__(self, **server_settings: str):
        """``server_settings``: more ``postgres -c name=value`` settings (``idle_session_timeout="1s"``)."""
        self.server_settings = server_settings
        self.bindir = _postgres_bindir()
        if self.bindir is None:
            _unavailable("PostgreSQL server binaries (initdb, postgres, pg_ctl) are not installed")
        if RUNNING_AS_ROOT:
            import pwd

            try:
                pwd.getpwnam("postgres")
            except KeyError:
                _unavailable("running as root, and there is no postgres user to run PostgreSQL as")
            if shutil.which("runuser") is None:
                _unavailable("running as root, and runuser is missing to run PostgreSQL as postgres")
        self.port = free_port()
        self.dir: Path | None = None
        self.postmaster: int | None = None
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/test"

    @property
    def data(self) -> Path:
        assert self.dir is not None
        return self.dir / "data"

    def _command(self, program: str, *args: str) -> list[str]:
        command = [str(self.bindir / program), *args]
        return ["runuser", "-u", "postgres", "--", *command] if RUNNING_AS_ROOT else command

    def _run(self, program: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self._command(program, *args), cwd=self.dir, capture_output=True, text=True,
                              timeout=timeout)

    def _connect(self, database: str):
        import psycopg

        return psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/{database}", connect_timeout=2,
                               autocommit=True)

    def _answers(self) -> bool:
        try:
            self._connect("postgres").close()
            return True
        except Exception:  # refused, or "the database system is starting up"
            return False

    def _initdb(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-pg-", dir="/tmp"))
        if RUNNING_AS_ROOT:
            shutil.chown(self.dir, "postgres", "postgres")
        self.log = self.dir / "postgres.log"
        # --no-sync only skips initdb's one final flush of the new files; the server runs with fsync on.
        result = self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                           "--locale=C", "--no-sync")
        if result.returncode != 0:
            raise AssertionError(f"ThrowawayPostgres: initdb failed:\n{result.stdout}\n{result.stderr}")

    def start(self) -> ThrowawayPostgres:
        """Start the postmaster as a child of this process: ``pg_ctl start`` would orphan it, and where
        orphans are reaped late (as on this project's CI VMs) a killed postmaster lingers as a zombie
        that the next start takes for a running server."""
        if self._running():
            return self
        first = self.dir is None
        if first:
            self._initdb()
        settings = {"listen_addresses": "127.0.0.1", "port": str(self.port), "unix_socket_directories": str(self.data),
                    "max_connections": "200", "shared_buffers": "16MB", **self.server_settings}
        options = [arg for name, value in settings.items() for arg in ("-c", f"{name}={value}")]
        self._spawn(self._command("postgres", "-D", str(self.data), *options), cwd=self.dir)
        self._await_answer(self._answers, timeout=60, what=f"PostgreSQL on port {self.port} to accept connections")
        self.postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        if first:
            with self._connect("postgres") as conn:
                conn.execute("CREATE DATABASE test")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast`` (by default): sessions are ended, a shutdown checkpoint is written."""
        if not self._running():
            self.process = self.postmaster = None
            return
        result = self._run("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w", "-t", "60")
        if result.returncode != 0:
            raise self._failure(f"pg_ctl stop -m {mode} failed:\n{result.stdout}\n{result.stderr}")
        self.process.wait(timeout=30)
        self.process = self.postmaster = None

    def count_log(self, text: str) -> int:
        """How many times the server's own log says ``text``."""
        return self.log.read_text(errors="replace").count(text) if self.log and self.log.exists() else 0

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash does; returns once its children have noticed and exited,
        so the next ``start()`` goes through crash recovery."""
        if not self._running() or self.postmaster is None:
            return
        children = _children(self.postmaster)
        os.kill(self.postmaster, signal.SIGKILL)
        self.process.wait(timeout=30)
        wait_until(lambda: all(_gone(pid) for pid in children), timeout=30,
                   message="the killed postmaster's children to exit")
        self.process = self.postmaster = None

    def close(self) -> None:
        try:
            self.stop("immediate")  # the data is thrown away: no shutdown checkpoint needed
        finally:
            self._kill_process()
            self.postmaster = None
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None


def _rabbitmq_scripts() -> Path | None:
    """The directory of the real rabbitmq-server script (not Debian's /usr/sbin wrapper, which
    switches to the rabbitmq user and the system node's settings)."""
    candidates = [Path("/usr/lib/rabbitmq/bin")]
    on_path = shutil.which("rabbitmq-server")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    for scripts in candidates:
        if all((scripts / name).exists() for name in ("rabbitmq-server", "rabbitmqctl", "rabbitmq-env")):
            return scripts
    return None


class ThrowawayRabbitMQ(_Throwaway):
    """A second RabbitMQ node, ``outboxtest{port}@localhost``, AMQP and distribution on 127.0.0.1 only,
    guest/guest, no plugins. Its mnesia directory, logs, config and Erlang cookie (its ``HOME``) are in
    a directory of its own under ``tmp_path``, so restarts keep durable queues and persistent messages.

    The real startup script runs as the current user; every RABBITMQ_*/ERL_* variable of the caller
    and of /etc/rabbitmq/rabbitmq-env.conf is replaced, so the system node is never touched.
    """

    def __init__(self, tmp_path: Path):
        self.scripts = _rabbitmq_scripts()
        if self.scripts is None or shutil.which("erl") is None:
            _unavailable("RabbitMQ (rabbitmq-server, rabbitmqctl) and Erlang are not installed")
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"outboxtest{self.port}@localhost"
        self.dir = Path(tmp_path) / f"rabbitmq-{self.port}"
        self.log = self.dir / "rabbitmq.log"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _environment(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("RABBITMQ_", "ERL_")) and name not in ("CONF_ENV_FILE", "HOME")}
        env.update(
            HOME=str(self.dir),  # the Erlang cookie is $HOME/.erlang.cookie, for the node and rabbitmqctl
            RABBITMQ_CONF_ENV_FILE=str(self.dir / "rabbitmq-env.conf"),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONFIG_FILE=str(self.dir / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.dir / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.dir / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.dir / "log"),
            RABBITMQ_PID_FILE=str(self.dir / "rabbitmq.pid"),
            ERL_EPMD_ADDRESS="127.0.0.1",
            ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def _prepare(self) -> None:
        if self.dir.exists():
            return
        (self.dir / "mnesia").mkdir(parents=True)
        (self.dir / "log").mkdir()
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        cookie = self.dir / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)

    def _answers(self) -> bool:
        from kombu import Connection

        try:
            with Connection(self.url, connect_timeout=2) as connection:
                connection.connect()
            return True
        except Exception:  # refused, or the handshake failed while the node boots
            return False

    def start(self) -> ThrowawayRabbitMQ:
        if self._running():
            return self
        self._prepare()
        self._spawn([str(self.scripts / "rabbitmq-server")], env=self._environment(), cwd=self.dir)
        self._await_answer(self._answers, timeout=60, what=f"RabbitMQ node {self.node} to accept AMQP connections")
        return self

    def stop(self) -> None:
        """``rabbitmqctl -n NODE stop``, then wait for the node to exit; if that fails, SIGTERM (which the
        startup script turns into a clean stop), and SIGKILL the node's process group as a last resort."""
        if not self._running():
            self.process = None
            return
        try:
            with open(self.log, "ab") as log:
                stopped = subprocess.run([str(self.scripts / "rabbitmqctl"), "-n", self.node, "stop"],
                                         env=self._environment(), cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            stopped = False
        if not stopped:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=60)
            self.process = None
        except subprocess.TimeoutExpired:
            self._kill_process()

    def close(self) -> None:
        self._kill_process()  # the data is thrown away: no clean stop needed
        shutil.rmtree(self.dir, ignore_errors=True)
