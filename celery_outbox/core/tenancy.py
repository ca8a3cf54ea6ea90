"""Tenants: which store the running code uses, and where each tenant's store is.

An application that keeps a database (or a PostgreSQL schema) per tenant names its tenants in
``outbox_tenants``; each tenant has a store of its own (the library's tables in the tenant's
database), and code that runs for a tenant (a unit of work, an inbox attempt, a maintenance pass)
runs inside ``using_tenant(name)``, which every part's ``runtime.store`` follows. No transaction of
its own: the context only says which store the transactions of the code inside it use. Guarantee:
a message sent for a tenant carries its name (``TENANT_HEADER``), so its delivery claims, and its
task's writes, go to that tenant's store; a name ``outbox_tenants`` does not know is an
``UnknownTenant`` error, never a write to another tenant's database (docs/tenancy.md).
"""

from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Union

from ..errors import UnknownTenant

__all__ = ["TENANTS_FOLDER", "TENANT_HEADER", "TenantPlace", "TenantSource", "current_tenant", "read_tenants",
           "tenant_folder", "tenant_of_headers", "using_tenant", "valid_tenant_name"]

#: The message header naming the tenant whose store a message belongs to; absent: the default store
TENANT_HEADER = "celery_outbox_tenant"

#: The folder, inside the default store's archive (and the audit's ``--out``), of the tenants' own
TENANTS_FOLDER = "tenants"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")  # a URI whose query pyarrow reads (s3://b/p?region=...)
_current: ContextVar[str | None] = ContextVar("celery_outbox_tenant", default=None)


@dataclass(frozen=True)
class TenantPlace:
    """Where a tenant's tables are: a database (``url``), and on PostgreSQL optionally a schema of
    it; or a Django database (``django``, its alias), whose ``transaction.atomic(using=...)``
    blocks are that tenant's units of work."""

    url: str = ""
    schema: str | None = None
    django: str | None = None


#: ``outbox_tenants``: the tenants by name, or a callable that returns them (asked again for a name
#: it did not return before, so tenants can be added while processes run)
TenantSource = Union[Mapping[str, TenantPlace], Callable[[], Mapping[str, Any]]]


def valid_tenant_name(name: Any) -> bool:
    """A tenant name is 1 to 63 letters, digits, ``_``, ``.`` or ``-``, starting with a letter or digit."""
    return isinstance(name, str) and _NAME.match(name) is not None


def current_tenant() -> str | None:
    """The tenant the running code works for; None: the default store."""
    return _current.get()


@contextlib.contextmanager
def using_tenant(name: str | None) -> Iterator[str | None]:
    """Run the block for tenant ``name`` (None: the default store): ``runtime.store`` inside it is
    that tenant's, and the messages it sends carry its name."""
    if name is not None and not valid_tenant_name(name):
        raise UnknownTenant(name, "it is not a tenant name (1 to 63 letters, digits, '_', '.' or '-')")
    token = _current.set(name)
    try:
        yield name
    finally:
        _current.reset(token)


def tenant_folder(root: str, tenant: str) -> str:
    """Where ``tenant``'s own files are, given the default store's folder ``root`` (a path or a URI):
    ``<root>/tenants/<tenant>``, before a URI's query. Each tenant's cleanup archives there, under
    ``outbox_archive_path``, and the tenant's audit writes there, under ``--out``; the
    default store's audit reads only its kinds' folders (``incoming/``, ``sent/``, ``dead_letters/``),
    never ``tenants/``."""
    if not valid_tenant_name(tenant):
        raise UnknownTenant(tenant, "it is not a tenant name (1 to 63 letters, digits, '_', '.' or '-')")
    base, query = root, ""
    if _URI.match(root) and not root.lower().startswith("file:"):
        base, mark, rest = root.partition("?")
        query = mark + rest
    return f"{base.rstrip('/')}/{TENANTS_FOLDER}/{tenant}{query}"


def tenant_of_headers(headers: Mapping[str, Any] | None) -> str | None:
    """The tenant a message names in its headers (``TENANT_HEADER``), or None."""
    if not headers:
        return None
    value = headers.get(TENANT_HEADER)
    return None if value in (None, "") else value


def read_tenants(key: str, value: Any) -> Mapping[str, TenantPlace]:
    """``outbox_tenants`` as a mapping of names to places: each value a database URL or a dict with
    ``url`` and optionally ``schema`` (PostgreSQL); a ``ConfigurationError`` names a bad entry."""
    from ..errors import ConfigurationError

    if not isinstance(value, Mapping):
        raise ConfigurationError(f"setting {key} must be a dict of tenant names to database URLs (or a callable "
                                 f"that returns one), not a {type(value).__name__}")
    places: dict[str, TenantPlace] = {}
    for name, place in value.items():
        if not valid_tenant_name(name):
            raise ConfigurationError(f"setting {key}: {name!r} is not a tenant name (1 to 63 letters, digits, "
                                     "'_', '.' or '-', starting with a letter or digit)")
        if isinstance(place, TenantPlace):
            places[name] = place
        elif isinstance(place, str) and place.strip():
            places[name] = TenantPlace(place.strip())
        elif isinstance(place, Mapping) and set(place) == {"django"} and isinstance(place["django"], str):
            places[name] = TenantPlace(django=place["django"])
        elif isinstance(place, Mapping) and isinstance(place.get("url"), str) and set(place) <= {"url", "schema"}:
            schema = place.get("schema")
            if schema is not None and not (isinstance(schema, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$",
                                                                                schema)):
                raise ConfigurationError(f"setting {key}: tenant {name!r} names schema {schema!r}, which is not an "
                                         "SQL identifier")
            places[name] = TenantPlace(place["url"].strip(), schema)
        else:
            raise ConfigurationError(f"setting {key}: tenant {name!r} must map to a database URL, to "
                                     "{'url': ..., 'schema': ...} or to {'django': <a Django database alias>}")
    return places
