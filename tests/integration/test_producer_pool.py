"""Senders never wait forever on the app's producer pool, nor on the outbox's connection pool.

Many threads sending to a durable queue outside a unit of work finish, with the default
``broker_pool_limit`` and more threads than it allows, and with a pool of one; so do 50
threads each in its own unit of work (more than the engine's pool holds), a unit of work
sending more messages than the producer pool holds, canvas groups from 50 threads, and 50
greenlets under gevent and under eventlet (a monkey-patched subprocess). Each side by side
with plain Celery (PostgreSQL store, Redis broker).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
from celery import Celery, group

from celery_outbox import Outbox
from celery_outbox.store import Store, build_engine

from ..apps import pool_worker_app
from ..brokers import purge, receive
from ..conftest import drop_store, unsent_rows
from ..services import require
from ..workers import WorkerProcess

DEADLINE = 60.0  # seconds for every sender together; a blocked sender never finishes
MESSAGES_PER_THREAD = 5
ROOT = Path(__file__).resolve().parents[2]
GREEN_SENDERS = ROOT / "tests" / "apps" / "green_senders.py"


def _app(with_outbox: bool, database_url: str, table_prefix: str, **conf) -> tuple[Celery, Outbox | None, str]:
    queue = f"pool_{uuid.uuid4().hex[:8]}"
    app = Celery(f"pool_{queue}", broker=require("redis"), set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=False, **conf)
    outbox = None
    if with_outbox:
        app.conf.update(outbox_database_url=database_url, outbox_table_prefix=table_prefix,
                        outbox_durable_queues=[queue])
        outbox = Outbox(app)
        outbox.ready()
    return app, outbox, queue


@pytest.mark.parametrize("with_outbox", [False, True], ids=["plain", "outbox"])
@pytest.mark.parametrize(("threads", "pool_limit"), [(50, None), (1, 1)], ids=["50-threads-default-pool", "pool-of-1"])
def test_threads_sending_to_a_durable_queue_never_block(with_outbox, threads, pool_limit, table_prefix):
    database_url = require("postgres")
    conf = {} if pool_limit is None else {"broker_pool_limit": pool_limit}
    app, outbox, queue = _app(with_outbox, database_url, table_prefix, **conf)
    if pool_limit is None:
        assert threads > app.conf.broker_pool_limit, "more senders than the default pool holds"

    @app.task(name="pool.send", shared=False)
    def send(x):
        return x

    def send_some(n: int) -> list[str]:
        return [send.delay(n * MESSAGES_PER_THREAD + i).id for i in range(MESSAGES_PER_THREAD)]

    _check_and_clean(app, outbox, queue, _run_senders(threads, send_some))


def _run_senders(threads: int, send_some: Callable[[int], list[str]]) -> list[str]:
    """Run ``send_some(n)`` in ``threads`` threads at once; every one must finish by the deadline,
    without an error. Returns the ids sent."""
    sent: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def sender(n: int) -> None:
        try:
            ids = send_some(n)
            with lock:
                sent.extend(ids)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=sender, args=(n,), daemon=True) for n in range(threads)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + DEADLINE
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0))
    blocked = sum(worker.is_alive() for worker in workers)
    assert blocked == 0, f"{blocked} of {threads} senders still blocked after {DEADLINE} s"
    assert errors == []
    return sent


def _check_and_clean(app: Celery, outbox: Outbox | None, queue: str, sent: list[str]) -> None:
    """Every message sent arrived on the queue; with an outbox, no outgoing row is left unsent."""
    assert sorted(m.id for m in receive(app, queue, len(sent), timeout=30)) == sorted(sent)
    if outbox is not None:
        assert unsent_rows(outbox.store) == 0, "every stored message was published"
        drop_store(outbox.store)
        outbox.engine.dispose()
    purge(app, queue)


@pytest.mark.parametrize("with_outbox", [False, True], ids=["plain", "outbox"])
def test_threads_each_in_a_unit_of_work_never_block(with_outbox, table_prefix):
    """50 threads, each sending in its own ``outbox.transaction()``: more than the producer pool
    and more than the engine's connection pool hold. A unit of work publishes after its Session
    gave its connection back: holding it while publishing took a second connection per thread,
    and 15 threads holding one each waited 30 s for the pool, then failed."""
    threads = 50
    app, outbox, queue = _app(with_outbox, require("postgres"), table_prefix)
    assert threads > app.conf.broker_pool_limit
    if outbox is not None:
        assert threads > outbox.engine.pool.size(), "more units of work than the engine's pool holds"

    @app.task(name="pool.send", shared=False)
    def send(x):
        return x

    def send_some(n: int) -> list[str]:
        if outbox is None:  # plain Celery has no unit of work: the same sends
            return [send.delay(n * MESSAGES_PER_THREAD + i).id for i in range(MESSAGES_PER_THREAD)]
        with outbox.transaction():
            return [send.delay(n * MESSAGES_PER_THREAD + i).id for i in range(MESSAGES_PER_THREAD)]

    sent = _run_senders(threads, send_some)
    assert len(sent) == threads * MESSAGES_PER_THREAD
    _check_and_clean(app, outbox, queue, sent)


@pytest.mark.parametrize("with_outbox", [False, True], ids=["plain", "outbox"])
def test_a_unit_of_work_sending_more_messages_than_the_pool_holds(with_outbox, table_prefix):
    """With ``broker_pool_limit=1``, one unit of work sends 20 messages (each ``delay`` takes and
    gives back the one producer), then publishes them all after the commit on one producer."""
    app, outbox, queue = _app(with_outbox, require("postgres"), table_prefix, broker_pool_limit=1)

    @app.task(name="pool.send", shared=False)
    def send(x):
        return x

    def send_some(n: int) -> list[str]:
        if outbox is None:
            return [send.delay(i).id for i in range(20)]
        with outbox.transaction():
            return [send.delay(i).id for i in range(20)]

    sent = _run_senders(1, send_some)
    assert len(sent) == 20 > app.conf.broker_pool_limit
    _check_and_clean(app, outbox, queue, sent)


@pytest.mark.parametrize("mode", ["plain", "outside", "transaction"])
def test_groups_from_threads_never_block(mode, table_prefix):
    """50 threads each apply a group of 20 to a durable queue: Celery holds one producer for the
    group and passes it to every member's publish, which the hook uses (``outside``: store-and-
    forward), or captures (``transaction``: published after the commit)."""
    threads, size = 50, 20
    app, outbox, queue = _app(mode != "plain", require("postgres"), table_prefix)

    @app.task(name="pool.send", shared=False)
    def send(x):
        return x

    def send_some(n: int) -> list[str]:
        canvas = group(send.s(n * size + i) for i in range(size))
        if mode == "transaction":
            with outbox.transaction():
                result = canvas.apply_async()
        else:
            result = canvas.apply_async()
        return [member.id for member in result.results]

    sent = _run_senders(threads, send_some)
    assert len(sent) == threads * size
    _check_and_clean(app, outbox, queue, sent)


GREEN_RUNS = [(library, mode) for library in ("gevent", "eventlet") for mode in ("plain", "outside", "transaction")]
GREEN_RUNS += [("eventlet-wait_select", mode) for mode in ("outside", "transaction")]
PSYCOPG_WAIT = {"gevent": "wait_poll", "eventlet": "wait_c", "eventlet-wait_select": "wait_select"}


def skip_without(library: str) -> None:
    """Skip when the greenlet library is not installed, without importing it here: importing
    eventlet re-imports ``threading`` and ``_thread`` as second copies inside this process (its
    ``__original_module_*``), beside the threads the suite's nodes run."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is in the test extra")


def _green_env(library: str, **extra: str) -> tuple[str, dict[str, str]]:
    """The greenlet library and the environment of a script run under it (``eventlet-wait_select``:
    eventlet with ``PSYCOPG_WAIT_FUNC=wait_select``)."""
    name, _, wait_func = library.partition("-")
    skip_without(name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("PSYCOPG_WAIT_FUNC", None)
    if wait_func:
        env["PSYCOPG_WAIT_FUNC"] = wait_func
    return name, env


def _run_script(script: Path, name: str, env: dict[str, str]) -> dict:
    completed = subprocess.run([sys.executable, str(script), name], env=env, cwd=ROOT, capture_output=True,
                               text=True, timeout=DEADLINE + 60)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("library", "mode"), GREEN_RUNS, ids=[f"{lib}-{mode}" for lib, mode in GREEN_RUNS])
def test_greenlets_sending_to_a_durable_queue_never_block(library, mode, table_prefix):
    """50 greenlets in a process monkey-patched first thing, each sending 5 messages with ``delay``
    to a durable queue (``outside`` a unit of work, or each in its own ``transaction``), with the
    default ``broker_pool_limit``; ``plain``: the same script without an Outbox."""
    database_url, broker_url = require("postgres"), require("redis")
    queue = f"green_{uuid.uuid4().hex[:8]}"
    name, env = _green_env(library, TEST_BROKER_URL=broker_url, TEST_DATABASE_URL=database_url,
                           TEST_TABLE_PREFIX=table_prefix, TEST_QUEUE=queue)
    app = Celery(f"green_{queue}", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue)
    try:
        completed = subprocess.run([sys.executable, str(GREEN_SENDERS), name, mode], env=env, cwd=ROOT,
                                   capture_output=True, text=True, timeout=DEADLINE + 60)
        assert completed.returncode == 0, completed.stderr
        summary = json.loads(completed.stdout.strip().splitlines()[-1])
        assert summary["socket_patched"], f"{name} patched the socket module"
        assert summary["greenlets"] == 50 > summary["pool_limit"] == 10
        assert summary["blocked"] == 0, f"{summary['blocked']} greenlets still blocked"
        assert summary["errors"] == []
        assert len(summary["sent"]) == 50 * 5
        assert sorted(m.id for m in receive(app, queue, len(summary["sent"]), timeout=30)) == sorted(summary["sent"])
        if mode != "plain":
            assert summary["unsent_rows"] == 0, "every stored message was published"
            assert summary["psycopg_wait"] == PSYCOPG_WAIT[library]
    finally:
        engine = build_engine(database_url)
        drop_store(Store(engine, table_prefix))
        engine.dispose()
        purge(app, queue)


@pytest.mark.parametrize(("library", "cooperative"), [("gevent", True), ("eventlet", False),
                                                      ("eventlet-wait_select", True)])
def test_whether_psycopg_lets_other_greenlets_run_while_it_waits(library, cooperative):
    """psycopg 3 picks its wait function when imported: under gevent's patching, gevent's poll()
    (it checks for gevent, and only for gevent); under eventlet's, its C poll(), which blocks
    the whole process while it waits for the server. Greenlet B waits for an advisory lock that
    greenlet A gives back once B waits: with the C wait, A never runs again and B's wait ends in
    the server's ``lock_timeout``. ``PSYCOPG_WAIT_FUNC=wait_select`` (set before psycopg is
    imported) makes psycopg wait in eventlet's patched select()."""
    name, env = _green_env(library, TEST_DATABASE_URL=require("postgres"))
    outcome = _run_script(ROOT / "tests" / "apps" / "green_lock_wait.py", name, env)
    assert outcome["psycopg_wait"] == PSYCOPG_WAIT[library]
    if cooperative:
        assert outcome == {**outcome, "b_got_lock": True, "b_error": None}
    else:
        assert outcome["b_got_lock"] is False
        assert outcome["b_error"].startswith("LockNotAvailable"), outcome


@pytest.mark.parametrize("with_outbox", [False, True], ids=["plain", "outbox"])
@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 20), ("gevent", 20)])
def test_worker_tasks_publishing_from_their_bodies_never_block(pool, concurrency, with_outbox, table_prefix,
                                                                tmp_path):
    """A worker with a thread or gevent pool of 20 and ``broker_pool_limit=1`` runs 40 tasks, each of
    which retries itself once from its body, then sends two messages to another durable queue.
    With an Outbox (IdempotentTask): the retry is published after the attempt's rollback, the sends
    after the inbox's commit, each on a producer taken when the thread holds none; plain Celery side
    by side. Every task's two messages arrive."""
    if pool == "gevent":
        skip_without("gevent")
    tasks = 40
    database_url, broker_url = require("postgres"), require("redis")
    suffix = uuid.uuid4().hex[:8]
    queue, other_queue = f"poolw_{suffix}", f"poolw_out_{suffix}"
    built = pool_worker_app.create(broker_url, database_url, table_prefix, queue, other_queue, with_outbox,
                                   pool_limit=1)
    if built.outbox is not None:
        built.outbox.ready()
    env = {"TEST_BROKER_URL": broker_url, "TEST_DATABASE_URL": database_url, "TEST_TABLE_PREFIX": table_prefix,
           "TEST_QUEUE": queue, "TEST_OTHER_QUEUE": other_queue, "TEST_WITH_OUTBOX": "1" if with_outbox else "0",
           "TEST_POOL_LIMIT": "1"}
    worker = WorkerProcess("tests.apps.pool_worker_app", env, pool=pool, concurrency=concurrency, queues=[queue],
                           log_path=tmp_path / "worker.log").start()
    try:
        worker.wait_ready()
        for n in range(tasks):
            built.fan_out.delay(n)
        try:
            got = receive(built.app, other_queue, 2 * tasks, timeout=90)
        except AssertionError as missing:
            raise AssertionError(f"{str(missing)[:300]}; the worker's log ends:\n{worker.log()[-4000:]}") from None
        assert sorted(tuple(m.args) for m in got) == [(n, i) for n in range(tasks) for i in range(2)]
        assert worker.log().count("retry: Retry in 0s") == tasks, "every task retried itself once"
        if built.outbox is not None:
            assert unsent_rows(built.outbox.store) == 0, "every stored message was published"
    finally:
        worker.stop()
        if built.outbox is not None:
            drop_store(built.outbox.store)
            built.outbox.engine.dispose()
        purge(built.app, queue, other_queue)
