"""``celery -A proj outbox dead-letters list|show|replay|purge``: the store's dead letters.

Transaction boundary: listing and showing read in a short transaction each; replay and purge run
``maintenance.dead_letters``, one transaction per batch of letters. Each runs for the stores
``--tenant`` or ``--all-tenants`` choose (``per_tenant``); ids are one store's, so ``show`` and a
replay by ids take ``--tenant`` only.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Callable

import click

from ..core.tenancy import current_tenant
from ..maintenance.dead_letters import DeadLetterFilter, purge, replay
from ..outbox import Outbox
from ..store import as_utc, utcnow
from ..vocabulary import DeadLetterReason
from .group import Age, Since, outbox, per_tenant, printable, table


def _filters(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--task", help="Only this task name."),
        click.option("--queue", help="Only this queue."),
        click.option("--exception", help="Only this exception type, e.g. ValueError."),
        click.option("--reason", type=click.Choice([reason.value for reason in DeadLetterReason]),
                     help="Only this reason."),
        click.option("--since", type=Since(), help="Failed at or after: a duration back (2h) or an ISO time."),
    ]):
        command = option(command)
    return command


@outbox.group(name="dead-letters")


def dead_letters() -> None:
    """Envelopes that failed for good: list, show, replay, purge."""


@dead_letters.command(name="list")


@_filters


@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)


@click.option("--json", "as_json", is_flag=True, help="Print JSON lines for machines, each naming its tenant.")


@per_tenant()


def list_dead_letters(box: Outbox, task, queue, exception, reason, since, limit: int, as_json: bool) -> None:
    """Dead letters matching the filters, oldest first."""
    store = box.ready().store
    which = DeadLetterFilter(task=task, queue=queue, exception=exception, reason=reason, since=since)
    rows = store.list_dead_letters(which.where(store), limit=limit)
    total = store.count_matching_dead_letters(which.where(store))
    if as_json:
        for row in rows:
            click.echo(json.dumps({**_summary(row), "tenant": current_tenant()}, default=str))
        return
    columns = ["id", "failed_at", "reason", "task", "queue", "message_id", "exception", "replays"]
    click.echo("\n".join(table("dead letters", [_summary(row) for row in rows], columns)))
    if total > len(rows):
        click.echo(f"({len(rows)} of {total} shown; use --limit or filters)")


def _summary(row: Any) -> dict[str, Any]:
    failed_at = as_utc(row.failed_at)
    return {
        "id": row.id, "failed_at": failed_at.isoformat(timespec="seconds") if failed_at else "",
        "reason": row.reason, "task": row.task_name, "queue": row.queue, "message_id": row.message_id,
        "exception": row.exception_type or "", "replays": row.replay_count,
    }


@dead_letters.command(name="show")


@click.argument("dead_letter_id", type=int)


@per_tenant(ids="dead_letter_id")


def show_dead_letter(box: Outbox, dead_letter_id: int) -> None:
    """One dead letter in full: envelope, exception and traceback."""
    row = box.ready().store.get_dead_letter(dead_letter_id)
    if row is None:
        raise click.ClickException(f"no dead letter with id {dead_letter_id}")
    for key in ("id", "message_id", "task_name", "queue", "destination", "reason", "retries", "nesting",
                "replays", "exchange", "routing_key", "content_type", "content_encoding"):
        click.echo(f"{key}: {printable(getattr(row, key))}")
    click.echo(f"failed_at: {as_utc(row.failed_at)}")
    click.echo(f"replay_count: {row.replay_count}  replayed_at: {as_utc(row.replayed_at)}")
    click.echo(f"headers: {printable(row.headers)}")
    body = bytes(row.body or b"")
    text = body.decode(row.content_encoding if row.content_encoding not in (None, "binary") else "utf-8",
                       errors="replace")
    click.echo(f"body ({len(body)} bytes): {printable(text[:4000])}")
    click.echo(f"exception: {printable(row.exception_type)}: {printable(row.exception_message)}")
    if row.traceback:
        click.echo(printable(row.traceback.rstrip(), newlines=True))


@dead_letters.command(name="replay")


@click.argument("dead_letter_ids", type=int, nargs=-1)


@click.option("--all", "replay_all", is_flag=True, help="Replay every dead letter matching the filters.")


@_filters


@per_tenant(ids="dead_letter_ids")


def replay_dead_letters(box: Outbox, dead_letter_ids: tuple[int, ...], replay_all: bool, task, queue, exception,
                        reason, since) -> None:
    """Re-publish dead letters through the outbox as a new attempt of the same task id, routed by the
    task's current route, for the tenant it names. A malformed letter, or one naming a tenant
    outbox_tenants does not know, is refused with its reason and kept (exit code 1)."""
    filters = dict(task=task, queue=queue, exception=exception, reason=reason, since=since)
    if bool(dead_letter_ids) == replay_all:
        raise click.UsageError("give dead letter ids, or --all (with optional filters), not both")
    if dead_letter_ids and any(filters.values()):
        raise click.UsageError("filters go with --all; with ids, the ids say what to replay")
    which = DeadLetterFilter(ids=dead_letter_ids or None, **filters)
    store = box.ready().store
    total = store.count_matching_dead_letters(which.where(store))
    if dead_letter_ids and total < len(set(dead_letter_ids)):
        found = {row.id for row in store.list_dead_letters(which.where(store))}
        missing = ", ".join(str(i) for i in sorted(set(dead_letter_ids) - found))
        raise click.ClickException(f"no dead letter with id {missing}; nothing replayed")
    with click.progressbar(length=total, label="replaying", file=click.get_text_stream("stderr")) as bar:
        replayed = replay(box.publisher, which, progress=bar.update)
    click.echo(f"replayed {len(replayed.message_ids)} dead letter(s)")
    for letter_id, reason in replayed.refused:
        click.echo(f"refused dead letter {letter_id}: {printable(reason)}", err=True)
    if replayed.refused:
        raise SystemExit(1)


@dead_letters.command(name="purge")


@click.option("--older-than", type=Age(), required=True, help="Delete dead letters that failed longer ago (7d).")


@_filters


@per_tenant()


def purge_dead_letters(box: Outbox, older_than: timedelta, task, queue, exception, reason, since) -> None:
    """Delete dead letters older than a duration (and matching the filters)."""
    which = DeadLetterFilter(task=task, queue=queue, exception=exception, reason=reason, since=since,
                             failed_before=utcnow() - older_than)
    store = box.ready().store
    total = store.count_matching_dead_letters(which.where(store))
    with click.progressbar(length=total, label="purging", file=click.get_text_stream("stderr")) as bar:
        deleted = purge(box.runtime, which, progress=bar.update)
    click.echo(f"purged {deleted} dead letter(s)")
