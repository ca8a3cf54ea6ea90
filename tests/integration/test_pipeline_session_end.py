"""The store's libpq pipelines (``store.pipeline``) when the server ends the session mid-pipeline,
as a restart or ``pg_terminate_backend`` does: the server sends a FATAL error and never the
pipeline's Sync. The exchange raises ``psycopg.OperationalError`` with the server's message, as a
connection lost does (the store then drops the connection and reports the store unavailable),
instead of waiting for a Sync. libpq 16 (psycopg 3.1's wheels) may then give empty results
without end, with the connection still marked good: that raises the same, where it spun."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from celery_outbox.store import pipeline

psycopg = pytest.importorskip("psycopg")


def connect(postgres_url: str) -> Any:
    return psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=5)


def test_a_session_ended_mid_pipeline_raises_the_servers_fatal_error(postgres_url):
    conn = connect(postgres_url)
    started = threading.Event()

    def terminate() -> None:
        started.wait(10)
        with connect(postgres_url) as other:
            other.autocommit = True
            other.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))

    def send(pgconn: Any) -> None:
        pgconn.send_query_params(b"BEGIN", None)
        pgconn.send_query_params(b"SELECT pg_sleep(30)", None)
        pgconn.send_query_params(b"COMMIT", None)
        started.set()

    killer = threading.Thread(target=terminate)
    killer.start()
    try:
        with pytest.raises(psycopg.OperationalError, match="terminating connection due to administrator command"):
            pipeline.pipeline_exchange(conn, send)
        assert conn.pgconn.status == psycopg.pq.ConnStatus.BAD, "callers see the connection lost"
    finally:
        killer.join(10)
        conn.close()


class EndlessEmptyResults:
    """A libpq connection as libpq 16 leaves one after the session ended mid-pipeline: not busy,
    marked good, and empty results (``get_result`` None) without end."""

    status = 0  # ConnStatus.OK
    error_message = b"server closed the connection unexpectedly"
    calls = 0

    def finish(self) -> None:
        self.status = 1  # ConnStatus.BAD

    def is_busy(self) -> bool:
        return False

    def get_result(self) -> None:
        self.calls += 1
        assert self.calls < 1000, "the results are read without end"
        return None


def test_empty_results_without_end_raise_instead_of_spinning():
    pgconn = EndlessEmptyResults()
    with pytest.raises(psycopg.OperationalError, match="server closed the connection unexpectedly"):
        pipeline._pipeline_results(pgconn)
    assert pgconn.calls == 2, "two empty results in a row: no Sync will come"
    assert pgconn.status == 1, "the connection is closed: callers see it lost"


def test_a_healthy_pipeline_returns_each_querys_last_result():
    """BEGIN, an INSERT that fails, the COMMIT aborted, then the Sync: no empty results in a row."""
    ok, failed, aborted = (SimpleNamespace(status=status, error_message=b"", error_field=lambda _field: b"ERROR")
                           for status in (1, 7, 11))
    sync = SimpleNamespace(status=10)
    stream = iter([ok, None, failed, None, aborted, None, sync])
    pgconn = SimpleNamespace(is_busy=lambda: False, get_result=lambda: next(stream), status=0, error_message=b"")
    assert pipeline._pipeline_results(pgconn) == [ok, failed, aborted]
