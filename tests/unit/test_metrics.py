"""The metrics' own rules, in one process: what hostile input may not do to the series, and the
clear errors of a missing extra or a wrong multiprocess folder. Scraped from real workers:
tests/integration/test_metrics_workers.py."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry

from celery_outbox import metrics
from celery_outbox.errors import ConfigurationError
from celery_outbox.signals import announce_dead_letters
from celery_outbox.vocabulary import DeadLetterReason


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for family in registry.collect() for s in family.samples
            if s.name == name}


def test_dead_letters_of_unregistered_task_names_share_one_series():
    """A flood of malformed messages and unknown tasks, each naming a task of its own, adds to one
    series per reason; a registered task's failures keep its name."""
    sender, registry = object(), CollectorRegistry()
    counted = metrics.OutboxMetrics(registry).connect(sender)
    try:
        rows = [{"message_id": f"m{n}", "task_name": f"evil.{n}\x00\n\"", "queue": "q", "reason": reason.value}
                for n in range(50) for reason in (DeadLetterReason.MALFORMED, DeadLetterReason.UNKNOWN_TASK)]
        rows.append({"message_id": "ok", "task_name": "shop.pay", "queue": "q", "reason": "failed"})
        announce_dead_letters(sender, rows)
        announce_dead_letters(object(), rows)  # another outbox's: not counted here
    finally:
        counted.disconnect()
    assert samples(registry, "celery_outbox_dead_letters_total") == {
        (("reason", "malformed"), ("task", "")): 50, (("reason", "unknown_task"), ("task", "")): 50,
        (("reason", "failed"), ("task", "shop.pay")): 1}


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'celery-outbox\[metrics\]'"):
        metrics.OutboxMetrics()


def test_a_multiprocess_folder_that_does_not_exist_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(metrics.MULTIPROCESS_DIR_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="PROMETHEUS_MULTIPROC_DIR=.*missing.* is not a folder"):
        metrics.use_multiprocess_dir()
