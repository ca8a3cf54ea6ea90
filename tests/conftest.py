"""Fixtures shared by every test layer."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
from sqlalchemy import inspect

from celery_outbox.store import Store, build_engine

from .services import require


def quick_memory_transport() -> None:
    """Make the workers that tests start in a thread (``celery.contrib.testing.worker``) on kombu's
    ``memory://`` transport take a message within milliseconds and stop at once. The virtual
    transport polls an empty queue once a second, and Celery's loop for it (``synloop``) waits two
    seconds in ``drain_events`` before it looks at a pending shutdown: each such worker cost a
    test about four seconds of idling. Here a drain polls every 5 ms and gives up at once when
    the worker is told to stop (``state.should_terminate``); its result is as before."""
    import socket
    import time

    from celery.worker import state
    from kombu.transport import memory

    drain = memory.Transport.drain_events

    def drain_events(self, connection, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            try:
                return drain(self, connection, timeout=step)
            except socket.timeout:
                if state.should_terminate is not None or (deadline is not None and time.monotonic() >= deadline):
                    raise

    memory.Transport.drain_events = drain_events
    memory.Transport.polling_interval = 0.005


def pytest_configure(config) -> None:
    """Configure Django for the tests of ``tests/django`` (pytest-django) in this process only:
    ``settings.configure`` sets no ``DJANGO_SETTINGS_MODULE``, so the worker and beat processes
    the other tests start run without Django, as a plain Celery project's do. The fast layer's
    environment (``tox -e unit``) has no Django."""
    quick_memory_transport()
    if importlib.util.find_spec("django") is None:
        return
    from django.conf import settings

    if not settings.configured:
        from .django_project import settings as project

        settings.configure(**{name: getattr(project, name) for name in dir(project) if name.isupper()})


TESTS = Path(__file__).parent

# The suite runs on four pytest-xdist workers (``-n 4 --dist loadgroup``, tox.ini; the tests wait on
# services and processes far more than they compute, so four keep two cores busy): each test has
# tables, queues and services of its own, except in these layers, whose tests run one after another
# on one xdist worker:
ONE_WORKER_LAYERS = {
    "audit": "its tests share one Spark session and one audit of the known archive (session fixtures)",
    "compat": "its tests share the compatibility harness's workers (a session fixture)",
    "demo": "the demos use the example shop's own table and queue names, as a user runs them",
    "docs": "the docs' snippets use the names they give (the database shop, Redis database 0, payments)",
}
# Files of those layers that share nothing with the rest of their layer, run on a worker of their
# own (with a Spark session of their own): the layer's tests would otherwise be the run's longest path
OWN_GROUP_FILES = {"test_audit_cluster.py": "audit-cluster", "test_audit_benchmark.py": "audit-cluster",
                   "test_audit_incremental.py": "audit-incremental"}


def layer_of(item) -> str:
    """The layer of a test: its folder right under ``tests/`` (``tests/unit/consumer/...`` is unit)."""
    return item.path.relative_to(TESTS).parts[0]


def xdist_group_of(item) -> str | None:
    """The xdist group a test must run in, or None (any worker)."""
    layer = layer_of(item)
    if layer not in ONE_WORKER_LAYERS:
        return None
    return OWN_GROUP_FILES.get(item.path.name, layer)


# What makes a test need a service or start a process: ``services``-marked, it is outside the fast
# layer (``-m "not services"``, ``tox -e unit``). Every test outside ``tests/unit`` is; in it, a test
# with one of these marks or fixtures, or run on PostgreSQL by the ``database_url`` fixture.
FAST_LAYER = "unit"
SERVICE_MARKS = {"postgres", "redis", "rabbitmq", "worker", "install", "compat"}
SERVICE_FIXTURES = {"postgres_url", "redis_url", "rabbitmq_url"}


def needs_services(item) -> bool:
    if layer_of(item) != FAST_LAYER:
        return True
    if SERVICE_MARKS & {mark.name for mark in item.iter_markers()}:
        return True
    if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("database_url") == "postgres"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests that need a service or start a process (``services``), and keep each layer of
    ``ONE_WORKER_LAYERS`` on one xdist worker (a no-op without pytest-xdist). It runs before xdist's
    own hook, which reads the ``xdist_group`` marks to group the tests."""
    for item in items:
        if needs_services(item):
            item.add_marker(pytest.mark.services)
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """While a test of the fast layer runs, asking for a service or starting a worker process fails
    it, naming the mark it lacks (``services.fast_layer_test``)."""
    from . import services

    services.fast_layer_test = None if item.get_closest_marker("services") else item.nodeid
    try:
        yield
    finally:
        services.fast_layer_test = None


# Greenlet libraries the suite uses only in subprocesses: eventlet's import alone re-imports
# ``threading`` and ``_thread`` as second copies inside the process, beside the threads the suite's
# nodes run (a pytest process that had done so once died of a segfault in such a thread).
SUBPROCESS_ONLY_MODULES = ("eventlet", "gevent")


def pytest_runtest_teardown(item) -> None:
    """Fail the test after which a module of ``SUBPROCESS_ONLY_MODULES`` is in this process."""
    import sys

    imported = [name for name in SUBPROCESS_ONLY_MODULES if name in sys.modules]
    if imported:
        pytest.fail(f"{item.nodeid} imported {', '.join(imported)} into the pytest process: the suite runs "
                    "greenlet libraries in subprocesses only (check for them with importlib.util.find_spec)")


def pytest_runtest_setup(item) -> None:
    """Under ``--dist loadgroup`` (on an xdist worker), fail a test of ``ONE_WORKER_LAYERS`` that
    xdist did not group, naming why: its layer's tests would run at once on two workers and
    share what they cannot share. pytest 9.2 keeps its node ids where pytest-xdist 3.8 writes the
    group (``item._nodeid``), so there xdist groups nothing."""
    group = xdist_group_of(item)
    if group is not None and getattr(item.config.option, "loadgroup", False) \
            and not item.nodeid.endswith(f"@{group}"):
        import xdist

        pytest.fail(f"pytest-xdist did not keep the {group!r} group's tests on one worker: pytest "
                    f"{pytest.__version__} with pytest-xdist {xdist.__version__} ignores their xdist_group mark; "
                    "install the versions the test extra of setup.cfg allows", pytrace=False)


# A test's line for the run's summary, recorded with ``record_property(SUMMARY_LINE, line)``: each
# fault drill's outcome. pytest-xdist passes a report's properties to the controlling process, not
# what a test prints.
SUMMARY_LINE = "summary line"


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the summary lines the tests recorded, in the order they ended; then where the run's
    time went: the test time (setup, call and teardown) of each layer and of the slowest files."""
    lines = [value for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed")
             if report.when == "call" for name, value in report.user_properties if name == SUMMARY_LINE]
    if lines:
        terminalreporter.write_sep("=", "fault drills")
        for line in lines:
            terminalreporter.write_line(line)
    by_file: dict[str, float] = {}
    for status in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.getreports(status):
            path = report.nodeid.split("::", 1)[0]
            by_file[path] = by_file.get(path, 0.0) + getattr(report, "duration", 0.0)
    if not by_file:
        return
    by_layer: dict[str, float] = {}
    for path, seconds in by_file.items():
        layer = path.split("/")[1] if path.count("/") >= 2 else path
        by_layer[layer] = by_layer.get(layer, 0.0) + seconds
    terminalreporter.write_sep("=", "test time by layer (summed over the test processes)")
    for layer, seconds in sorted(by_layer.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {layer}")
    terminalreporter.write_sep("-", "the slowest files")
    for path, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}_"


def stop_nodes(table_prefix: str | None = None) -> None:
    """Deregister the node of every outbox of this process (of ``table_prefix`` only, when given):
    a test's outbox that sent to a durable queue registered one, whose heartbeat thread and
    liveness connection would otherwise outlive the test. Its tables may be gone: the node stops
    all the same."""
    from celery_outbox.core.runtime import installed_runtimes

    for runtime in installed_runtimes():
        node = getattr(runtime.owner, "node", None)
        if node is None or not node.registered():
            continue
        if table_prefix is not None and runtime.settings.table_prefix != table_prefix:
            continue
        try:
            node.deregister()
        except Exception:  # noqa: BLE001 - its tables were dropped: the thread and connection stop anyway
            pass


@pytest.fixture(autouse=True)
def _no_node_outlives_its_test():
    yield
    stop_nodes()


def drop_store(store: Store) -> None:
    """Drop the store's tables that exist, once the nodes of outboxes on them are deregistered."""
    stop_nodes(store.prefix)
    with store.engine.begin() as conn:
        existing = set(inspect(conn).get_table_names())
        for table in reversed(store.tables.all()):
            if table.name in existing:
                table.drop(conn)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'outbox.sqlite3'}"


@pytest.fixture
def postgres_url() -> str:
    return require("postgres")


@pytest.fixture
def redis_url() -> str:
    return require("redis")


@pytest.fixture
def rabbitmq_url() -> str:
    return require("rabbitmq")


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path) -> str:
    """Each test that takes this runs twice: on SQLite and on a real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    return require("postgres")


@pytest.fixture
def table_prefix() -> str:
    """A fresh table prefix per test, so tests share one PostgreSQL database without meeting."""
    return unique_prefix()


@pytest.fixture
def store(database_url, table_prefix):
    """A migrated store on SQLite and on PostgreSQL; its tables are dropped afterwards."""
    engine = build_engine(database_url)
    store = Store(engine, table_prefix)
    store.migrate()
    yield store
    drop_store(store)
    engine.dispose()


def handled_row(store: Store, message_id: str, destination: str = ""):
    """The inbox row of ``message_id`` once it is handled, else None (no row yet: an optimistic
    attempt on a durable queue commits none until it ends)."""
    row = store.get_incoming(message_id, destination)
    return row if row is not None and row.status == "handled" else None


def unsent_rows(store: Store) -> int:
    """Count outgoing rows still to be published (not yet sent), from a connection outside any
    transaction of the store (no lock taken)."""
    return outgoing_rows(store)[1]


def outgoing_rows(store: Store) -> tuple[int, int]:
    """Count the outgoing rows, and those still to be published (not yet sent), from a connection
    outside any transaction of the store (no lock taken)."""
    connection = store.engine.raw_connection()
    try:
        cursor = connection.cursor()
        cursor.execute(f"SELECT count(*), count(*) - count(sent_at) FROM {store.tables.outgoing.name}")
        return tuple(cursor.fetchone())
    finally:
        connection.rollback()
        connection.close()
