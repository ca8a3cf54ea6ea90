"""SQLite's errors are told apart by their result code on every Python the library runs on: from
3.11 the driver's error carries it, before only SQLite's text does (an error built here carries
no code, as Python 3.10's do)."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError, OperationalError

from celery_outbox.store import is_lock_timeout, is_unique_violation
from celery_outbox.store.outage import is_outage
from celery_outbox.store.sqlite_codes import SqliteCode, sqlite_code


@pytest.mark.parametrize("error, code", [
    (sqlite3.OperationalError("database is locked"), SqliteCode.BUSY),
    (sqlite3.OperationalError("database table is locked"), SqliteCode.LOCKED),
    (sqlite3.OperationalError("disk I/O error"), SqliteCode.IOERR),
    (sqlite3.OperationalError("database or disk is full"), SqliteCode.FULL),
    (sqlite3.OperationalError("unable to open database file"), SqliteCode.CANTOPEN),
    (sqlite3.IntegrityError("UNIQUE constraint failed: t_incoming.message_id"), SqliteCode.CONSTRAINT_UNIQUE),
    (sqlite3.OperationalError("no such table: t_incoming"), None),
    (ValueError("database is locked"), None),
])
def test_the_code_of_an_error_that_carries_only_sqlites_text(error, code):
    assert sqlite_code(error) == code


def test_the_code_an_error_carries_comes_first(tmp_path):
    """A real driver's error (Python 3.11 and later): its extended code, as SQLite gave it."""
    engine = create_engine(f"sqlite:///{tmp_path / 'codes.sqlite3'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT UNIQUE)"))
        conn.execute(text("INSERT INTO t VALUES (1, 'a')"))
    for statement, expected in (("INSERT INTO t VALUES (1, 'b')", SqliteCode.CONSTRAINT_PRIMARYKEY),
                                ("INSERT INTO t VALUES (2, 'a')", SqliteCode.CONSTRAINT_UNIQUE)):
        with pytest.raises(IntegrityError) as raised, engine.begin() as conn:
            conn.execute(text(statement))
        assert is_unique_violation(raised.value)
        if hasattr(raised.value.orig, "sqlite_errorcode"):
            assert sqlite_code(raised.value.orig) == expected
    engine.dispose()


@pytest.mark.parametrize("driver_error, unique, lock_timeout, outage", [
    (sqlite3.IntegrityError("UNIQUE constraint failed: t_incoming.message_id"), True, False, False),
    (sqlite3.OperationalError("database is locked"), False, True, True),
    (sqlite3.OperationalError("disk I/O error"), False, False, True),
    (sqlite3.OperationalError("no such table: t_incoming"), False, False, False),  # not an outage: a wrong schema
])
def test_the_stores_judgement_of_an_error_without_a_code(driver_error, unique, lock_timeout, outage):
    wrapper = IntegrityError if isinstance(driver_error, sqlite3.IntegrityError) else OperationalError
    error = wrapper("INSERT INTO t_incoming ...", None, driver_error)
    assert (is_unique_violation(error), is_lock_timeout(error), is_outage(error)) == (unique, lock_timeout, outage)
