"""Tenants in the consumer (``outbox_tenants``): an in-process worker claims each delivery in the
store of the tenant its message names (``TENANT_HEADER``), and the body's writes, its sends, its
retries and its dead letter stay in that tenant's database; a message naming a tenant the worker
does not know is dead-lettered in the default store, unrun, and replayed into the tenant's store once
``outbox_tenants`` names it. SQLite files, one per tenant.

Sends for a tenant: tests/unit/core/test_tenancy.py; real PostgreSQL databases and worker
processes: tests/integration/test_tenants_workers.py.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import signals
from kombu.utils.json import loads
from sqlalchemy import create_engine, insert, select, update

from celery_outbox import TENANT_HEADER, IdempotentTask, current_tenant, using_tenant
from celery_outbox.maintenance.dead_letters import DeadLetterFilter, replay
from celery_outbox.signals import message_dead_lettered
from celery_outbox.store import UNOWNED, Store, utcnow
from celery_outbox.vocabulary import REPLAY_HEADER, SEND_HEADER, IncomingStatus

from ...brokers import copy_options, nothing_more, receive
from .test_inbox import Harness, define_pay, discards

TENANTS = ("acme", "globex")
#: every store of the harness: the default one (None) and each tenant's
STORES = (None, *TENANTS)


class TenantHarness(Harness):
    """A ``Harness`` whose app has the tenants ``TENANTS`` (or ``tenants``, an ``outbox_tenants``),
    each on an SQLite file of its own beside the default store's, every database with the user
    table (but those ``down``, whose store does not answer yet). Its queue is durable, and so is
    ``receipts``, which no worker consumes; it records each dead letter announced."""

    def __init__(self, tmp_path, prefix: str, tenants: Any = None, down: tuple[str, ...] = ()):
        suffix = uuid.uuid4().hex[:8]
        queue, self.receipts = f"q_{suffix}", f"receipts_{suffix}"
        super().__init__(f"sqlite:///{tmp_path / 'default.db'}", prefix, queue=queue,
                         outbox_durable_queues=[queue, self.receipts],
                         outbox_tenants=tenants or {name: f"sqlite:///{tmp_path / name}.db" for name in TENANTS})
        for tenant in self.outbox.runtime.tenants():
            if tenant in down:  # its store does not answer yet
                continue
            with using_tenant(tenant):
                self.outbox.ready()
                self.metadata.create_all(self.outbox.engine)
        self.dead_lettered: list[tuple[str, str]] = []

        def on_dead_letter(sender=None, message_id=None, reason=None, **_):
            with self.done:
                self.dead_lettered.append((message_id, reason.value))
                self.done.notify_all()

        self._on_dead_letter = on_dead_letter  # a strong reference
        message_dead_lettered.connect(on_dead_letter, weak=False)

    def close(self):
        message_dead_lettered.disconnect(self._on_dead_letter)
        super().close()

    def wait_for_dead_letter(self, message_id: str, timeout: float = 15.0) -> list[tuple[str, str]]:
        """The dead letters announced so far, once one of them is ``message_id``'s."""
        with self.done:
            assert self.done.wait_for(lambda: any(each == message_id for each, _ in self.dead_lettered),
                                      timeout), self.dead_lettered
            return list(self.dead_lettered)

    def store_of(self, tenant: str | None) -> Store:
        """``tenant``'s store (None: the default one)."""
        with using_tenant(tenant):
            return self.outbox.store

    def notes(self, tenant: str | None) -> list[str]:
        """The notes the task bodies wrote in ``tenant``'s database, in id order."""
        with self.store_of(tenant).engine.begin() as conn:
            return conn.execute(select(self.effects.c.note).order_by(self.effects.c.id)).scalars().all()

    def incoming(self, tenant: str | None) -> list[tuple[str, str, int]]:
        """(message id, status, duplicates) of every inbox row in ``tenant``'s store."""
        store = self.store_of(tenant)
        table = store.tables.incoming
        with store.begin() as conn:
            rows = conn.execute(select(table.c.message_id, table.c.status, table.c.duplicates)
                                .order_by(table.c.message_id)).all()
        return [tuple(row) for row in rows]

    def outgoing(self, tenant: str | None) -> list[Any]:
        """Every outgoing row of ``tenant``'s store, in id order."""
        store = self.store_of(tenant)
        with store.begin() as conn:
            return conn.execute(select(store.tables.outgoing).order_by(store.tables.outgoing.c.id)).all()

    def dead_letters(self, tenant: str | None) -> list[Any]:
        """Every dead letter of ``tenant``'s store, whole, in id order."""
        store = self.store_of(tenant)
        with store.begin() as conn:
            return conn.execute(select(store.tables.dead_letters).order_by(store.tables.dead_letters.c.id)).all()


@pytest.fixture
def harness(tmp_path, table_prefix):
    harness = TenantHarness(tmp_path, table_prefix)
    yield harness
    harness.close()


def tenant_copy_options(task_id: str, tenant: str) -> dict[str, Any]:
    """``copy_options`` of a send for ``tenant``: the message names it, as a broker's redelivery does."""
    options = copy_options(task_id)
    options["headers"][TENANT_HEADER] = tenant
    return options


def publish_raw(harness: TenantHarness, task_name: str, task_id: str, args: list, tenant: Any,
                **options: Any) -> None:
    """A task message built as Celery builds it (``options``: ``as_task_v2``'s, ``expires``...),
    naming ``tenant`` (any header value), published straight to the harness's durable queue with
    kombu: no outbox hook refuses it, as a sender that knows other tenants (or none of this
    library) publishes it."""
    app = harness.app
    message = app.amqp.as_task_v2(task_id, task_name, args=args, kwargs={}, **options)
    headers = {**message.headers, TENANT_HEADER: tenant, SEND_HEADER: f"send-of-{task_id}"}
    with app.connection_for_write() as connection:
        connection.Producer().publish(message.body, exchange="", routing_key=harness.queue, serializer="json",
                                      headers=headers, declare=[app.amqp.queues[harness.queue]],
                                      **message.properties)


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_each_tenants_message_runs_once_and_writes_in_its_own_database_only(harness, style):
    """Each claim, with the envelope it keeps for recovery (naming the tenant), is in the
    tenant's store, and the sender's tracked row is acknowledged there."""
    pay = define_pay(harness)
    pay.idempotency = style
    with harness.outbox.transaction(tenant="acme"):
        pay.apply_async(("for acme",), task_id="acme-1")
    with harness.outbox.transaction(tenant="globex"):
        pay.apply_async(("for globex",), task_id="globex-1")
    with harness.outbox.transaction():
        pay.apply_async(("for the default store",), task_id="default-1")
    assert [len(harness.outgoing(tenant)) for tenant in STORES] == [1, 1, 1], "each tracked in its sender's store"
    with harness.worker():
        for task_id in ("acme-1", "globex-1", "default-1"):
            assert harness.wait_for_states(task_id, 1) == ["SUCCESS"]
    assert sorted(harness.runs) == [("acme-1", 0), ("default-1", 0), ("globex-1", 0)]
    assert harness.failures == []
    assert harness.notes("acme") == ["for acme"]
    assert harness.notes("globex") == ["for globex"]
    assert harness.notes(None) == ["for the default store"]
    assert harness.incoming("acme") == [("acme-1", "handled", 0)]
    assert harness.incoming("globex") == [("globex-1", "handled", 0)]
    assert harness.incoming(None) == [("default-1", "handled", 0)]
    assert [harness.outgoing(tenant) for tenant in STORES] == [[], [], []], "each acknowledged in its own store"
    for tenant, task_id in (("acme", "acme-1"), ("globex", "globex-1"), (None, "default-1")):
        assert loads(harness.store_of(tenant).get_incoming(task_id).headers).get(TENANT_HEADER) == tenant


def test_the_same_message_id_in_two_tenants_runs_in_each(harness):
    """A claim is a row of the tenant's store: one tenant's handled message is no duplicate of another's."""
    pay = define_pay(harness)
    for tenant in STORES:
        with harness.outbox.transaction(tenant=tenant):
            pay.apply_async((f"for {tenant}",), task_id="shared-1")
    with harness.worker():
        assert harness.wait_for_states("shared-1", 3) == ["SUCCESS"] * 3
    assert harness.runs == [("shared-1", 0)] * 3
    for tenant in STORES:
        assert harness.notes(tenant) == [f"for {tenant}"]
        assert harness.incoming(tenant) == [("shared-1", "handled", 0)]


def test_a_copy_of_a_tenants_message_is_discarded_by_the_claim_in_its_store(harness):
    pay = define_pay(harness)
    with discards() as discarded, harness.worker():
        with harness.outbox.transaction(tenant="acme"):
            pay.apply_async(("first",), **copy_options("acme-1"))
        assert harness.wait_for_states("acme-1", 1) == ["SUCCESS"]
        pay.apply_async(("copy",), **tenant_copy_options("acme-1", "acme"))
        assert harness.wait_for_states("acme-1", 2) == ["SUCCESS", "IGNORED"]
    assert harness.runs == [("acme-1", 0)]
    assert discarded == [("acme-1", "shop.pay", harness.queue)]
    assert harness.notes("acme") == ["first"]
    assert harness.incoming("acme") == [("acme-1", "handled", 1)]
    assert harness.incoming("globex") == harness.incoming(None) == []
    assert harness.outgoing("acme") == [], "the copy's row acknowledged in acme's store too"


@pytest.mark.parametrize("tenant", ["initech", "../x", 42])
def test_a_message_naming_an_unknown_tenant_is_dead_lettered_in_the_default_store_unrun(harness, tenant):
    define_pay(harness)
    with harness.worker():
        publish_raw(harness, "shop.pay", "stray-1", ["never"], tenant)
        assert harness.wait_for_dead_letter("stray-1") == [("stray-1", "unknown_tenant")]
    assert nothing_more(harness.app, harness.queue), "acked, not handed back"
    assert harness.runs == [] and harness.states == {}
    (letter,) = harness.dead_letters(None)
    assert (letter.message_id, letter.reason, letter.task_name) == ("stray-1", "unknown_tenant", "shop.pay")
    expected = "which outbox_tenants does not know" if tenant == "initech" else "is not a tenant name"
    assert expected in letter.exception_message
    assert loads(letter.headers)[TENANT_HEADER] == tenant and letter.body, "kept as it came, for an operator"
    for store in STORES:
        assert harness.notes(store) == [] and harness.incoming(store) == []
    assert harness.dead_letters("acme") == harness.dead_letters("globex") == []


def test_a_message_naming_an_unknown_tenant_sent_by_celery_to_a_plain_queue_is_dead_lettered(harness):
    """A send for an unknown tenant to a queue that is not durable stores nothing, so the call
    does not refuse it: the consumer's guard does."""
    pay = define_pay(harness)
    with harness.worker(queues=[harness.queue, harness.other_queue]):
        pay.apply_async(("never",), task_id="stray-2", queue=harness.other_queue, headers={TENANT_HEADER: "initech"})
        assert harness.wait_for_dead_letter("stray-2") == [("stray-2", "unknown_tenant")]
    assert harness.runs == []
    (letter,) = harness.dead_letters(None)
    assert (letter.reason, letter.queue) == ("unknown_tenant", harness.other_queue)
    for store in STORES:
        assert harness.notes(store) == [] and harness.incoming(store) == []


def test_a_retry_of_a_tenants_task_claims_and_writes_in_its_store(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.flaky", shared=False, max_retries=2)
    def flaky(self):
        harness.runs.append((self.request.id, self.request.retries, current_tenant()))
        self.session.execute(insert(harness.effects).values(note=f"attempt {self.request.retries}"))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "ok"

    with harness.worker():
        with harness.outbox.transaction(tenant="globex"):
            flaky.apply_async(task_id="flaky-1")
        assert harness.wait_for_states("flaky-1", 2) == ["RETRY", "SUCCESS"]
    assert harness.runs == [("flaky-1", 0, "globex"), ("flaky-1", 1, "globex")]
    assert harness.notes("globex") == ["attempt 1"], "the first attempt's write rolled back with its claim"
    row = harness.store_of("globex").get_incoming("flaky-1")
    assert (row.status, row.retries) == ("handled", 1)
    assert harness.outgoing("globex") == [], "the retry's row stored and acknowledged in globex's store"
    for store in (None, "acme"):
        assert harness.notes(store) == [] and harness.incoming(store) == [] and harness.outgoing(store) == []


def test_a_message_the_body_sends_goes_out_for_the_same_tenant(harness):
    @harness.app.task(name="shop.receipt", shared=False)
    def receipt(note):
        return note

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.ship", shared=False)
    def ship(self, note):
        self.session.execute(insert(harness.effects).values(note=note))
        receipt.apply_async((f"receipt of {note}",), queue=harness.receipts)

    with harness.worker():
        with harness.outbox.transaction(tenant="acme"):
            ship.apply_async(("parcel",), task_id="ship-1")
        assert harness.wait_for_states("ship-1", 1) == ["SUCCESS"]
    (row,) = harness.outgoing("acme")
    assert (row.task_name, row.destination) == ("shop.receipt", harness.receipts)
    assert loads(row.headers)[TENANT_HEADER] == "acme"
    assert row.sent_at is not None, "published, and tracked until a consumer claims it"
    assert harness.outgoing(None) == harness.outgoing("globex") == []
    (published,) = receive(harness.app, harness.receipts, 1)
    assert (published.task, published.args, published.headers[TENANT_HEADER]) == (
        "shop.receipt", ["receipt of parcel"], "acme")


def test_a_tenants_task_that_fails_for_good_is_dead_lettered_in_its_store(harness):
    @harness.app.task(base=IdempotentTask, bind=True, name="shop.broken", shared=False)
    def broken(self, note):
        self.session.execute(insert(harness.effects).values(note=note))
        raise ValueError(f"cannot handle {note}")

    with harness.worker():
        with harness.outbox.transaction(tenant="globex"):
            broken.apply_async(("x",), task_id="broken-1")
        assert harness.wait_for_states("broken-1", 1) == ["FAILURE"]
        assert harness.wait_for_dead_letter("broken-1") == [("broken-1", "failed")]
    (letter,) = harness.dead_letters("globex")
    assert (letter.message_id, letter.reason, letter.exception_type) == ("broken-1", "failed", "ValueError")
    assert loads(letter.headers)[TENANT_HEADER] == "globex", "a replay goes back to globex's store"
    assert harness.incoming("globex") == [("broken-1", "dead", 0)]
    assert harness.notes("globex") == [], "the body's write rolled back"
    assert harness.outgoing("globex") == []
    for store in (None, "acme"):
        assert harness.dead_letters(store) == [] and harness.incoming(store) == []


def test_the_worker_thread_leaves_each_delivery_in_no_tenant(harness):
    """The solo pool runs bodies in the consumer's thread: after a tenant's delivery the thread
    works for no tenant again, so the next message without a header is the default store's."""
    pay = define_pay(harness)
    seen: list[str | None] = []

    @harness.app.task(name="shop.plain", shared=False)
    def plain():
        seen.append(current_tenant())

    with harness.worker(queues=[harness.queue, harness.other_queue]):
        with harness.outbox.transaction(tenant="acme"):
            pay.apply_async(("for acme",), task_id="acme-1")
        assert harness.wait_for_states("acme-1", 1) == ["SUCCESS"]
        plain.apply_async(task_id="plain-1", queue=harness.other_queue)
        assert harness.wait_for_states("plain-1", 1) == ["SUCCESS"]
    assert seen == [None]


def test_a_tenants_message_for_an_unregistered_task_is_dead_lettered_in_its_store(harness):
    """The guard's other verdicts are the tenant's: the dead letter, and the acknowledgment of the
    sender's tracked row, are in the tenant's store."""
    with harness.outbox.transaction(tenant="acme"):
        harness.app.send_task("shop.nowhere", args=["x"], task_id="nowhere-1", queue=harness.queue)
    assert len(harness.outgoing("acme")) == 1
    with harness.worker():
        assert harness.wait_for_dead_letter("nowhere-1") == [("nowhere-1", "unknown_task")]
    (letter,) = harness.dead_letters("acme")
    assert (letter.message_id, letter.reason, letter.task_name) == ("nowhere-1", "unknown_task", "shop.nowhere")
    assert harness.outgoing("acme") == [], "the sender's row acknowledged in acme's store"
    assert harness.dead_letters(None) == harness.dead_letters("globex") == []


def test_a_tenants_message_that_expired_unrun_is_recorded_revoked_in_its_store(harness):
    """The worker's main process records the discarded attempt (``end_revoked_attempt``) in the
    store of the tenant its message names."""
    revoked: list[str] = []

    def on_revoked(request=None, **_):
        with harness.done:
            revoked.append(request.id)
            harness.done.notify_all()

    pay = define_pay(harness)
    signals.task_revoked.connect(on_revoked, weak=False)
    try:
        with harness.worker():
            publish_raw(harness, pay.name, "late-1", ["too late"], "globex",
                        expires=datetime.now(timezone.utc) - timedelta(minutes=1))
            with harness.done:
                assert harness.done.wait_for(lambda: revoked == ["late-1"], 15.0), revoked
    finally:
        signals.task_revoked.disconnect(on_revoked)
    assert harness.runs == []
    assert harness.incoming("globex") == [("late-1", "revoked", 0)]
    assert harness.incoming(None) == harness.incoming("acme") == []


def test_a_plain_task_from_a_durable_queue_is_claimed_and_sends_for_its_tenant(harness):
    """A plain task behind the inbox's eager claim: its claim is in the tenant's store, and what
    its body sends is the tenant's."""
    seen: list[str | None] = []

    @harness.app.task(name="shop.plain_on_durable", shared=False)
    def plain_on_durable(note):
        seen.append(current_tenant())
        harness.app.send_task("shop.receipt", args=[note], queue=harness.receipts)

    with harness.worker():
        with harness.outbox.transaction(tenant="globex"):
            plain_on_durable.apply_async(("p",), **copy_options("plain-1"))
        assert harness.wait_for_states("plain-1", 1) == ["SUCCESS"]
        plain_on_durable.apply_async(("p",), **tenant_copy_options("plain-1", "globex"))
        assert harness.wait_for_states("plain-1", 2) == ["SUCCESS", "IGNORED"]
    assert seen == ["globex"]
    assert harness.incoming("globex") == [("plain-1", "handled", 1)]
    (row,) = harness.outgoing("globex")
    assert (row.task_name, loads(row.headers)[TENANT_HEADER]) == ("shop.receipt", "globex")
    assert harness.incoming(None) == harness.outgoing(None) == []


def define_step(harness):
    """``shop.step``: notes its argument in the running tenant's database, and returns it with a ``+``."""

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.step", shared=False)
    def step(self, note):
        harness.runs.append((self.request.id, current_tenant()))
        self.session.execute(insert(harness.effects).values(note=note))
        return f"{note}+"

    return step


def test_the_next_task_of_a_tenants_chain_runs_for_the_tenant(harness):
    """Celery sends a chain's next task after the body returned: it is sent for the tenant too,
    its row stored in the tenant's database and its delivery claimed there."""
    step = define_step(harness)
    with harness.worker():
        with harness.outbox.transaction(tenant="acme"):
            (step.s("a").set(task_id="chain-1") | step.s().set(task_id="chain-2")).apply_async()
        assert harness.wait_for_states("chain-2", 1) == ["SUCCESS"]
    assert harness.runs == [("chain-1", "acme"), ("chain-2", "acme")]
    assert harness.notes("acme") == ["a", "a+"]
    assert harness.incoming("acme") == [("chain-1", "handled", 0), ("chain-2", "handled", 0)]
    for store in (None, "globex"):
        assert harness.notes(store) == [] and harness.incoming(store) == [] and harness.outgoing(store) == []


def test_the_callbacks_and_errbacks_of_a_tenants_task_run_for_the_tenant(harness):
    step = define_step(harness)

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.broken", shared=False)
    def broken(self):
        raise ValueError("broken")

    with harness.worker():
        with harness.outbox.transaction(tenant="globex"):
            step.apply_async(("linked",), task_id="linked-1", link=step.si("callback").set(task_id="callback-1"))
            broken.apply_async(task_id="broken-1", link_error=step.si("errback").set(task_id="errback-1"))
        assert harness.wait_for_states("callback-1", 1) == ["SUCCESS"]
        assert harness.wait_for_states("errback-1", 1) == ["SUCCESS"]
    assert sorted(harness.runs) == [("callback-1", "globex"), ("errback-1", "globex"), ("linked-1", "globex")]
    assert sorted(harness.notes("globex")) == ["callback", "errback", "linked"]
    for store in (None, "acme"):
        assert harness.notes(store) == [] and harness.incoming(store) == []


def test_an_eager_claim_of_a_tenants_message_is_owned_by_the_workers_node_in_the_tenants_store(harness):
    """The worker registers a node in the tenant's store at its first claim there: recovery of
    that store judges the claim's owner in the tenant's own database."""
    seen: list[tuple[int, list[int]]] = []

    @harness.app.task(base=IdempotentTask, bind=True, name="shop.eager", shared=False)
    def eager(self):
        store = harness.store_of(current_tenant())
        with store.begin() as conn:
            nodes = conn.execute(select(store.tables.nodes.c.id)).scalars().all()
        seen.append((store.get_incoming(self.request.id).owner, nodes))

    eager.idempotency = "eager"
    with harness.worker():
        with harness.outbox.transaction(tenant="acme"):
            eager.apply_async(task_id="eager-1")
        assert harness.wait_for_states("eager-1", 1) == ["SUCCESS"]
    ((owner, nodes),) = seen
    assert owner != UNOWNED and nodes == [owner], "claimed by the node registered in acme's store"
    store = harness.store_of("globex")
    with store.begin() as conn:
        assert conn.execute(select(store.tables.nodes)).all() == [], "no work there, no node"


def test_recovery_republishes_a_tenants_stranded_envelope_naming_the_tenant(harness):
    """The envelope a tenant's delivery keeps is published again by the tenant's recovery with
    the tenant's header, so its copy is claimed in the tenant's store."""
    pay = define_pay(harness)
    with harness.worker():
        with harness.outbox.transaction(tenant="acme"):
            pay.apply_async(("for acme",), task_id="acme-1")
        assert harness.wait_for_states("acme-1", 1) == ["SUCCESS"]
    store = harness.store_of("acme")
    with store.begin() as conn:  # as a process that died in the body leaves its unowned envelope
        conn.execute(update(store.tables.incoming).values(status=IncomingStatus.RUNNING.value, owner=UNOWNED,
                                                          recover_after=utcnow()))
    result = harness.app.tasks["celery_outbox.recover"].run(tenant="acme")
    assert (result["tenant"], result["envelopes_republished"]) == ("acme", 1)
    (copy,) = receive(harness.app, harness.queue, 1)
    assert (copy.task, copy.id, copy.args, copy.headers[TENANT_HEADER]) == ("shop.pay", "acme-1", ["for acme"],
                                                                             "acme")


def test_a_tenant_added_to_a_callable_source_while_the_worker_runs_is_found_by_its_first_message(
        tmp_path, table_prefix):
    """Unknown, a message for it is dead-lettered; once the source returns it, the worker asks
    again for the name its next message carries, creates the library's tables in the new
    database at that first claim (``outbox_auto_create_schema``), and claims the message there."""
    places = {name: f"sqlite:///{tmp_path / name}.db" for name in TENANTS}
    harness = TenantHarness(tmp_path, table_prefix, tenants=lambda: dict(places))
    try:
        pay = define_pay(harness)
        with harness.worker():
            publish_raw(harness, pay.name, "early-1", ["too early"], "hooli")
            assert harness.wait_for_dead_letter("early-1") == [("early-1", "unknown_tenant")]
            places["hooli"] = f"sqlite:///{tmp_path / 'hooli.db'}"
            application_engine = create_engine(places["hooli"])
            harness.metadata.create_all(application_engine)  # the application's own table, not the library's
            application_engine.dispose()
            publish_raw(harness, pay.name, "hooli-1", ["for hooli"], "hooli")
            assert harness.wait_for_states("hooli-1", 1) == ["SUCCESS"]
        assert harness.notes("hooli") == ["for hooli"]
        assert harness.incoming("hooli") == [("hooli-1", "handled", 0)]
        assert [letter.message_id for letter in harness.dead_letters(None)] == ["early-1"]
        assert harness.incoming(None) == []
    finally:
        harness.close()


@pytest.fixture
def late_tenant(tmp_path, table_prefix):
    """A harness whose callable ``outbox_tenants`` does not return ``hooli`` yet, and the function
    that adds it, with the application's table in its database, as an operator does."""
    places = {name: f"sqlite:///{tmp_path / name}.db" for name in TENANTS}
    harness = TenantHarness(tmp_path, table_prefix, tenants=lambda: dict(places))

    def add_hooli() -> None:
        places["hooli"] = f"sqlite:///{tmp_path / 'hooli.db'}"
        application_engine = create_engine(places["hooli"])
        harness.metadata.create_all(application_engine)
        application_engine.dispose()

    yield harness, add_hooli
    harness.close()


def unknown_tenant_letters(harness: TenantHarness, tenant: Any, *others: str) -> list[Any]:
    """The default store's dead letters, once the worker has dead-lettered ``stray-1``, a message
    of ``shop.pay`` naming ``tenant`` (unknown), and ``others``, default-store messages of a task
    it does not know."""
    with harness.worker():
        publish_raw(harness, "shop.pay", "stray-1", ["for hooli"], tenant)
        for task_id in others:
            publish_raw(harness, "shop.nowhere", task_id, ["x"], None)
        for task_id in ("stray-1", *others):
            harness.wait_for_dead_letter(task_id)
    return harness.dead_letters(None)


@pytest.mark.parametrize("inside", [False, True], ids=["alone", "in-a-default-unit-of-work"])
def test_an_unknown_tenants_letter_replayed_once_the_tenant_is_added_runs_in_its_store(late_tenant, inside):
    """The replay sends the letter as hooli's message, even from inside a unit of work of the
    default store (where the letter is): its row is stored in hooli's store, and acknowledged
    there once the worker has claimed it in hooli's store and the body has written there; nothing
    of it is in the default store but the letter, counted replayed."""
    harness, add_hooli = late_tenant
    define_pay(harness)
    (letter,) = unknown_tenant_letters(harness, "hooli")
    assert letter.reason == "unknown_tenant"
    add_hooli()
    with harness.outbox.transaction() if inside else contextlib.nullcontext():
        replayed = replay(harness.outbox.publisher, DeadLetterFilter(ids=(letter.id,)))
    assert (replayed.message_ids, replayed.refused) == (["stray-1"], [])
    (row,) = harness.outgoing("hooli")
    headers = loads(row.headers)
    assert (row.message_id, headers[TENANT_HEADER], headers[REPLAY_HEADER]) == ("stray-1", "hooli", 1)
    assert harness.outgoing(None) == [], "stored in hooli's store, not in the letter's"
    with harness.worker():
        assert harness.wait_for_states("stray-1", 1) == ["SUCCESS"]
    assert harness.runs == [("stray-1", 0)]
    assert harness.notes("hooli") == ["for hooli"]
    assert harness.incoming("hooli") == [("stray-1", "handled", 0)]
    assert harness.outgoing("hooli") == [], "acknowledged in hooli's store"
    assert harness.notes(None) == [] and harness.incoming(None) == [] and harness.outgoing(None) == []
    (counted,) = harness.dead_letters(None)
    assert (counted.id, counted.replay_count, counted.replayed_at is not None) == (letter.id, 1, True)


@pytest.mark.parametrize(("tenant", "why"), [
    ("hooli", "unknown tenant 'hooli': outbox_tenants does not name it; the letter is kept"),
    ("../x", f"its {TENANT_HEADER} header '../x' is not a tenant name; the letter is kept"),
])
def test_replaying_a_letter_whose_tenant_is_still_unknown_keeps_it_and_says_why(late_tenant, tenant, why):
    """The letter is refused with the reason, left as it was (not counted replayed), and nothing
    of it is stored or published; the other letters of the replay go on."""
    harness, _ = late_tenant
    define_pay(harness)
    letters = unknown_tenant_letters(harness, tenant, "nowhere-1")
    assert [(each.message_id, each.reason) for each in letters] == [("stray-1", "unknown_tenant"),
                                                                     ("nowhere-1", "unknown_task")]
    replayed = replay(harness.outbox.publisher, DeadLetterFilter())
    assert replayed.message_ids == ["nowhere-1"]
    ((refused_id, reason),) = replayed.refused
    assert refused_id == letters[0].id and reason.startswith(why), reason
    assert harness.dead_letters(None)[0] == letters[0], "kept as it was, its replay not counted"
    assert [row.message_id for row in harness.outgoing(None)] == ["nowhere-1"]
    (published,) = receive(harness.app, harness.queue, 1)
    assert published.id == "nowhere-1"
    assert nothing_more(harness.app, harness.queue), "nothing of stray-1 published"
