"""procrastinate's side of the peers benchmark: its app, its jobs, and its worker's process.

``create`` builds the app on one PostgreSQL schema of its own (``search_path``: the schema, then
``public``, where the body's table is). Two tasks: ``bench.peer_write``, the body, an async job
(procrastinate's documented kind for a worker with concurrency) writing one row, the same
``INSERT`` of one integer the worker benchmark's body makes, in its own transaction on a
connection of procrastinate's own pool; and ``bench.peer_mark``, which records in Redis when a
block of jobs began and ended and the CPU spent by then, as ``benchmarks.worker_app``'s mark does
for Celery's workers.

``python -m benchmarks.peers_procrastinate`` (with the BENCH_* environment variables) runs one
worker, ``concurrency`` jobs at a time, until the queue is empty (``wait=False``), all else left
at procrastinate's defaults.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis

from benchmarks.cpu import mark_reading

CONCURRENCY = 2


def conninfo(dsn: str, schema: str) -> str:
    """A libpq connection string for ``dsn`` whose ``search_path`` is ``schema``, then ``public``."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, options=f"-c search_path={schema},public")


def create(dsn: str, schema: str, effects: str, marks_url: str, sync: bool = False) -> Any:
    """procrastinate's app on ``schema`` of ``dsn``; ``sync``: with its synchronous connector (what a
    web process that defers jobs in its own transactions uses)."""
    import procrastinate

    connector = (procrastinate.SyncPsycopgConnector if sync else procrastinate.PsycopgConnector)(
        conninfo=conninfo(dsn, schema))
    app = procrastinate.App(connector=connector)
    marks = redis.Redis.from_url(marks_url)
    insert = f'INSERT INTO "{effects}" (n) VALUES (%s)'

    @app.task(name="bench.peer_write")
    async def peer_write(n: int) -> None:
        async with app.connector.pool.connection() as connection:  # committed when given back
            await connection.execute(insert, (n,))

    @app.task(name="bench.peer_mark")
    async def peer_mark(key: str) -> None:
        marks.set(key, mark_reading(key))

    return app


async def _work(app: Any) -> None:
    async with app.open_async():
        await app.run_worker_async(concurrency=CONCURRENCY, wait=False)


if __name__ == "__main__":
    asyncio.run(_work(create(os.environ["BENCH_DSN"], os.environ["BENCH_SCHEMA"], os.environ["BENCH_EFFECTS"],
                             os.environ["BENCH_MARKS_URL"])))
