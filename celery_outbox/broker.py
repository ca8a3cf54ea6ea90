"""Talking to the broker without hanging on it: a quick reachability check, its error types."""

from __future__ import annotations

from typing import Any

from kombu.exceptions import OperationalError as KombuOperationalError

__all__ = ["connection_errors", "connect_quickly"]


def connection_errors(connection: Any) -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the broker cannot be reached", as opposed to "this message is bad"."""
    return tuple(connection.connection_errors) + (OSError, KombuOperationalError)


def connect_quickly(connection: Any) -> str | None:
    """Connect with one attempt and no back-off; the reason when the broker does not answer."""
    try:
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, interval_max=0)
    except connection_errors(connection) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
