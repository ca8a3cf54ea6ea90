"""Session events for units of work: each Session's transaction events reach its unit of work.

A sessionmaker listened to once (``listen_to_sessions(maker)``, with ``info=session_info()``)
covers all its Sessions; a Session of the caller's own is listened to when a unit of work first
joins it. Transaction boundary: the Session's; the handlers are the unit of work's methods
(``unit_of_work.UnitOfWork``). A unit of work that stores its durable messages with the COMMIT
waits for its connection's ``commit`` event (``wait_for_commit``), listened to on that connection
alone: a listener on the engine would make SQLAlchemy dispatch every event of every connection.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

__all__ = ["LISTENED_KEY", "UNIT_OF_WORK_KEY", "listen_to_sessions", "session_info", "wait_for_commit"]

UNIT_OF_WORK_KEY = "celery_outbox.unit_of_work"
LISTENED_KEY = "celery_outbox.listened"  # the session's events already reach its unit of work

# connection (a checkout's own object, never reused) -> the unit of work that waits for its commit,
# None once it committed or rolled back (a key: the connection is listened to); not the connection's
# ``info``, which outlives the checkout and cannot be read once it is invalidated
_waiting_for_commit: weakref.WeakKeyDictionary[Connection, Any] = weakref.WeakKeyDictionary()

_EVENT_HANDLERS = {
    "after_transaction_create": "_on_transaction_create",
    "after_transaction_end": "_on_transaction_end",
    "after_soft_rollback": "_on_soft_rollback",
    "before_commit": "_before_commit",
    "after_commit": "_after_commit",
}


def listen_to_sessions(target: Any) -> None:
    """Deliver the session events of ``target`` (one Session, or a sessionmaker: all its Sessions,
    registered once instead of per Session) to the unit of work in each Session's ``info``."""
    for name, handler in _EVENT_HANDLERS.items():
        event.listen(target, name, _dispatcher(handler))


def wait_for_commit(connection: Connection, uow: Any) -> None:
    """Call ``uow._at_connection_commit(connection)`` once, when ``connection`` commits, unless it
    rolls back first. The ``commit`` event comes after the Session's last flush, just before the
    COMMIT is sent. The listeners are the connection's own (a checkout's object, never reused), so
    no other connection of the engine dispatches events for them."""
    if connection not in _waiting_for_commit:  # not listened to yet
        event.listen(connection, "commit", _at_commit)
        event.listen(connection, "rollback", _at_rollback)
    _waiting_for_commit[connection] = uow


def _at_commit(connection: Connection) -> None:
    uow = _waiting_for_commit.get(connection)
    if uow is not None:
        _waiting_for_commit[connection] = None  # once
        uow._at_connection_commit(connection)


def _at_rollback(connection: Connection) -> None:
    _waiting_for_commit[connection] = None


def session_info() -> dict[str, Any]:
    """The ``info`` of a sessionmaker whose sessions ``listen_to_sessions`` already covers."""
    return {LISTENED_KEY: True}


def _dispatcher(handler: str) -> Callable[..., None]:
    def dispatch(session: Session, *args: Any) -> None:
        uow = session.info.get(UNIT_OF_WORK_KEY)
        if uow is not None:
            getattr(uow, handler)(session, *args)

    return dispatch
