"""Fixtures of the demos' tests."""

from __future__ import annotations

import pytest

from ..services import require


@pytest.fixture
def own_database():
    """A PostgreSQL database of its own, dropped afterwards."""
    import uuid

    import psycopg

    url = require("postgres")
    name = f"demo_{uuid.uuid4().hex[:8]}"
    admin = url.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield url.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
