"""The metrics' own rules, in one process: what hostile input may not do to the series, and the
clear errors of a missing extra or a wrong multiprocess folder. Scraped from real workers:
tests/integration/test_metrics_workers.py."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry

from celery_outbox.errors import ConfigurationError
from celery_outbox.monitoring import metrics
from celery_outbox.signals import announce_dead_letters
from celery_outbox.vocabulary import ClaimRelease, DeadLetterReason, RedeliveryReason


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


def test_installed_metrics_start_every_known_series_at_zero():
    """The series of the reasons, of the registered tasks (Celery's own aside) and of the durable
    queues exist at 0 before their first event; an app not finalized yet is not finalized for it."""
    from celery import Celery

    from celery_outbox import Outbox

    app = Celery("metrics-zero", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url="sqlite://", outbox_durable_queues=["payments"])
    outbox = Outbox(app)

    @app.task(name="shop.pay", shared=False)
    def pay():
        return None

    registry = CollectorRegistry()
    counted = metrics.install(outbox, registry)
    try:
        assert not app.finalized
        assert set(samples(registry, "celery_outbox_dead_letters_total")) == {
            (("reason", "malformed"), ("task", "")), (("reason", "unknown_task"), ("task", ""))}
    finally:
        counted.disconnect()
    app.finalize()
    registry = CollectorRegistry()
    counted = metrics.install(outbox, registry)
    try:
        dead = samples(registry, "celery_outbox_dead_letters_total")
        assert dead[(("reason", "failed"), ("task", "shop.pay"))] == 0
        assert dead[(("reason", "worker_lost"), ("task", "celery_outbox.recover"))] == 0
        assert not any(dict(key)["task"].startswith("celery.") for key in dead)
        assert set(dead.values()) == {0}
        assert samples(registry, "celery_outbox_claims_taken_over_total") == {
            (("reason", release.value),): 0 for release in ClaimRelease}
        assert samples(registry, "celery_outbox_messages_stored_total") == {(("queue", "payments"),): 0}
        assert samples(registry, "celery_outbox_publish_failures_total") == {
            (("durable", "true"), ("queue", "payments")): 0}
        assert set(samples(registry, "celery_outbox_messages_redelivered_total")) == {
            (("queue", "payments"), ("reason", reason.value)) for reason in RedeliveryReason}
    finally:
        counted.disconnect()


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'celery-outbox\[metrics\]'"):
        metrics.OutboxMetrics()


def test_a_multiprocess_folder_that_does_not_exist_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(metrics.MULTIPROCESS_DIR_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="PROMETHEUS_MULTIPROC_DIR=.*missing.* is not a folder"):
        metrics.use_multiprocess_dir()


def test_the_gauges_and_the_status_group_dead_letters_of_unregistered_task_names(sqlite_url, table_prefix):
    """200 letters, each of a task name of its own that the app does not register (failed, as a
    registered task's are not): ``status`` has one row for them and one for the registered task,
    and the dead-letter gauge two series, not 201."""
    from celery import Celery

    from celery_outbox import Outbox
    from celery_outbox.message.dead_letter_rows import dead_letter_row
    from celery_outbox.store import utcnow

    app = Celery("hostile_names", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=sqlite_url, outbox_table_prefix=table_prefix)
    outbox = Outbox(app)

    @app.task(name="shop.pay", shared=False)
    def pay():
        return None

    store = outbox.ready().store
    names = ["shop.pay", "shop.pay", *(f"evil.{n}" for n in range(200))]
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(reason=DeadLetterReason.FAILED, failed_at=utcnow(),
                                                         message_id=f"m{n}", task_name=name)
                                         for n, name in enumerate(names)])
    assert [(row["task"], row["count"]) for row in outbox.status()["dead_letters"]] == [("other", 200),
                                                                                        ("shop.pay", 2)]
    registry = CollectorRegistry()
    registry.register(metrics.StoreCollector(outbox.status))
    assert samples(registry, "celery_outbox_dead_letter_messages") == {
        (("reason", "failed"), ("task", "other")): 200, (("reason", "failed"), ("task", "shop.pay")): 2}
