"""A tenant whose store is down (``outbox_tenants``): the worker parks its messages in the default
store and acks them, so the other tenants' messages keep going; after a pool process found the
store down, the consumer parks the tenant's next messages itself, without a pool slot; the
tenant's recovery sends them again, unchanged, once its store answers, and the inbox there runs
each once. SQLite files: the down tenant's lies in a folder that does not exist yet.

Real PostgreSQL databases and worker processes: tests/integration/test_tenants_workers.py.
"""

from __future__ import annotations

import pytest
from kombu.utils.json import loads

from celery_outbox import TENANT_HEADER, current_tenant, using_tenant
from celery_outbox.consumer.main_process import installed_main_process
from celery_outbox.errors import StoreUnavailable
from celery_outbox.maintenance.dead_letters import DeadLetterFilter, replay
from celery_outbox.maintenance.recover import recover

from ...brokers import nothing_more
from ...waiting import wait_until
from .test_inbox import define_pay
from .test_tenant_inbox import TenantHarness, publish_raw


@pytest.fixture
def outage(tmp_path, table_prefix):
    """A harness whose tenant ``globex`` lives in a folder that does not exist (its store cannot
    be opened), beside ``acme``; and that folder, to create when the store is to come back."""
    disk = tmp_path / "globex-disk"
    harness = TenantHarness(tmp_path, table_prefix, down=("globex",), tenants={
        "acme": f"sqlite:///{tmp_path / 'acme.db'}", "globex": f"sqlite:///{disk / 'globex.db'}"})
    installed_main_process(harness.app).outages.pause = 600  # the test decides when the store is back
    yield harness, disk
    harness.close()


def parked(harness: TenantHarness) -> list[tuple[str, str, str | None, str]]:
    """(message id, reason, tenant header, description) of each dead letter of the default store."""
    return [(letter.message_id, letter.reason, loads(letter.headers).get(TENANT_HEADER), letter.exception_message)
            for letter in harness.dead_letters(None)]


def test_a_down_tenants_messages_are_parked_in_the_default_store_and_the_others_run(outage):
    harness, _ = outage
    pay = define_pay(harness)
    with harness.worker():
        for n in range(1, 4):
            publish_raw(harness, "shop.pay", f"globex-{n}", [f"globex {n}"], "globex")
            with harness.outbox.transaction(tenant="acme"):
                pay.apply_async((f"acme {n}",), task_id=f"acme-{n}")
        for n in range(1, 4):
            assert harness.wait_for_states(f"acme-{n}", 1) == ["SUCCESS"]
            harness.wait_for_dead_letter(f"globex-{n}")
    assert nothing_more(harness.app, harness.queue), "every message acked: none circles back to the worker"
    assert harness.notes("acme") == ["acme 1", "acme 2", "acme 3"]
    assert harness.incoming("acme") == [(f"acme-{n}", "handled", 0) for n in range(1, 4)]
    letters = parked(harness)
    assert [(message_id, reason, tenant) for message_id, reason, tenant, _ in letters] == [
        (f"globex-{n}", "tenant_unavailable", "globex") for n in range(1, 4)]
    first, *later = [description for *_, description in letters]
    assert first.startswith("tenant 'globex': its store cannot be reached: "), "the pool process tried the store"
    assert all("parked without a try" in description for description in later), \
        "the consumer parked the next ones itself, with no pool slot"
    assert [run for run in harness.runs if run[0].startswith("globex")] == [], "no body ran for globex"
    assert harness.incoming(None) == [], "nothing claimed in the default store"


def test_a_parked_message_is_sent_again_by_its_tenants_recovery_once_its_store_answers(outage):
    harness, disk = outage
    define_pay(harness)
    outages = installed_main_process(harness.app).outages
    outages.pause = 0.2
    with harness.worker():
        for n in (1, 2):
            publish_raw(harness, "shop.pay", f"globex-{n}", [f"globex {n}"], "globex")
        for n in (1, 2):
            harness.wait_for_dead_letter(f"globex-{n}")
    refused = replay(harness.outbox.publisher, DeadLetterFilter(reason="tenant_unavailable"))
    assert refused.message_ids == [] and [reason for _, reason in refused.refused] == [
        "parked while its tenant's store was down: the tenant's recovery sends it again, unchanged, once the store "
        "answers (a replay would run it a second time); purge it to drop it"] * 2
    with using_tenant("acme"):
        assert recover(harness.outbox.runtime).parked_sent == 0, "another tenant's pass leaves them"
    with pytest.raises(StoreUnavailable), using_tenant("globex"):
        recover(harness.outbox.runtime)  # its store does not answer: its pass fails, the letters stay
    assert len(parked(harness)) == 2

    disk.mkdir()  # the store is back
    with using_tenant("globex"):
        harness.outbox.ready()
        harness.metadata.create_all(harness.outbox.engine)
        assert recover(harness.outbox.runtime).parked_sent == 2
    assert parked(harness) == [], "deleted once published"
    wait_until(lambda: not outages.is_down("globex"), message="the pause's end: the worker tries the store again")
    with harness.worker():
        for n in (1, 2):
            assert harness.wait_for_state(f"globex-{n}", "SUCCESS")[-1] == "SUCCESS"
    assert sorted(harness.runs) == [("globex-1", 0), ("globex-2", 0)], "each body ran once, once its store was back"
    assert harness.notes("globex") == ["globex 1", "globex 2"]
    assert harness.incoming("globex") == [("globex-1", "handled", 0), ("globex-2", "handled", 0)]
    assert harness.incoming(None) == [] and harness.dead_letters(None) == []


def test_a_plain_task_of_a_down_tenant_on_a_plain_queue_runs_unparked(outage):
    """Only a message that claims in its store is parked: a plain task of the down tenant, from a
    queue that is not durable, runs (for its tenant) as it would, while the tenant's messages that
    claim are parked."""
    harness, _ = outage
    define_pay(harness)
    ran = []

    @harness.app.task(name="shop.note_plain", shared=False)
    def note_plain(text):
        ran.append((text, current_tenant()))

    with harness.worker(queues=[harness.queue, harness.other_queue]):
        publish_raw(harness, "shop.pay", "globex-1", ["claims"], "globex")
        harness.wait_for_dead_letter("globex-1")  # the pool process found the store down
        note_plain.apply_async(("plain",), task_id="plain-1", queue=harness.other_queue,
                               headers={TENANT_HEADER: "globex"})
        assert harness.wait_for_states("plain-1", 1) == ["SUCCESS"]
    assert ran == [("plain", "globex")]
    assert [letter.message_id for letter in harness.dead_letters(None)] == ["globex-1"]
