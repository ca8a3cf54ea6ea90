"""The parsers of setting values: each returns the value ``OutboxSettings`` holds, or raises.

No transaction. A parser takes a setting's key and the value it was given; a bad value raises
``ConfigurationError`` naming the setting, the value (secrets masked) and what is allowed.
``config.SETTINGS`` gives each setting its parser; ``config.read_settings`` runs them.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Mapping, TypeVar

from ..errors import ConfigurationError
from ..store.engine import masked_options, safe_url

__all__ = ["boolean", "expected_member_of", "invalid", "mapping", "member_of", "non_negative_number",
           "optional_seconds", "optional_string", "positive_int", "queue_names", "seconds", "shown", "string",
           "table_prefix"]

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_PREFIX_LENGTH = 32  # leaves room for the longest table and index suffix under PostgreSQL's 63 bytes
MAX_SECONDS = 100 * 365 * 86400.0  # a duration added to now stays far inside datetime's range
MAX_FACTOR = 1000.0
MAX_INT = 2**31 - 1  # a PostgreSQL integer: counts and limits are compared with one in SQL

E = TypeVar("E", bound=Enum)


def invalid(key: str, value: Any, allowed: str) -> ConfigurationError:
    return ConfigurationError(f"setting {key} = {shown(key, value)} is not valid: {allowed}")


def shown(key: str, value: Any) -> str:
    """A value as an error shows it: the database URL and the engine options with their secrets masked
    (a value of the wrong type by its type alone, since any of it may be a secret)."""
    name = key.lower()
    if name.endswith("database_url") and isinstance(value, str) and value.strip():
        return repr(safe_url(value))
    if name.endswith("engine_options") and isinstance(value, Mapping):
        return repr(masked_options(value))
    if name.endswith(("database_url", "engine_options")) and not (isinstance(value, str) and not value.strip()):
        return f"<a {type(value).__name__}, not shown>"
    return repr(value)


def string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid(key, value, "expected a non-empty string")
    return value.strip()


def queue_names(key: str, value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)):
        names = list(value)
    else:
        raise invalid(key, value, "expected queue names: a list, a tuple, a set or a comma-separated string")
    result = set()
    for name in names:
        name = getattr(name, "name", name)  # kombu.Queue objects are accepted too
        if not isinstance(name, str) or not name.strip():
            raise invalid(key, value, f"queue name {name!r} must be a non-empty string")
        result.add(name.strip())
    return frozenset(result)


def table_prefix(key: str, value: Any) -> str:
    if not isinstance(value, str) or not IDENTIFIER.match(value) or len(value) > MAX_PREFIX_LENGTH:
        raise invalid(
            key,
            value,
            f"expected an SQL identifier of at most {MAX_PREFIX_LENGTH} characters "
            "(letters, digits and underscores, not starting with a digit)",
        )
    return value


def expected_member_of(values: type[Enum]) -> str:
    """What an error about a value outside the enum ``values`` says is allowed."""
    return "expected one of " + ", ".join(repr(member.value) for member in values)


def member_of(values: type[E]) -> Callable[[str, Any], E]:
    """A parser of a setting whose value is one of the string values of the enum ``values``."""
    def parse(key: str, value: Any) -> E:
        if not isinstance(value, str) or value not in {member.value for member in values}:
            raise invalid(key, value, expected_member_of(values))
        return values(value)

    return parse


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a number or not finite (``inf``, ``NaN``,
    an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def seconds(key: str, value: Any) -> float:
    duration = _finite(value.total_seconds() if isinstance(value, timedelta) else value)
    if duration is None or not 0 < duration <= MAX_SECONDS:
        raise invalid(key, value, f"expected a finite positive number of seconds, at most {MAX_SECONDS:.0f} "
                                  "(100 years), or a datetime.timedelta")
    return duration


def non_negative_number(key: str, value: Any) -> float:
    number = _finite(value)
    if number is None or not 0 <= number <= MAX_FACTOR:
        raise invalid(key, value, f"expected a finite number from 0 to {MAX_FACTOR:.0f}")
    return number


def optional_seconds(key: str, value: Any) -> float | None:
    return None if value is None else seconds(key, value)


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_INT:
        raise invalid(key, value, f"expected a positive whole number, at most {MAX_INT}")
    return value


def optional_port(key: str, value: Any) -> int | None:
    """A TCP port (1 to 65535; a string of digits too, as from an environment variable), or None."""
    if value is None:
        return None
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
        raise invalid(key, value, "expected a TCP port from 1 to 65535")
    return number


def boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
        return value.strip().lower() in {"1", "true", "yes", "on"}
    raise invalid(key, value, "expected True or False")


def optional_string(key: str, value: Any) -> str | None:
    return None if value is None else string(key, value)


def mapping(key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise invalid(key, value, "expected a dict of keyword arguments for sqlalchemy.create_engine")
    return dict(value)


def tenants(key: str, value: Any) -> Any:
    """``outbox_tenants``: a dict of tenant names to database URLs (or ``{"url", "schema"}``), a
    callable that returns one, or the dotted path of such a callable (``"proj.tenants:all"``);
    a dict is checked now, what a callable returns each time it is asked."""
    from .tenancy import read_tenants

    if value is None:
        return {}
    if isinstance(value, str):
        from celery.utils.imports import symbol_by_name

        try:
            value = symbol_by_name(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise invalid(key, value, f"a dotted path to a callable that returns the tenants ({exc})") from None
    if callable(value) and not isinstance(value, Mapping):
        return value
    return read_tenants(key, value)
