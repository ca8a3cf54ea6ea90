"""Tenants (``celery_outbox.core.tenancy``, ``outbox_tenants``) on SQLite files, one per tenant: the
setting, the store each block uses, units of work and sends for a tenant, and the errors that keep
a message out of another tenant's database.

Consumers in an in-process worker: tests/unit/consumer/test_tenant_inbox.py; real PostgreSQL
databases and worker processes: tests/integration/test_tenants_workers.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid

import pytest
from celery import Celery
from sqlalchemy import select

from celery_outbox import TENANT_HEADER, Outbox, OutboxError, UnknownTenant, current_tenant, using_tenant
from celery_outbox.core.config import read_settings
from celery_outbox.core.tenancy import TenantPlace
from celery_outbox.errors import ConfigurationError
from celery_outbox.maintenance.beat import send_per_tenant


def tenant_app(tmp_path, tenants=("acme", "globex"), **conf):
    app = Celery(f"tenants_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}", outbox_durable_queues=["q"],
                    task_default_queue="q",
                    outbox_tenants={name: f"sqlite:///{tmp_path / name}.db" for name in tenants}, **conf)
    outbox = Outbox(app)

    @app.task(name="t.note", shared=False)
    def note(text):
        return text

    return app, outbox, note


def stored_notes(outbox, tenant=None) -> list[tuple[str, str | None]]:
    """(first argument, tenant header) of every outgoing row in ``tenant``'s store, in id order."""
    from kombu.utils.json import loads

    with using_tenant(tenant):
        store = outbox.ready().store
        with store.begin() as conn:
            rows = conn.execute(select(store.tables.outgoing).order_by(store.tables.outgoing.c.id)).all()
    return [(loads(row.body)[0][0], loads(row.headers).get(TENANT_HEADER)) for row in rows]


def test_the_setting_takes_urls_schemas_and_a_callable():
    settings = read_settings({"outbox_tenants": {"acme": "sqlite:///a.db",
                                                 "globex": {"url": "postgresql+psycopg://h/db", "schema": "globex"}}})
    assert settings.tenants == {"acme": TenantPlace("sqlite:///a.db"),
                                "globex": TenantPlace("postgresql+psycopg://h/db", "globex")}

    def source():
        return {"acme": "sqlite:///a.db"}

    assert read_settings({"outbox_tenants": source}).tenants is source
    assert read_settings({}).tenants == {}


@pytest.mark.parametrize(("value", "complaint"), [
    (["acme"], "must be a dict"),
    ({"ac me": "sqlite://"}, "is not a tenant name"),
    ({"acme": 3}, "must map to a database URL"),
    ({"acme": {"url": "postgresql+psycopg://h/db", "schema": "drop table"}}, "not an SQL identifier"),
    ("no.such.module:tenants", "dotted path to a callable"),
])
def test_a_wrong_tenants_setting_is_one_clear_error(value, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        read_settings({"outbox_tenants": value})


def test_the_tenant_of_a_block_is_its_own_and_nested_blocks_restore_it():
    assert current_tenant() is None
    with using_tenant("acme"):
        assert current_tenant() == "acme"
        with using_tenant("globex"):
            assert current_tenant() == "globex"
        assert current_tenant() == "acme"
    assert current_tenant() is None
    with pytest.raises(UnknownTenant, match="not a tenant name"):
        with using_tenant("../etc"):
            pass


def test_each_tenant_has_its_own_store_on_its_own_database(tmp_path):
    _, outbox, _ = tenant_app(tmp_path)
    default = outbox.store
    with using_tenant("acme"):
        acme = outbox.store
        assert str(acme.engine.url).endswith("acme.db")
    with using_tenant("globex"):
        assert outbox.store is not acme and str(outbox.store.engine.url).endswith("globex.db")
    assert outbox.store is default and str(default.engine.url).endswith("default.db")
    with using_tenant("initech"), pytest.raises(UnknownTenant, match="'initech'"):
        _ = outbox.store


def test_a_unit_of_work_for_a_tenant_stores_its_messages_in_that_tenants_database(tmp_path):
    _, outbox, note = tenant_app(tmp_path, outbox_redeliver_after=600)
    with outbox.transaction(tenant="acme"):
        note.delay("a1")
        assert current_tenant() == "acme"
        note.delay("a2")
    with outbox.begin(tenant="globex"):
        note.delay("g1")
    with outbox.transaction():
        note.delay("d1")
    assert stored_notes(outbox, "acme") == [("a1", "acme"), ("a2", "acme")]
    assert stored_notes(outbox, "globex") == [("g1", "globex")]
    assert stored_notes(outbox) == [("d1", None)]


def test_a_rolled_back_tenant_unit_of_work_stores_nothing(tmp_path):
    _, outbox, note = tenant_app(tmp_path)
    with pytest.raises(RuntimeError), outbox.transaction(tenant="acme"):
        note.delay("never")
        raise RuntimeError("roll back")
    assert stored_notes(outbox, "acme") == []


def test_a_send_for_a_tenant_outside_a_unit_of_work_is_stored_in_its_database(tmp_path):
    _, outbox, note = tenant_app(tmp_path, outbox_redeliver_after=600)
    with using_tenant("acme"):
        note.delay("ambient")
    note.apply_async(("by header",), headers={TENANT_HEADER: "globex"})
    assert stored_notes(outbox, "acme") == [("ambient", "acme")]
    assert stored_notes(outbox, "globex") == [("by header", "globex")]
    assert stored_notes(outbox) == []


def test_a_message_never_goes_to_another_tenants_database(tmp_path):
    _, outbox, note = tenant_app(tmp_path)
    with pytest.raises(OutboxError, match="inside one for 'acme'"):
        with outbox.transaction(tenant="acme"), outbox.transaction(tenant="globex"):
            pass
    with pytest.raises(OutboxError, match="naming tenant 'globex' is sent for tenant 'acme'"):
        with outbox.transaction(tenant="acme"):
            note.apply_async(("x",), headers={TENANT_HEADER: "globex"})
    with pytest.raises(OutboxError, match="inside a unit of work of the default store"):
        with outbox.transaction():
            note.apply_async(("x",), headers={TENANT_HEADER: "globex"})
    with pytest.raises(UnknownTenant, match="'initech'"):
        note.apply_async(("x",), headers={TENANT_HEADER: "initech"})
    with pytest.raises(UnknownTenant), outbox.transaction(tenant="initech"):
        pass
    assert stored_notes(outbox, "acme") == stored_notes(outbox, "globex") == stored_notes(outbox) == []


def test_a_callable_source_is_asked_again_for_a_tenant_added_at_run_time(tmp_path):
    tenants = {"acme": f"sqlite:///{tmp_path / 'acme.db'}"}
    asked = []

    def source():
        asked.append(1)
        return dict(tenants)

    app = Celery("added", broker="memory://", set_as_current=False)
    app.conf.update(outbox_database_url=f"sqlite:///{tmp_path / 'default.db'}", outbox_durable_queues=["q"],
                    task_default_queue="q", outbox_tenants=source, outbox_redeliver_after=600)
    outbox = Outbox(app)

    @app.task(name="t.note", shared=False)
    def note(text):
        return text

    with outbox.transaction(tenant="acme"):
        note.delay("a")
    with pytest.raises(UnknownTenant):
        with outbox.transaction(tenant="hooli"):
            pass
    tenants["hooli"] = f"sqlite:///{tmp_path / 'hooli.db'}"
    with outbox.transaction(tenant="hooli"):
        note.delay("h")
    assert stored_notes(outbox, "hooli") == [("h", "hooli")]
    assert outbox.runtime.tenants() == ["acme", "hooli"]
    assert len(asked) >= 3, "asked first, for the unknown name, and again once it was added"


def test_beat_sends_one_maintenance_task_per_tenant(tmp_path):
    app, outbox, _ = tenant_app(tmp_path, tenants=("acme", "globex", "initech"),
                                outbox_maintenance_queue="maintenance")
    sent = []
    app.conf.task_always_eager = False
    from celery import signals

    def record(sender=None, headers=None, body=None, routing_key=None, **_):
        sent.append((sender, body[1], routing_key, TENANT_HEADER in (headers or {})))

    signals.before_task_publish.connect(record, weak=False)
    try:
        assert send_per_tenant(outbox.runtime, "celery_outbox.recover", 5.0, turn=0) == ["acme", "globex", "initech"]
    finally:
        signals.before_task_publish.disconnect(record)
    assert sent == [("celery_outbox.recover", {"tenant": name}, "maintenance", False)
                    for name in ("acme", "globex", "initech")]


def test_beat_turns_the_tenants_order_each_run_so_none_is_always_last(tmp_path):
    """Workers behind let a run's last tasks expire: each tenant is first, and last, once in as many
    runs as there are tenants; the turn is the interval's number, so every process agrees on it."""
    app, outbox, _ = tenant_app(tmp_path, tenants=("acme", "globex", "initech"))
    app.conf.task_always_eager = False
    runs = [send_per_tenant(outbox.runtime, "celery_outbox.recover", 5.0, turn=turn) for turn in range(6)]
    assert runs[:3] == [["acme", "globex", "initech"], ["globex", "initech", "acme"], ["initech", "acme", "globex"]]
    assert runs[3:] == runs[:3]
    assert sorted(run[-1] for run in runs[:3]) == ["acme", "globex", "initech"]
    before = int(time.time() // 5.0)
    unturned = send_per_tenant(outbox.runtime, "celery_outbox.recover", 5.0)
    after = int(time.time() // 5.0)
    assert unturned in (runs[before % 3], runs[after % 3]), "without a turn: the interval's number since the epoch"


def test_recover_for_one_tenant_works_on_its_store_alone(tmp_path):
    app, outbox, note = tenant_app(tmp_path, outbox_redeliver_after=600)
    with outbox.transaction(tenant="acme"):
        note.delay("a")
    with using_tenant("acme"):
        store = outbox.store
        with store.begin() as conn:  # as if its publish never happened
            store.unmark_sent(conn, [row.id for row in conn.execute(select(store.tables.outgoing)).all()])
    result = app.tasks["celery_outbox.recover"].run(tenant="acme")
    assert (result["tenant"], result["published"]) == ("acme", 1)
    with using_tenant("acme"), store.begin() as conn:
        assert [row.sent_at is not None for row in conn.execute(select(store.tables.outgoing)).all()] == [True]
    assert stored_notes(outbox) == []


@pytest.mark.skipif(importlib.util.find_spec("aiosqlite") is None, reason="needs the asyncio extra (aiosqlite)")
def test_an_async_unit_of_work_for_a_tenant_stores_in_its_database(tmp_path):
    _, outbox, note = tenant_app(tmp_path, outbox_redeliver_after=600)

    async def main():
        async with outbox.atransaction(tenant="acme"):
            note.delay("async a")
            assert current_tenant() == "acme"
        async with outbox.abegin(tenant="globex"):
            note.delay("async g")
        assert current_tenant() is None

    asyncio.run(main())
    assert stored_notes(outbox, "acme") == [("async a", "acme")]
    assert stored_notes(outbox, "globex") == [("async g", "globex")]
