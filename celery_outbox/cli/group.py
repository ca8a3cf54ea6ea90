"""The ``celery -A proj outbox`` command group, and what its commands share.

No transaction. The app's ``Outbox`` is handed to each command (an error of the library turned into
one line, exit code 1), for the stores ``--tenant`` or ``--all-tenants`` choose (``per_tenant``),
with text made safe for a terminal, JSON naming its store's tenant, and the parameter types of
durations and moments.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import click

from ..core.config import DATABASE_URL_VARIABLE
from ..core.tenancy import current_tenant, using_tenant
from ..errors import OutboxError, UnknownTenant
from ..outbox import Outbox, outbox_of
from ..store import utcnow

_UNPRINTABLE = {"Cc", "Cf", "Zl", "Zp"}  # controls, format characters, line and paragraph separators


def printable(value: Any, newlines: bool = False) -> str:
    """``value`` as text safe for a terminal: control and format characters (ANSI escapes, ``\\r``,
    NUL, bidirectional overrides) written as Python escapes, so text taken from a message cannot move
    the cursor, clear the screen or hide what is printed. ``newlines=True`` keeps line breaks (a
    traceback)."""
    return "".join(
        char if (char == "\n" and newlines) or unicodedata.category(char) not in _UNPRINTABLE
        else char.encode("unicode_escape").decode("ascii")
        for char in str(value)
    )


def with_outbox(command: Callable[..., Any]) -> Callable[..., Any]:
    """Pass the app's ``Outbox`` (installing one when the app module did not) and turn
    library errors into one clean line."""

    @click.pass_context
    @functools.wraps(command)
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        app = ctx.obj.app
        try:
            try:
                box = outbox_of(app)
            except OutboxError:
                box = Outbox(app)
            database_url = ctx.find_root().meta.get(_DATABASE_URL)
            if database_url:
                box.runtime.use_database_url(database_url)
            return command(box, *args, **kwargs)
        except OutboxError as exc:
            raise click.ClickException(printable(exc, newlines=True)) from None

    return wrapper


_DATABASE_URL = "celery_outbox.database_url"  # where the group's --database-url waits for the command
_ALL_TENANTS = "celery_outbox.all_tenants"  # set while a command runs once per store (--all-tenants)


def per_tenant(ids: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``with_outbox``, and the options that choose the stores the command runs for: neither, the
    default store; ``--tenant NAME``, that tenant's (inside ``using_tenant``, which every store the
    command uses follows), a name ``outbox_tenants`` does not know being a usage error (exit code
    2); ``--all-tenants``, the default store and then every tenant's (``each_store``). ``ids`` names
    the command's parameter of row ids, which are one store's own: with ``--all-tenants``, a usage
    error."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @click.option("--tenant", metavar="NAME", default=None,
                      help="Run for this tenant's store (a name of outbox_tenants), not the default one.")
        @click.option("--all-tenants", is_flag=True,
                      help="Run for the default store, then for every tenant's, each under its heading; exit "
                           "code non-zero when any of them failed.")
        @with_outbox
        @functools.wraps(command)
        def run(box: Outbox, *args: Any, tenant: str | None, all_tenants: bool, **kwargs: Any) -> Any:
            if tenant is not None and all_tenants:
                raise click.UsageError("give --tenant NAME or --all-tenants, not both")
            if all_tenants and ids is not None and kwargs.get(ids):
                raise click.UsageError("dead letter ids are those of one store: name it with --tenant, not "
                                       "--all-tenants")
            if all_tenants:
                return each_store(box.runtime.tenants(), lambda: command(box, *args, **kwargs),
                                  as_json=bool(kwargs.get("as_json")))
            _known_tenant(box, tenant)
            with using_tenant(tenant):
                return command(box, *args, **kwargs)

        return run

    return decorate


def _known_tenant(box: Outbox, tenant: str | None) -> None:
    """A usage error naming ``tenant`` when ``outbox_tenants`` does not name it (asked again when
    it is a callable); its store is found as every part finds it, without connecting."""
    if tenant is None:
        return
    try:
        with using_tenant(tenant):
            box.runtime.store  # noqa: B018 - raises UnknownTenant for a name outbox_tenants does not know
    except UnknownTenant as exc:
        raise click.BadParameter(printable(exc), param_hint="'--tenant'") from None


def store_name(tenant: str | None) -> str:
    """How output names a store: ``default store`` or ``tenant NAME``."""
    return "default store" if tenant is None else f"tenant {printable(tenant)}"


def each_store(tenants: list[str], run: Callable[[], Any], as_json: bool = False) -> None:
    """``run()`` for the default store, then for each of ``tenants``, each inside its
    ``using_tenant`` block and under a heading naming it (in JSON, each document names it instead:
    ``echo_json``). A store's failure is reported on stderr, naming the store, and the next store
    runs; the exit code is the highest of the stores' (a check's 2, a store down, over its 1)."""
    click.get_current_context().meta[_ALL_TENANTS] = True
    stores: list[str | None] = [None, *tenants]
    failed: dict[str, int] = {}
    for number, tenant in enumerate(stores):
        if not as_json:
            if number:
                click.echo()
            click.echo(f"== {store_name(tenant)} ==")
        code = _run_for(tenant, run, as_json)
        if code:
            failed[store_name(tenant)] = code
    if failed:
        click.echo(f"Error: {len(failed)} of {len(stores)} stores failed: {', '.join(failed)}", err=True)
        raise SystemExit(max(failed.values()))


def _run_for(tenant: str | None, run: Callable[[], Any], as_json: bool) -> int:
    """``run()`` for ``tenant``'s store, and its exit code: 0, the code it exits with, or that of
    its error (reported, naming the store). A usage error is no store's: it ends the command."""
    try:
        with using_tenant(tenant):
            run()
    except click.UsageError:
        raise
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        _report(tenant, printable(exc.code), as_json)
        return 1
    except click.ClickException as exc:
        _report(tenant, exc.format_message(), as_json)
        return exc.exit_code
    except OutboxError as exc:
        _report(tenant, printable(exc, newlines=True), as_json)
        return 1
    except Exception as exc:  # noqa: BLE001 - one store's failure (a lost connection) does not stop the others
        first = (str(exc).strip().splitlines() or [""])[0]
        _report(tenant, printable(f"{type(exc).__name__}: {first}"), as_json)
        return 1
    return 0


def _report(tenant: str | None, message: str, as_json: bool) -> None:
    """A store's failure: one line on stderr naming the store and, in JSON, a document for it."""
    click.echo(f"Error: {store_name(tenant)}: {message}", err=True)
    if as_json:
        click.echo(json.dumps({"tenant": tenant, "error": message}, sort_keys=True))


def echo_json(document: dict[str, Any]) -> None:
    """Print a command's JSON document, with the tenant of the store it is about (``"tenant"``,
    null for the default store): indented, or on one line per store under ``--all-tenants``."""
    document = {**document, "tenant": current_tenant()}
    if click.get_current_context().meta.get(_ALL_TENANTS):
        click.echo(json.dumps(document, sort_keys=True, default=str))
    else:
        click.echo(json.dumps(document, indent=2, sort_keys=True, default=str))


@click.group(name="outbox")


@click.option("--database-url", default=None, metavar="URL",
              help=f"SQLAlchemy URL of the message store, for this command: over {DATABASE_URL_VARIABLE} "
                   "in the environment, which is over the app's outbox_database_url.")


@click.pass_context


def outbox(ctx: click.Context, database_url: str | None) -> None:
    """celery-outbox: transactional outbox and idempotent inbox."""
    ctx.find_root().meta[_DATABASE_URL] = database_url


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Age(click.ParamType):
    """A duration: ``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1w``."""

    name = "age"

    def convert(self, value: Any, param: Any, ctx: Any) -> timedelta:
        if isinstance(value, timedelta):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(value))
        if not match:
            self.fail(f"{value!r} is not a duration; write e.g. 90s, 15m, 2h, 7d", param, ctx)
        try:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])
        except OverflowError:
            self.fail(f"{value!r} is longer than a timedelta can hold", param, ctx)


class Since(click.ParamType):
    """A moment: a duration back from now (``2h``) or an ISO time (``2026-11-01T12:00``, UTC if naive)."""

    name = "since"

    def convert(self, value: Any, param: Any, ctx: Any) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            return utcnow() - Age().convert(value, param, ctx)
        except OverflowError:
            self.fail(f"{value!r} reaches back before the year 1", param, ctx)
        except click.BadParameter:
            pass
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            self.fail(f"{value!r} is neither a duration (2h, 7d) nor an ISO time (2026-11-01T12:00)", param, ctx)
        return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """Rows as an aligned text table under ``title``, each cell printable."""
    lines = [f"{title}:"]
    if not rows:
        return lines + ["  (empty)"]
    cells = [[printable(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for line in cells:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    return lines
