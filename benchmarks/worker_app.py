"""The app the worker benchmark's processes run (built from BENCH_* environment variables).

One body, eight ways to run it: a plain Celery task (acknowledged before it runs, Celery's
default, and after, with ``acks_late``), three floors (plain tasks writing their inbox row by
hand, the least each ``IdempotentTask`` style and the durable-queue consumer must do: see
``Floor``), an ``IdempotentTask`` in the optimistic and in the eager style, and the plain task
consumed from a durable queue.
``BENCH_BODY`` is ``noop`` or ``write`` (one Core INSERT: through ``self.connection``, in
the claim's transaction, in an ``IdempotentTask``; in its own transaction on a plain
SQLAlchemy engine otherwise, as a Celery user without celery-outbox would write it).
``bench.mark`` records in Redis when a block of messages began and ended, and the CPU spent by
then. With ``BENCH_WITHOUT_NODE=1`` the worker is no node (the node's cost is measured against it).
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import redis
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, insert
from sqlalchemy.engine import Connection

from benchmarks.cpu import mark_reading
from celery_outbox import IdempotentTask, Outbox


def create(broker_url: str, database_url: str, prefix: str, queue: str, durable_queue: str, body: str,
           marks_url: str, **settings: Any) -> tuple[Celery, Outbox, MetaData]:
    app = Celery("bench_worker", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, outbox_database_url=database_url, outbox_table_prefix=prefix,
                    outbox_durable_queues=[durable_queue], worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, **settings)
    outbox = Outbox(app)
    metadata = MetaData()
    effects = Table(f"{prefix}effects", metadata, Column("id", Integer, primary_key=True, autoincrement=True),
                    Column("n", Integer, nullable=False))
    marks = redis.Redis.from_url(marks_url)
    plain_engine = create_engine(database_url)
    inbox = outbox.store.tables.incoming

    def write(connection: Connection, n: int) -> None:  # the body's one write, the same in every variant
        connection.execute(insert(effects).values(n=n))

    def write_alone(n: int) -> None:
        with plain_engine.begin() as conn:
            write(conn, n)

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> None:
        if body == "write":
            write_alone(n)

    @app.task(name="bench.plain_late", shared=False, acks_late=True)
    def plain_late(n: int) -> None:  # acknowledged after it ran, as every IdempotentTask is
        if body == "write":
            write_alone(n)

    floors = Floor(database_url, inbox.name, outbox.store.tables.outgoing.name)

    def floor_delivery(task: Any) -> tuple[str, str, str]:  # message id, task name, queue
        return task.request.id, task.name, task.request.delivery_info.get("routing_key") or ""

    def floor_body(n: int) -> Callable[[Connection], None]:
        return functools.partial(write, n=n) if body == "write" else _nothing

    @app.task(name="bench.floor", bind=True, shared=False, acks_late=True)
    def floor(self, n: int) -> None:
        """The least an inbox claimed in the body's transaction costs: acknowledged after it ran,
        and one more row (the inbox row) in the body's transaction."""
        floors.optimistic(*floor_delivery(self), floor_body(n))

    @app.task(name="bench.floor_eager", bind=True, shared=False, acks_late=True)
    def floor_eager(self, n: int) -> None:
        """The least an inbox claimed before the body costs: the inbox row committed first (not
        waiting for the disk, as the eager claim does), then marked handled in the body's
        transaction."""
        floors.eager(*floor_delivery(self), floor_body(n))

    @app.task(name="bench.floor_durable", bind=True, shared=False, acks_late=True)
    def floor_durable(self, n: int) -> None:
        """The least a plain task consumed from a durable queue costs: its envelope stored and the
        sender's outgoing row acknowledged, committed first (not waiting for the disk), the body
        in its own transaction as the plain task's, then the row marked handled."""
        floors.durable(*floor_delivery(self), self.request, functools.partial(write_alone, n) if body == "write"
                       else _nothing_alone)

    @app.task(base=IdempotentTask, bind=True, name="bench.optimistic", shared=False)
    def optimistic(self, n: int) -> None:
        if body == "write":
            write(self.connection, n)

    @app.task(base=IdempotentTask, bind=True, name="bench.eager", shared=False)
    def eager(self, n: int) -> None:
        if body == "write":
            write(self.connection, n)

    eager.idempotency = "eager"

    @app.task(name="bench.mark", shared=False)
    def mark(key: str) -> None:
        """Record when a block of messages began (``...:start``) or ended, and the CPU spent so far."""
        marks.set(key, mark_reading(key))

    return app, outbox, metadata


class Floor:
    """An inbox by hand, with no library code: the least each style must do, in the fewest round
    trips. One connection per pool process, in autocommit mode, so that the floor sends its own
    ``BEGIN`` and ``COMMIT`` in the round trips of its other statements (a psycopg pipeline, one
    round trip each), with prepared statements. The optimistic style: ``BEGIN`` and the claim in
    one round trip, the body, ``COMMIT`` (a no-op body: two round trips; one write: three). The
    eager style: ``BEGIN``, the claim, ``COMMIT`` (not waiting for the disk) and the body's
    ``BEGIN`` in one round trip, the body, the ``UPDATE`` marking the row handled with ``COMMIT``
    in one more (two and three). A claim that finds the row there already ends the task (a
    duplicate). ``body`` gets the SQLAlchemy connection the transaction is on: the same body
    as every other variant's."""

    COLUMNS = ("message_id", "destination", "task_name", "queue", "status", "owner", "retries", "nesting",
               "replays", "received_at", "claimed_at", "handled_at", "keep_until")

    ENVELOPE = ("exchange", "routing_key", "body", "content_type", "content_encoding", "headers", "properties")

    def __init__(self, database_url: str, inbox: str, outgoing: str):
        self.engine = create_engine(database_url, isolation_level="AUTOCOMMIT", pool_size=1)
        self.claim = (f'INSERT INTO "{inbox}" ({", ".join(self.COLUMNS)}) VALUES ({", ".join(["%s"] * 13)}) '
                      "ON CONFLICT DO NOTHING RETURNING 1")
        columns = (*self.COLUMNS, *self.ENVELOPE)
        self.envelope = (f'WITH claimed AS (INSERT INTO "{inbox}" ({", ".join(columns)}) '
                         f'VALUES ({", ".join(["%s"] * len(columns))}) ON CONFLICT DO NOTHING RETURNING 1), '
                         f'acked AS (DELETE FROM "{outgoing}" WHERE message_id = %s AND send_id = %s '
                         "AND EXISTS (SELECT 1 FROM claimed)) SELECT 1 FROM claimed")
        self.finish = (f"UPDATE \"{inbox}\" SET status = 'handled', handled_at = %s, keep_until = %s "
                       "WHERE message_id = %s AND destination = '' AND status = 'running'")
        self._connections: dict[int, Connection] = {}
        self.close = weakref.finalize(self, _close_own, self._connections)  # or when collected

    def _connection(self) -> Connection:
        """This process's connection, opened after the pool forked it."""
        conn = self._connections.get(os.getpid())
        if conn is None:
            conn = self._connections[os.getpid()] = self.engine.connect()
        return conn

    def _row(self, message_id: str, task_name: str, queue: str, status: str) -> tuple:
        now = datetime.now(timezone.utc)
        handled = status == "handled"
        return (message_id, "", task_name, queue, status, 0, 0, 0, 0, now, now, now if handled else None,
                now + timedelta(days=1) if handled else None)

    def optimistic(self, message_id: str, task_name: str, queue: str, body: Callable[[Connection], None]) -> None:
        conn = self._connection()
        raw = conn.connection.driver_connection
        with raw.pipeline():
            raw.execute("BEGIN")
            claim = raw.execute(self.claim, self._row(message_id, task_name, queue, "handled"), prepare=True)
        if claim.fetchone() is None:  # a duplicate
            raw.execute("ROLLBACK")
            return
        body(conn)
        raw.execute("COMMIT")

    def eager(self, message_id: str, task_name: str, queue: str, body: Callable[[Connection], None]) -> None:
        conn = self._connection()
        raw = conn.connection.driver_connection
        with raw.pipeline():
            raw.execute("BEGIN")
            raw.execute("SET LOCAL synchronous_commit TO OFF")
            claim = raw.execute(self.claim, self._row(message_id, task_name, queue, "running"), prepare=True)
            raw.execute("COMMIT")
            raw.execute("BEGIN")
        if claim.fetchone() is None:  # a duplicate
            raw.execute("ROLLBACK")
            return
        body(conn)
        now = datetime.now(timezone.utc)
        with raw.pipeline():
            finish = raw.execute(self.finish, (now, now + timedelta(days=1), message_id), prepare=True)
            raw.execute("COMMIT")
        if finish.rowcount != 1:
            raise RuntimeError(f"the claim of {message_id} was taken over")

    def durable(self, message_id: str, task_name: str, queue: str, request: Any, body: Callable[[], None]) -> None:
        """The eager floor with what a durable queue adds: the claim carries the message's envelope
        and, in the same statement, deletes the sender's outgoing row, all committed in one round
        trip; the body runs in its own transaction; then the finish. The messages it takes come
        from a plain queue, so the DELETE finds no row to delete: a little less work than the
        library's, whose messages have their row."""
        conn = self._connection()
        raw = conn.connection.driver_connection
        envelope = ("", queue, json.dumps([request.args, request.kwargs, {}]).encode(), "application/json", "utf-8",
                    json.dumps({"id": message_id, "task": task_name, "retries": 0, "root_id": request.root_id}),
                    json.dumps({"correlation_id": message_id, "delivery_info": request.delivery_info}))
        with raw.pipeline():
            raw.execute("BEGIN")
            raw.execute("SET LOCAL synchronous_commit TO OFF")
            claim = raw.execute(self.envelope, (*self._row(message_id, task_name, queue, "running"), *envelope,
                                                message_id, ""), prepare=True)
            raw.execute("COMMIT")
        if claim.fetchone() is None:  # a duplicate
            return
        body()
        now = datetime.now(timezone.utc)
        with raw.pipeline():
            raw.execute("BEGIN")
            finish = raw.execute(self.finish, (now, now + timedelta(days=1), message_id), prepare=True)
            raw.execute("COMMIT")
        if finish.rowcount != 1:
            raise RuntimeError(f"the claim of {message_id} was taken over")


def _nothing(connection: Connection) -> None:
    return None


def _nothing_alone() -> None:
    return None


def _close_own(connections: dict[int, Connection]) -> None:
    """Close this process's floor connection (a forked child's copy of its parent's is not its own)."""
    conn = connections.pop(os.getpid(), None)
    if conn is not None:
        conn.close()


if "BENCH_BROKER_URL" in os.environ:
    app, outbox, metadata = create(
        os.environ["BENCH_BROKER_URL"], os.environ["BENCH_DATABASE_URL"], os.environ["BENCH_PREFIX"],
        os.environ["BENCH_QUEUE"], os.environ["BENCH_DURABLE_QUEUE"], os.environ["BENCH_BODY"],
        os.environ["BENCH_MARKS_URL"])
    if os.environ.get("BENCH_WITHOUT_NODE") == "1":  # the node's cost, measured against a worker that is none
        from celery.signals import worker_ready

        @worker_ready.connect(weak=False)  # after the outbox's receiver: the node it registered stops at once
        def no_node(**_: Any) -> None:
            outbox.node.stop_serving()
