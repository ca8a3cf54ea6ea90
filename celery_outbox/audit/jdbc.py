"""The live tables' address: a JDBC URL and the driver's connection properties, checked before Spark.

No transaction: it parses a ``jdbc:postgresql://`` URL or an SQLAlchemy PostgreSQL URL and connects
to nothing. A malformed URL is an ``AuditInputError`` naming it with its password masked.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from celery_outbox.audit.options import AuditInputError
from celery_outbox.store.engine import safe_url

__all__ = ["jdbc_url_of"]

# libpq connection parameters and the PostgreSQL JDBC driver's property for each
_JDBC_PROPERTIES = {"user": "user", "password": "password", "sslmode": "sslmode", "sslrootcert": "sslrootcert",
                    "sslcert": "sslcert", "sslkey": "sslkey", "sslpassword": "sslpassword",
                    "application_name": "ApplicationName", "connect_timeout": "connectTimeout",
                    "options": "options"}


def jdbc_url_of(url: str) -> tuple[str, dict[str, str]]:
    """A JDBC URL and connection properties from a JDBC URL or an SQLAlchemy PostgreSQL URL.

    The SQLAlchemy URL's user, password and query parameters (TLS: ``sslmode``, ``sslrootcert``,
    ``sslcert``, ``sslkey``, ``sslpassword``...) become properties, so the JDBC URL holds no secret;
    a parameter JDBC cannot carry is refused, never dropped (a dropped ``sslmode`` would connect
    without TLS)."""
    properties = {"driver": "org.postgresql.Driver"}
    if url.startswith("jdbc:"):
        _check_jdbc(url)
        return url, properties
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:  # the errors name no part of the URL: an unparseable one may hold its password anywhere
        parsed = make_url(url)
    except ArgumentError:
        raise AuditInputError("--jdbc-url is not a database URL: give jdbc:postgresql://host:port/database "
                              "or postgresql://user@host:port/database") from None
    except ValueError:
        raise AuditInputError("--jdbc-url has a port that is not a number") from None
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise AuditInputError(f"--jdbc-url {safe_url(parsed)}: port {parsed.port} is out of range")
    if parsed.get_backend_name() != "postgresql":
        raise AuditInputError(f"--jdbc-url must name PostgreSQL, not {parsed.get_backend_name()!r}")
    unsupported = sorted(name for name in parsed.query if name not in _JDBC_PROPERTIES)
    repeated = sorted(name for name, value in parsed.query.items() if not isinstance(value, str))
    if unsupported or repeated:
        raise AuditInputError(
            f"--jdbc-url {safe_url(parsed)}: the connection parameter(s) {', '.join(unsupported + repeated)} "
            "cannot be carried into a JDBC URL; give a jdbc:postgresql:// URL with the equivalent driver "
            "properties instead")
    if parsed.username:
        properties["user"] = parsed.username
    if parsed.password:
        properties["password"] = str(parsed.password)
    for name, value in parsed.query.items():
        properties[_JDBC_PROPERTIES[name]] = value
    return f"jdbc:postgresql://{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database}", properties


def _check_jdbc(url: str) -> None:
    """A JDBC URL the PostgreSQL driver can read: ``jdbc:postgresql:`` then a database, or
    ``//host[:port]/database``. Named without its query, which may hold a password."""
    shown = url.split("?")[0]
    if not url.startswith("jdbc:postgresql:"):
        raise AuditInputError(f"--jdbc-url {shown} is not a PostgreSQL JDBC URL "
                              "(jdbc:postgresql://host:port/database)")
    rest = url[len("jdbc:postgresql:"):]
    if rest.startswith("//"):
        try:
            _ = urlsplit(rest).port  # reading the port parses it
        except ValueError as exc:
            raise AuditInputError(f"--jdbc-url {shown}: {str(exc).lower()}") from None


