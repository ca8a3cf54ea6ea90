"""docs/monitoring.md's alerts, evaluated by Prometheus' own rule engine (``promtool test rules``,
Debian's prometheus package): each expression, copied from the page's table, fires on the series
the library exposes when the thing it names happens, and not before. The series' names are
checked against what the metrics expose (the counters and a real store's gauges), so an alert on
a renamed or removed metric fails here rather than staying silent in production."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_outbox import Outbox
from celery_outbox.monitoring import metrics

from ..markdown import section_text
from ..services import services_required

pytestmark = pytest.mark.services

# Each alert of the page: the series that make it fire (promtool's expanding notation, one sample a
# minute from 0 s), the minute it must not have fired yet and the minute it must have.
SCENARIOS = {
    "store down": (["celery_outbox_store_up 1 1 1 0 0 0"], 2, 4),
    "backlog stuck": (["celery_outbox_oldest_pending_outgoing_timestamp_seconds 0x10"], 4, 6),
    "messages stuck": (['celery_outbox_stuck_messages{table="outgoing"} 0 0 0 1 1 1'], 2, 4),
    "new dead letters": (['celery_outbox_dead_letters_total{reason="failed",task="shop.pay"} 0 0 0 1 1 1'], 2, 4),
    "lost messages": (['celery_outbox_publish_failures_total{queue="emails",durable="false"} 0 0 0 1 1 1'], 2, 4),
    "node silent": (['celery_outbox_stalest_heartbeat_timestamp_seconds{hostname="web-1"} 0+60x3 180x6'], 3, 5),
    "redelivery storm": (['celery_outbox_messages_redelivered_total{queue="payments",reason="unacknowledged"} '
                          "0 0 0 0+600x6"], 3, 6),
}


def documented_alerts() -> dict[str, str]:
    """The alerts table of docs/monitoring.md: name -> its expression (the first code span)."""
    table = section_text("docs/monitoring.md", "Metrics (Prometheus)").split("### Alerts worth setting", 1)[1]
    rows = re.findall(r"^\| ([^|`]+?) \| `([^`]+)`", table, re.M)
    return {name: expression for name, expression in rows if name != "alert"}


def exposed_names(tmp_path) -> set[str]:
    """The sample names the library exposes: every counter of a process and a real store's gauges."""
    app = Celery("alerts", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'outbox.sqlite3'}", outbox_durable_queues=["payments"])
    outbox = Outbox(app)
    outbox.migrate()
    registry = CollectorRegistry()
    metrics.OutboxMetrics(registry)
    registry.register(metrics.StoreCollector(outbox.status))
    return {f"{family.name}_total" if family.type == "counter" else family.name for family in registry.collect()}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "the alerts' test needs promtool (Debian's prometheus package)"
        pytest.fail(reason) if services_required() else pytest.skip(reason)
    return found


def test_every_documented_alert_fires_when_its_thing_happens_and_not_before(tmp_path):
    tool = promtool()
    alerts = documented_alerts()
    assert set(alerts) == set(SCENARIOS), "an alert of the page without a scenario here, or one gone from it"
    names = exposed_names(tmp_path)
    for name, expression in alerts.items():
        for metric in re.findall(r"celery_outbox_\w+", expression):
            assert metric in names, f"{name!r} alerts on {metric}, which the library does not expose"
    rules = {"groups": [{"name": "celery-outbox", "rules": [
        {"alert": re.sub(r"\W", "_", name), "expr": expression} for name, expression in alerts.items()]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    tests = []
    for name, (series, quiet, firing) in SCENARIOS.items():
        alert = re.sub(r"\W", "_", name)
        tests.append({"interval": "1m", "input_series": [
            {"series": line.split(" ", 1)[0], "values": line.split(" ", 1)[1]} for line in series],
            "alert_rule_test": [{"eval_time": f"{quiet}m", "alertname": alert, "exp_alerts": []},
                                {"eval_time": f"{firing}m", "alertname": alert,
                                 "exp_alerts": [{"exp_labels": labels_of(series[0])}]}]})
    (tmp_path / "tests.yml").write_text(json.dumps({"rule_files": ["rules.yml"], "tests": tests}))
    ran = subprocess.run([tool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}"
    assert "SUCCESS" in ran.stdout, ran.stdout


def labels_of(series: str) -> dict[str, str]:
    """The labels an alert on ``series`` carries: the series' own (each expression keeps them)."""
    selector = series.split(" ", 1)[0]
    return dict(re.findall(r'(\w+)="([^"]*)"', selector))
