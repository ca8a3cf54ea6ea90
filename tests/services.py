"""Where the real services of the test suite are, and how a test asks for one.

A test that needs PostgreSQL, Redis or RabbitMQ calls ``require(...)``: when the
service does not answer, the test is skipped with the reason, except under
``CELERY_OUTBOX_REQUIRE_SERVICES=1`` (set by ``.ci/run``), where it fails.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from urllib.parse import urlsplit

import pytest

from .waiting import wait_until  # noqa: F401  (the tests import it from here with the services they wait on)


def redis_database_of_this_worker(url: str) -> str:
    """``url`` with the Redis database of this pytest-xdist worker: the given one on the first
    (``gw0``) and on a run without xdist, the one below it on the second (``gw1``), and so on.
    kombu keeps the unacknowledged messages of a whole Redis database in one index, and any client
    gives back every message in it older than its own visibility timeout (the drills' apps set
    3 s): a test beside a drill on one database would get its held messages delivered again."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    parts = urlsplit(url)
    database = int(parts.path.strip("/") or 0) - int(worker.removeprefix("gw"))
    if database < 0:
        raise RuntimeError(f"{url}: no Redis database left for pytest-xdist worker {worker} (take a higher one)")
    return parts._replace(path=f"/{database}").geturl()


POSTGRES_URL = os.environ.get("CELERY_OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = redis_database_of_this_worker(os.environ.get("CELERY_OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"))
RABBITMQ_URL = os.environ.get("CELERY_OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

URLS = {"postgres": POSTGRES_URL, "redis": REDIS_URL, "rabbitmq": RABBITMQ_URL}
DEFAULT_PORTS = {"postgres": 5432, "redis": 6379, "rabbitmq": 5672}


def services_required() -> bool:
    return os.environ.get("CELERY_OUTBOX_REQUIRE_SERVICES") == "1"


@functools.lru_cache(maxsize=None)
def _unreachable_reason(service: str) -> str | None:
    parts = urlsplit(URLS[service].replace("+psycopg", ""))
    host, port = parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[service]
    try:
        with socket.create_connection((host, port), timeout=2):
            pass
    except OSError as exc:
        return f"{service} is not reachable at {host}:{port} ({exc})"
    if service == "postgres":
        try:
            import psycopg

            psycopg.connect(URLS[service].replace("postgresql+psycopg", "postgresql"), connect_timeout=3).close()
        except Exception as exc:  # any failure to log in means the service is unusable here
            return f"postgres at {host}:{port} refused the test login ({exc})"
    return None


# The node id of the fast-layer test running now (not marked ``services``: tests/conftest.py), if any
fast_layer_test: str | None = None


def refuse_in_fast_layer(what: str) -> None:
    """Fail a fast-layer test that asks for ``what``: the fast layer needs no service, starts no process."""
    if fast_layer_test is not None:
        pytest.fail(f"{fast_layer_test} {what} but is in the fast layer: give it a services mark "
                    "(postgres, redis, rabbitmq or worker; tests/conftest.py)", pytrace=False)


def require(service: str) -> str:
    """The service's URL, or skip (fail under CELERY_OUTBOX_REQUIRE_SERVICES=1) when it is down."""
    refuse_in_fast_layer(f"needs {service}")
    reason = _unreachable_reason(service)
    if reason is not None:
        if services_required():
            pytest.fail(f"{reason}; CELERY_OUTBOX_REQUIRE_SERVICES=1 demands it")
        pytest.skip(reason)
    return URLS[service]


@functools.lru_cache(maxsize=None)
def _packet_filter_reason() -> str | None:
    if _iptables() is None:
        return "dropping packets needs iptables (Debian's iptables package)"
    listed = subprocess.run([_iptables(), "-L", "OUTPUT", "-n"], capture_output=True, text=True)
    if listed.returncode != 0:
        return f"iptables cannot read the OUTPUT chain here (root with CAP_NET_ADMIN?): {listed.stderr.strip()}"
    return None


def _iptables() -> str | None:
    return shutil.which("iptables-legacy") or shutil.which("iptables")


def require_packet_filter() -> None:
    """Skip (fail under CELERY_OUTBOX_REQUIRE_SERVICES=1) unless iptables can drop packets here."""
    reason = _packet_filter_reason()
    if reason is not None:
        if services_required():
            pytest.fail(f"{reason}; CELERY_OUTBOX_REQUIRE_SERVICES=1 demands it")
        pytest.skip(reason)


class PacketDrop:
    """iptables rules that drop every packet between two local TCP ports, both ways: a connection
    that goes silent for good, with no reset ever reaching either end, as one to a host that
    vanished from the network does. ``remove`` takes the rules out again (a later connection
    may get the same port)."""

    def __init__(self) -> None:
        self._rules: list[list[str]] = []

    def silence(self, port: int, peer_port: int) -> None:
        for source, destination in ((port, peer_port), (peer_port, port)):
            rule = ["OUTPUT", "-p", "tcp", "-s", "127.0.0.1", "-d", "127.0.0.1", "--sport", str(source),
                    "--dport", str(destination), "-j", "DROP"]
            subprocess.run([_iptables(), "-I", *rule], check=True, capture_output=True)
            self._rules.append(rule)

    def remove(self) -> None:
        for rule in self._rules:
            subprocess.run([_iptables(), "-D", *rule], capture_output=True)
        self._rules.clear()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TcpProxy:
    """A TCP proxy on a free local port in front of a real service. ``stop()`` cuts every
    connection and refuses new ones, as a service that goes down does; ``start()`` brings it back."""

    def __init__(self, target_host: str, target_port: int):
        import threading

        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> "TcpProxy":
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:  # accepted as stop() ran: refused, as a down service would
                client.close()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections.update((client, upstream))
                self._clients.append(client)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def go_silent(self, drop: PacketDrop) -> int:
        """Every connection open now goes silent for good while new ones are served, as a failover
        that moves the service's address leaves the old ones: ``drop`` drops the packets between
        each client and the proxy, then the proxy ends the session behind it (the old server is
        gone, and what it held with it). The clients hear nothing, neither data nor a reset. The
        number of connections silenced."""
        with self._lock:
            clients, self._clients = self._clients, []
        silenced = 0
        for client in clients:
            try:
                drop.silence(client.getpeername()[1], self.port)
            except OSError:  # the client had closed it already
                continue
            silenced += 1
        self._cut_all()
        return silenced

    def stop(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in another thread
            except OSError:
                pass
            listener.close()
        self._cut_all()

    def _cut_all(self) -> None:
        """Close both ends of every connection the proxy holds."""
        with self._lock:
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
                except OSError:
                    pass
            self._connections.clear()
            self._clients.clear()
