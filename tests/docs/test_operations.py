"""docs/operations.md's commands and docs/monitoring.md's snippets, run from their Markdown on
README's Quickstart shop: ``migrate`` again, a worker serving metrics and logging JSON as
monitoring.md sets them up, a payment that fails for good, every ``dead-letters`` line as the page
writes it (bare, and with each of its options), the health check, the metrics command and the
tracer provider's setup."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request

import pytest

from ..markdown import blocks, inline_commands, synopsis
from ..markdown import shell as shell_blocks
from ..services import wait_until
from .quickstart import make_shop

pytestmark = [pytest.mark.worker, pytest.mark.postgres, pytest.mark.redis]

[MIGRATE] = shell_blocks(blocks("docs/operations.md", "Creating the tables"))[0].commands()
DEAD_LETTERS = shell_blocks(blocks("docs/operations.md", "Dead letters"))[0].commands()
METRICS = blocks("docs/monitoring.md", "Metrics (Prometheus)")
METRICS_COMMAND = inline_commands("docs/monitoring.md", "Metrics (Prometheus)", "celery -A proj outbox metrics")
LOGS = blocks("docs/monitoring.md", "Structured logs")
HEALTH = blocks("docs/monitoring.md", "The health check")
TRACES = blocks("docs/monitoring.md", "Traces")

# order 1, paid by pay.py, charged again by a new message: its insert of payment 1 fails for good
CHARGE_AGAIN = """\
from shop import charge_payment, outbox

with outbox.transaction():
    charge_payment.delay(1, "99.00")
"""


def python_block(found, starting: str) -> str:
    """The python block of ``found`` whose text starts with ``starting``."""
    code = [block.code for block in found if block.language == "python" and block.code.startswith(starting)]
    assert len(code) == 1, f"expected one python block starting {starting!r}, found {len(code)}"
    return code[0]


def probe_commands(found) -> dict[str, str]:
    """The exec command of each Kubernetes probe in ``found``'s yaml block, by probe (the commands
    are YAML flow sequences, which JSON reads), as one shell line."""
    (block,) = [block for block in found if block.language == "yaml"]
    return {name: shlex.join(json.loads(command)) for name, command
            in re.findall(r"(\w+Probe):\s*exec:\s*command:\s*(\[.*?\])", block.code, re.S)}


def metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def test_a_failed_payment_goes_through_the_documented_dead_letter_commands(shell, clean_services):
    setup = "\n" + python_block(METRICS, "app.conf.outbox_metrics_port") + "\n" + python_block(LOGS, "import logging")
    worker_command, _ = make_shop(shell.run, shell.cwd, shop_lines=setup)
    port = int(setup.split("outbox_metrics_port =")[1].split()[0])
    assert "created tables: none" in shell.run(MIGRATE), "operations.md's migrate, again: idempotent"
    worker = shell.start(worker_command, "worker.log")
    wait_until(lambda: " ready." in worker.read_text(), timeout=60, message="the worker to be ready")
    shell.run("python pay.py")
    (shell.cwd / "again.py").write_text(CHARGE_AGAIN)
    shell.run("python again.py")

    def letters() -> list[dict]:
        return [json.loads(line) for line in shell.run("celery -A shop outbox dead-letters list --json").splitlines()
                if line.startswith("{")]

    [letter] = wait_until(letters, timeout=30, interval=0.5, message="the second charge of order 1 to fail for good")
    assert (letter["reason"], letter["task"], letter["queue"], letter["exception"]) == (
        "failed", "shop.charge_payment", "payments", "IntegrityError"), letter
    values = {"proj": "shop", "ID": str(letter["id"]), "T": letter["task"], "Q": letter["queue"],
              "ValueError": letter["exception"]}
    values["filters"] = synopsis("[--task T] [--queue Q] [--exception ValueError] [--reason failed] [--since 2h]",
                                 values, options=True)
    list_line, show_line, replay_line, replay_all_line, purge_line = DEAD_LETTERS

    for options in (False, True):
        listed = shell.run(synopsis(list_line, values, options))
        assert letter["message_id"] in listed, listed
    shown = shell.run(synopsis(show_line, values, options=False))
    assert "IntegrityError" in shown and "Traceback (most recent call last)" in shown, shown

    # monitoring.md: the worker's counter of the dead letter
    served = wait_until(lambda: metrics(port), timeout=30, message="the worker's metrics")
    assert 'celery_outbox_dead_letters_total{reason="failed",task="shop.charge_payment"} 1.0' in served, served

    check_line = HEALTH[0].code.splitlines()[0].removeprefix("$ ")
    failed = shell.run(check_line, exits=1)
    assert "FAIL dead_letters: 1 dead letter(s) in the last 3600 s" in failed, failed
    # monitoring.md's Kubernetes probes: neither fails for one dead letter
    probes = probe_commands(HEALTH)
    assert set(probes) == {"livenessProbe", "readinessProbe"}, probes
    for command in probes.values():
        assert shell.run(command.replace(" -A proj ", " -A shop ")).strip() == "OK"

    # the operator removes the cause (payment 1), then replays the letter: order 1 is charged anew
    psql = "psql -h localhost -U shop shop -At -c"
    shell.run(f"{psql} 'DELETE FROM payments WHERE order_id = 1'")
    assert "replayed 1 dead letter(s)" in shell.run(synopsis(replay_line, values, options=False))
    wait_until(lambda: shell.run(f"{psql} 'SELECT amount FROM payments WHERE order_id = 1'").strip() == "99.00",
               timeout=30, message="the replay to charge order 1")
    # replayed again, with the filters or without: the message is handled now, so the copy is discarded
    for options in (False, True):
        assert "replayed 1 dead letter(s)" in shell.run(synopsis(replay_all_line, values, options))
    wait_until(lambda: json.loads(shell.run("celery -A shop outbox status --json"))["duplicates_discarded"] == 2,
               timeout=30, interval=0.5, message="both replays of the handled message to be discarded")
    assert shell.run(f"{psql} 'SELECT order_id, amount FROM payments'").split() == ["1|99.00"]
    # monitoring.md: the log lines of the discards, as JSON with the message's fields
    logged = [json.loads(line) for line in worker.read_text().splitlines() if line.startswith("{")]
    discards = [record for record in logged if record["message"].startswith("celery-outbox: discarded duplicate")]
    assert [(record["message_id"], record["task_name"], record["queue"], record["attempt"]) for record in discards] \
        == [(letter["message_id"], letter["task"], "payments", attempt) for attempt in ("0.2.0", "0.3.0")], logged
    for options in (False, True):  # younger than 30 days: kept
        assert "purged 0 dead letter(s)" in shell.run(synopsis(purge_line, values, options))
    [kept] = letters()
    assert (kept["id"], kept["replays"]) == (letter["id"], 3), kept

    shell.stop()  # the metrics command, on the worker's port, serves the store's gauges
    [command] = METRICS_COMMAND
    shell.start(synopsis(command, values, options=True), "metrics.log")
    gauges = wait_until(lambda: metrics(9808), timeout=30, message="the metrics command to serve")
    assert 'celery_outbox_store_up{tenant=""} 1.0' in gauges, gauges


# monitoring.md's tracer provider, with an in-memory exporter where the page has ``your_exporter``
TRACED_PAYMENT = """\
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

your_exporter = InMemorySpanExporter()
{setup}
{pay}
provider.force_flush()
print(sorted(span.name for span in your_exporter.get_finished_spans()))
"""


def test_the_documented_tracer_provider_traces_a_payment_sent_from_a_unit_of_work(shell, clean_services):
    make_shop(shell.run, shell.cwd)
    setup = python_block(TRACES, "from opentelemetry import trace")
    pay = (shell.cwd / "pay.py").read_text()
    (shell.cwd / "traced.py").write_text(TRACED_PAYMENT.format(setup=setup, pay=pay))
    names = shell.run("python traced.py").strip().splitlines()[-1]
    # monitoring.md's spans of a durable send: stored in the commit, published after it
    assert names == "['publish payments', 'store payments']", names
