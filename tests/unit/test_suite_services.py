"""The suite's own plumbing: each pytest-xdist worker's tests take a Redis database of their own."""

from __future__ import annotations

import pytest

from ..services import redis_database_of_this_worker


@pytest.mark.parametrize(("worker", "url", "expected"), [
    (None, "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/15"),
    ("gw0", "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/15"),
    ("gw1", "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/14"),
    ("gw1", "redis://:secret@cache:6380/3", "redis://:secret@cache:6380/2"),
])
def test_each_xdist_worker_takes_the_database_below_the_last(monkeypatch, worker, url, expected):
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert redis_database_of_this_worker(url) == expected


def test_a_worker_with_no_database_left_is_told_to_take_a_higher_one(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    with pytest.raises(RuntimeError, match="no Redis database left for pytest-xdist worker gw1"):
        redis_database_of_this_worker("redis://127.0.0.1:6379/0")
