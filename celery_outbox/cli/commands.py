"""The commands ``migrate``, ``relay``, ``recover``, ``cleanup``, ``status``, ``check``, ``metrics``.

Transaction boundary: none of its own; each calls the ``Outbox`` method beat or start-up calls, in
that method's transactions, and only parses arguments and prints. Each but ``metrics`` (which reads
every store) runs for the stores ``--tenant`` or ``--all-tenants`` choose (``per_tenant``).
"""

from __future__ import annotations

import contextvars
import threading
from datetime import timedelta
from typing import Any, Callable

import click

from ..core.tenancy import current_tenant
from ..monitoring.health import CheckExit, Failure, Thresholds, failed_conditions, store_down
from ..outbox import Outbox
from .group import Age, echo_json, outbox, per_tenant, printable, table, with_outbox

JSON_HELP = "Print one JSON document for machines (with --all-tenants, one line per store)."


@outbox.command()


@per_tenant()


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


@per_tenant()


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
    @click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
    @per_tenant()
    def run(box: Outbox, max_batches: int | None, as_json: bool) -> None:
        result = command(box, max_batches)
        if as_json:
            echo_json(result.as_dict())
        else:
            click.echo(printable(result, newlines=True))
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


@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)


@per_tenant()


def status(box: Outbox, as_json: bool) -> None:
    """Row counts by status and destination, oldest pending age, live nodes."""
    report = box.status()
    if as_json:
        echo_json(report)
        return
    click.echo(format_status(report))


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


@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)


@per_tenant()


def check(box: Outbox, max_pending_age: timedelta, max_dead_letters: int, window: timedelta, stuck_after: timedelta,
          max_stuck: int, node_stale_after: timedelta | None, min_nodes: int, timeout: timedelta,
          liveness: bool, as_json: bool) -> None:
    """One line per failed condition, when the outbox needs a human: for a probe or a cron alert.
    Exit 0 when all hold, 1 when a threshold is crossed, 2 when the store does not answer (with
    --all-tenants, the highest of the stores')."""
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
        echo_json({"ok": not failures, "failures": [f.as_dict() for f in failures]})
    else:
        tenant = current_tenant()
        where = "" if tenant is None else f" (tenant {tenant})"
        for failure in failures:
            click.echo(f"FAIL {failure.condition.value}{where}: {printable(failure.message)}")
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
    time on the server (``Store.status(timeout=...)``). The thread reads the store of the caller's
    tenant (``using_tenant``: its context goes with it)."""
    outcome: list[Any] = []
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome.append(read())
        except Exception as exc:  # noqa: BLE001 - a store that does not answer is the first failed condition
            outcome.append([store_down(exc, seconds)])

    reader = threading.Thread(target=context.run, args=(run,), name="celery-outbox-check", daemon=True)
    reader.start()
    reader.join(seconds + 1)  # the server's own timeout first, when the status query is what waits
    return outcome[0] if outcome else [store_down(TimeoutError(f"no answer within {seconds:g} s"), seconds)]


@outbox.command()


@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True)


@click.option("--address", default="127.0.0.1", show_default=True,
              help="The address to listen on; 0.0.0.0 for every interface.")


@click.option("--stuck-after", type=Age(), default="1h", show_default=True,
              help="A due outgoing message not sent, or a running claim, older than this counts as stuck.")


@with_outbox


def metrics(box: Outbox, port: int, address: str, stuck_after: timedelta) -> None:
    """Serve the gauges of the default store and of every tenant's for Prometheus on /metrics until
    stopped (with PROMETHEUS_MULTIPROC_DIR set, also the counters of the workers sharing that folder)."""
    from ..monitoring.metrics import serve

    # no ready() first: a store that is down is what store_up 0 reports, scrape after scrape
    serve(lambda: box.status(stuck_after=stuck_after.total_seconds()), port, address, tenants=box.runtime.tenants)
    click.echo(f"celery-outbox metrics on http://{address}:{port}/metrics (Ctrl-C stops)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


def _age(seconds: float | None) -> str:
    return "none pending" if seconds is None else f"{seconds:.1f}s"


def format_status(report: dict[str, Any]) -> str:
    lines = [f"store: {report['store']}"]
    lines += table("incoming (inbox)", report["incoming"], ["status", "queue", "count"])
    lines += table("outgoing (outbox)", report["outgoing"], ["status", "destination", "count"])
    lines += table("dead letters", report["dead_letters"], ["reason", "task", "count"])
    lines.append(f"duplicates discarded: {report['duplicates_discarded']}, "
                 f"messages recovered: {report['messages_recovered']}")
    lines.append(f"oldest pending outgoing: {_age(report['oldest_pending_outgoing_age_seconds'])}")
    lines.append(f"oldest running incoming: {_age(report['oldest_running_incoming_age_seconds'])}")
    lines += table("nodes", report["nodes"], ["id", "name", "pid", "heartbeat_age_seconds", "stale_checks"])
    return "\n".join(lines)
