"""``celery -A proj outbox ...``: schema and operations commands.

Each command calls the same ``Outbox`` method that beat or start-up calls; this
module only parses arguments and prints. Errors of the library (a bad setting, a
database that cannot be reached) end the command with one line, exit code 1.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import click

from .errors import OutboxError
from .outbox import Outbox, outbox_of

__all__ = ["outbox"]


def _with_outbox(command: Callable[..., Any]) -> Callable[..., Any]:
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
            return command(box, *args, **kwargs)
        except OutboxError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group(name="outbox")
def outbox() -> None:
    """celery-outbox: transactional outbox and idempotent inbox."""


@outbox.command()
@_with_outbox
def migrate(box: Outbox) -> None:
    """Create or upgrade the outbox tables (idempotent, safe to run concurrently)."""
    result = box.migrate()
    created = ", ".join(result.created_tables) or "none"
    click.echo(f"store: {box.store.describe()}")
    click.echo(f"created tables: {created}")
    click.echo(f"schema version: {result.version_before} -> {result.version_after}")


@outbox.command()
@click.option("--max-batches", type=click.IntRange(min=1), default=None,
              help="Stop after this many batches (default: outbox_max_batches_per_run).")
@_with_outbox
def relay(box: Outbox, max_batches: int | None) -> None:
    """Publish outgoing rows that were committed but not published (one pass)."""
    result = box.relay(max_batches)
    click.echo(str(result))
    if result.broker_error:
        raise SystemExit(1)


@outbox.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@_with_outbox
def status(box: Outbox, as_json: bool) -> None:
    """Row counts by status and destination, oldest pending age, live nodes."""
    report = box.status()
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    click.echo(format_status(report))


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = [f"{title}:"]
    if not rows:
        return lines + ["  (empty)"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        lines.append("  " + "  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))
    return lines


def _age(seconds: float | None) -> str:
    return "none pending" if seconds is None else f"{seconds:.1f}s"


def format_status(report: dict[str, Any]) -> str:
    lines = [f"store: {report['store']}"]
    lines += _table("incoming (inbox)", report["incoming"], ["status", "queue", "count"])
    lines += _table("outgoing (outbox)", report["outgoing"], ["status", "destination", "count"])
    lines += _table("dead letters", report["dead_letters"], ["reason", "task", "count"])
    lines.append(f"oldest pending outgoing: {_age(report['oldest_pending_outgoing_age_seconds'])}")
    lines.append(f"oldest running incoming: {_age(report['oldest_running_incoming_age_seconds'])}")
    lines += _table("nodes", report["nodes"], ["id", "name", "pid", "heartbeat_age_seconds", "stale_checks"])
    return "\n".join(lines)
