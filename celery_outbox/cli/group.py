"""The ``celery -A proj outbox`` command group, and what its commands share.

No transaction. The app's ``Outbox`` is handed to each command (an error of the library turned into
one line, exit code 1), with text made safe for a terminal and the parameter types of durations
and moments.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import click

from ..core.config import DATABASE_URL_VARIABLE
from ..errors import OutboxError
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
