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
        (("reason", "failed"), ("task", "other"), ("tenant", "")): 200,
        (("reason", "failed"), ("task", "shop.pay"), ("tenant", "")): 2}


def test_the_gauges_of_every_tenant_carry_its_name_and_a_store_down_stops_no_other(tmp_path):
    """acme holds three pending messages and a dead letter, globex's database cannot be opened, the
    default store is empty: each store's gauges carry its tenant ("" for the default store),
    globex's ``store_up`` is 0 and it has no other gauge, and the stores after it are read; the
    tenant label takes the configured names only."""
    from datetime import timedelta

    from celery import Celery

    from celery_outbox import Outbox, using_tenant
    from celery_outbox.message.dead_letter_rows import dead_letter_row
    from celery_outbox.store import utcnow

    app = Celery("tenant_gauges", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}", outbox_tenants={
        "acme": f"sqlite:///{tmp_path / 'acme.db'}", "globex": f"sqlite:///{tmp_path / 'missing' / 'globex.db'}",
        "hooli": f"sqlite:///{tmp_path / 'hooli.db'}"})
    outbox = Outbox(app)
    with using_tenant("acme"):
        store = outbox.ready().store
        with store.begin() as conn:
            store.insert_outgoing(conn, [{
                "message_id": f"m{n}", "task_name": "t", "destination": "q", "body": b"[]",
                "content_type": "application/json", "content_encoding": "utf-8", "exchange": "", "routing_key": "q",
                "headers": "{}", "properties": "{}", "created_at": utcnow() - timedelta(minutes=5)} for n in range(3)])
            store.insert_dead_letters(conn, [dead_letter_row(reason=DeadLetterReason.FAILED, failed_at=utcnow(),
                                                             message_id="d", task_name="t")])
    registry = CollectorRegistry()
    registry.register(metrics.StoreCollector(outbox.status, outbox.runtime.tenants))
    assert samples(registry, "celery_outbox_store_up") == {
        (("tenant", ""),): 1, (("tenant", "acme"),): 1, (("tenant", "globex"),): 0, (("tenant", "hooli"),): 1}
    assert samples(registry, "celery_outbox_outgoing_messages") == {
        (("queue", "q"), ("status", "pending"), ("tenant", "acme")): 3}
    assert samples(registry, "celery_outbox_dead_letter_messages") == {
        (("reason", "failed"), ("task", "other"), ("tenant", "acme")): 1}
    assert set(samples(registry, "celery_outbox_stuck_messages")) == {
        (("table", table), ("tenant", tenant)) for table in ("outgoing", "incoming")
        for tenant in ("", "acme", "hooli")}
    assert set(samples(registry, "celery_outbox_oldest_pending_outgoing_timestamp_seconds")) == {(("tenant", "acme"),)}
    assert {sample.labels["tenant"] for family in registry.collect() for sample in family.samples} == {
        "", "acme", "globex", "hooli"}


def test_the_gauges_of_the_default_store_arrive_when_the_tenants_cannot_be_listed(sqlite_url, table_prefix):
    from celery import Celery

    from celery_outbox import Outbox

    app = Celery("tenants_fail", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=sqlite_url, outbox_table_prefix=table_prefix)
    outbox = Outbox(app)

    def tenants():
        raise RuntimeError("the tenants' directory is down")

    registry = CollectorRegistry()
    registry.register(metrics.StoreCollector(outbox.status, tenants))
    assert samples(registry, "celery_outbox_store_up") == {(("tenant", ""),): 1}
