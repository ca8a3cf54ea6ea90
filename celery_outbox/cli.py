"""``celery -A proj outbox ...``: schema and operations commands.

The maintenance commands call the same ``Outbox`` methods that beat or start-up calls;
the dead-letter commands read the store and call ``deadletters.replay`` and ``purge`` with
the Outbox's publisher and runtime; this module only parses arguments and prints. Errors
of the library (a bad setting, a database that cannot be reached) end the command with
one line, exit code 1.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import unicodedata
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import click

from .core.config import DATABASE_URL_VARIABLE
from .errors import OutboxError
from .maintenance.dead_letters import DeadLetterFilter, purge, replay
from .monitoring.health import CheckExit, Failure, Thresholds, failed_conditions, store_down
from .outbox import Outbox, outbox_of
from .store import as_utc, utcnow
from .vocabulary import DeadLetterReason

__all__ = ["outbox", "printable"]

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
    click.echo(printable(result, newlines=True))
    if result.broker_error:
        raise SystemExit(1)


def _maintenance_pass(command: Callable[..., Any]) -> Callable[..., Any]:
    """Options and output of a command that runs one maintenance pass and reports it."""

    @outbox.command(name=command.__name__, help=command.__doc__)
    @click.option("--max-batches", type=click.IntRange(min=1), default=None,
                  help="Batches per step (default: outbox_max_batches_per_run).")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
    @_with_outbox
    def run(box: Outbox, max_batches: int | None, as_json: bool) -> None:
        result = command(box, max_batches)
        text = json.dumps(result.as_dict(), indent=2, sort_keys=True) if as_json else printable(result, newlines=True)
        click.echo(text)
        if result.as_dict().get("broker_error"):
            raise SystemExit(1)

    return run


@_maintenance_pass
def recover(box: Outbox, max_batches: int | None):
    """One recover pass, as beat runs it: dead nodes, released claims, relay, redelivery, stranded envelopes.
    Exit code 1 when the broker is unreachable."""
    return box.recover(max_batches)


@_maintenance_pass
def cleanup(box: Outbox, max_batches: int | None):
    """One cleanup pass, as beat runs it: expired inbox rows, old dead letters (with a retention)
    and, with an archiver, the records of sent messages."""
    return box.cleanup(max_batches)


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


@outbox.command()
@click.option("--max-pending-age", type=Age(), default="5m", show_default=True,
              help="Fail when the oldest due outgoing message not sent yet is older.")
@click.option("--max-dead-letters", type=click.IntRange(min=0), default=0, show_default=True,
              help="Fail when more dead letters than this arrived within --window.")
@click.option("--window", type=Age(), default="1h", show_default=True, help="The window of --max-dead-letters.")
@click.option("--stuck-after", type=Age(), default="1h", show_default=True,
              help="A due outgoing message not sent, or a running claim, older than this is stuck.")
@click.option("--max-stuck", type=click.IntRange(min=0), default=0, show_default=True,
              help="Fail when more messages than this are stuck.")
@click.option("--node-stale-after", type=Age(), default=None,
              help="Fail for a node without a heartbeat for longer [default: outbox_node_stale_after].")
@click.option("--min-nodes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Fail when fewer nodes than this beat.")
@click.option("--timeout", type=Age(), default="10s", show_default=True,
              help="Fail when the store does not answer within this (a locked table: VACUUM FULL, a migration).")
@click.option("--liveness", is_flag=True,
              help="Only whether this process reaches the store (a liveness probe): no threshold, no table read.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@_with_outbox
def check(box: Outbox, max_pending_age: timedelta, max_dead_letters: int, window: timedelta, stuck_after: timedelta,
          max_stuck: int, node_stale_after: timedelta | None, min_nodes: int, timeout: timedelta,
          liveness: bool, as_json: bool) -> None:
    """One line per failed condition, when the outbox needs a human: for a probe or a cron alert.
    Exit 0 when all hold, 1 when a threshold is crossed, 2 when the store does not answer."""
    thresholds = Thresholds(
        max_pending_age=max_pending_age.total_seconds(), max_dead_letters=max_dead_letters, max_stuck=max_stuck,
        node_stale_after=(node_stale_after.total_seconds() if node_stale_after is not None
                          else box.settings.node_stale_after),
        min_nodes=min_nodes,
    )
    seconds = timeout.total_seconds()
    if liveness:
        failures = _within(seconds, lambda: _reached(box))
    else:
        failures = _within(seconds, lambda: failed_conditions(
            box.status(stuck_after=stuck_after.total_seconds(), recent=window.total_seconds(), timeout=seconds),
            thresholds))
    if as_json:
        click.echo(json.dumps({"ok": not failures, "failures": [f.as_dict() for f in failures]}, indent=2))
    else:
        for failure in failures:
            click.echo(f"FAIL {failure.condition.value}: {printable(failure.message)}")
        if not failures:
            click.echo("OK")
    if failures:
        raise SystemExit(CheckExit.of(failures))


def _reached(box: Outbox) -> list[Failure]:
    """No failure once the store answered a statement that reads no table: a table locked by
    ``VACUUM FULL`` or a migration is no reason to restart the process."""
    box.runtime.store.ping()
    return []


def _within(seconds: float, read: Callable[[], list[Failure]]) -> list[Failure]:
    """``read()``'s failures, or the store's failure when it raises or has not answered within
    ``seconds`` (connecting, getting ready, reading: whatever waits). It runs in a daemon thread,
    which a process that exits leaves behind; the status query itself gives up within the same
    time on the server (``Store.status(timeout=...)``)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(read())
        except Exception as exc:  # noqa: BLE001 - a store that does not answer is the first failed condition
            outcome.append([store_down(exc, seconds)])

    reader = threading.Thread(target=run, name="celery-outbox-check", daemon=True)
    reader.start()
    reader.join(seconds + 1)  # the server's own timeout first, when the status query is what waits
    return outcome[0] if outcome else [store_down(TimeoutError(f"no answer within {seconds:g} s"), seconds)]


@outbox.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True,
              help="The address to listen on; 0.0.0.0 for every interface.")
@click.option("--stuck-after", type=Age(), default="1h", show_default=True,
              help="A due outgoing message not sent, or a running claim, older than this counts as stuck.")
@_with_outbox
def metrics(box: Outbox, port: int, address: str, stuck_after: timedelta) -> None:
    """Serve the store's gauges for Prometheus on /metrics until stopped (with PROMETHEUS_MULTIPROC_DIR
    set, also the counters of the workers sharing that folder)."""
    from .monitoring.metrics import serve

    # no ready() first: a store that is down is what store_up 0 reports, scrape after scrape
    serve(lambda: box.status(stuck_after=stuck_after.total_seconds()), port, address)
    click.echo(f"celery-outbox metrics on http://{address}:{port}/metrics (Ctrl-C stops)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = [f"{title}:"]
    if not rows:
        return lines + ["  (empty)"]
    cells = [[printable(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for line in cells:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    return lines


def _age(seconds: float | None) -> str:
    return "none pending" if seconds is None else f"{seconds:.1f}s"


def format_status(report: dict[str, Any]) -> str:
    lines = [f"store: {report['store']}"]
    lines += _table("incoming (inbox)", report["incoming"], ["status", "queue", "count"])
    lines += _table("outgoing (outbox)", report["outgoing"], ["status", "destination", "count"])
    lines += _table("dead letters", report["dead_letters"], ["reason", "task", "count"])
    lines.append(f"duplicates discarded: {report['duplicates_discarded']}, "
                 f"messages recovered: {report['messages_recovered']}")
    lines.append(f"oldest pending outgoing: {_age(report['oldest_pending_outgoing_age_seconds'])}")
    lines.append(f"oldest running incoming: {_age(report['oldest_running_incoming_age_seconds'])}")
    lines += _table("nodes", report["nodes"], ["id", "name", "pid", "heartbeat_age_seconds", "stale_checks"])
    return "\n".join(lines)


# -- dead letters ----------------------------------------------------------------------------------

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
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines for machines.")
@_with_outbox
def list_dead_letters(box: Outbox, task, queue, exception, reason, since, limit: int, as_json: bool) -> None:
    """Dead letters matching the filters, oldest first."""
    store = box.ready().store
    which = DeadLetterFilter(task=task, queue=queue, exception=exception, reason=reason, since=since)
    rows = store.list_dead_letters(which.where(store), limit=limit)
    total = store.count_matching_dead_letters(which.where(store))
    if as_json:
        for row in rows:
            click.echo(json.dumps(_summary(row), default=str))
        return
    columns = ["id", "failed_at", "reason", "task", "queue", "message_id", "exception", "replays"]
    click.echo("\n".join(_table("dead letters", [_summary(row) for row in rows], columns)))
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
@_with_outbox
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
@_with_outbox
def replay_dead_letters(box: Outbox, dead_letter_ids: tuple[int, ...], replay_all: bool, task, queue, exception,
                        reason, since) -> None:
    """Re-publish dead letters through the outbox as a new attempt of the same task id, routed by the
    task's current route. A malformed letter is refused with its reason (exit code 1)."""
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
@_with_outbox
def purge_dead_letters(box: Outbox, older_than: timedelta, task, queue, exception, reason, since) -> None:
    """Delete dead letters older than a duration (and matching the filters)."""
    which = DeadLetterFilter(task=task, queue=queue, exception=exception, reason=reason, since=since,
                             failed_before=utcnow() - older_than)
    store = box.ready().store
    total = store.count_matching_dead_letters(which.where(store))
    with click.progressbar(length=total, label="purging", file=click.get_text_stream("stderr")) as bar:
        deleted = purge(box.runtime, which, progress=bar.update)
    click.echo(f"purged {deleted} dead letter(s)")


# -- the delivery audit ----------------------------------------------------------------------------


@outbox.command()
@click.option("--archive", help="The archive cleanup writes (default: outbox_archive_path); a path or a URI.")
@click.option("--out", required=True, help="Folder (a path or a URI) for summary.json, report.html and "
              "aggregates/.")
@click.option("--jdbc-url", help="Also read the live tables (jdbc:postgresql:// or postgresql:// URL); "
              "'store' uses outbox_database_url.")
@click.option("--jdbc-jar", help="The PostgreSQL JDBC driver jar (default /usr/share/java/postgresql.jar).")
@click.option("--grace", type=Age(), default="1h", show_default=True,
              help="A sent message not handled after this long is lost.")
@click.option("--late-after", type=Age(), default="60s", show_default=True, help="Sent to handled beyond this is late.")
@click.option("--stuck-after", type=Age(), default="1h", show_default=True, help="A live row waiting longer is stuck.")
@click.option("--master", default="local[*]", show_default=True,
              help="Spark master; on a cluster (spark://, yarn...) the package is shipped to the executors.")
@click.option("--driver-memory", help="The Spark driver's heap, e.g. 6g (Spark's default: 1g). In local mode "
              "the driver does all the work.")
@click.option("--shuffle-partitions", type=click.IntRange(min=1),
              help="Partitions per shuffle (default: 4 per core, unless your Spark configuration sets them).")
@click.option("--verbose", is_flag=True, help="Spark's own log on the console, not in spark.log in --out.")
@click.option("--full", is_flag=True, help="Read the whole archive again, not only what the ledger in --out has "
              "not covered.")
@click.option("--no-ledger", is_flag=True, help="A one-off audit: read everything and keep no ledger in --out "
              "(about half the cost of a full run that keeps one).")
@click.option("--horizon", type=Age(), default="1d", show_default=True,
              help="How long after a message's newest row the ledger still matches repeats of its rows.")
@click.option("--now", type=click.DateTime(formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"]),
              help="Audit as of this moment (ISO 8601, UTC unless it says; default: now).")
@_with_outbox
def audit(box: Outbox, archive, out, jdbc_url, jdbc_jar, grace, late_after, stuck_after, master, driver_memory,
          shuffle_partitions, verbose, full, no_ledger, horizon, now) -> None:
    """The delivery audit (Spark): lost, duplicated, late and dead-lettered messages; exit 1 when any is lost."""
    import importlib.util

    missing = [name for name in ("pyspark", "pyarrow") if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"the audit needs {' and '.join(missing)}: pip install 'celery-outbox[spark]'")
    from .audit.job import main as audit_main

    archive = archive or box.settings.archive_path
    if jdbc_url == "store":
        jdbc_url = box.settings.database_url
    argv = ["--out", out, "--table-prefix", box.settings.table_prefix, "--grace", str(grace.total_seconds()),
            "--late-after", str(late_after.total_seconds()), "--stuck-after", str(stuck_after.total_seconds()),
            "--master", master, "--horizon", str(horizon.total_seconds())]
    if now is not None:
        argv += ["--now", now.isoformat()]
    for flag, value in (("--archive", archive), ("--jdbc-url", jdbc_url), ("--jdbc-jar", jdbc_jar),
                        ("--driver-memory", driver_memory), ("--shuffle-partitions", shuffle_partitions)):
        if value:
            argv += [flag, str(value)]
    raise SystemExit(audit_main(argv + ["--verbose"] * verbose + ["--full"] * full + ["--no-ledger"] * no_ledger))
