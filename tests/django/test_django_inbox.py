"""An ``IdempotentTask`` in a Django project writes with the ORM: its inbox claim and its ORM
writes commit in one Django transaction (the optimistic style), on SQLite and PostgreSQL, with a
real worker (a thread pool in this process, so that it uses the test databases) on Redis."""

from __future__ import annotations

import uuid
from contextlib import nullcontext

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from django.db import IntegrityError, close_old_connections, connections, transaction

from celery_outbox import IdempotentTask

from ..brokers import copy_options, receive
from ..django_project.shop.models import Order
from ..services import wait_until

pytestmark = pytest.mark.django_db(databases=["default", "pg"], transaction=True)


def close_connections(**_) -> None:
    close_old_connections()  # as Celery's Django fixup does after each task


@pytest.fixture
def worker_shop(shop):
    """The shop's worker: a pool of two threads consuming the plain queue (the payments' durable
    queue is left to the test to read); each task's Django connection closed after it, as in a
    Django project's worker."""
    runs: list[str] = []
    using = shop.using

    cuts: list[str] = []

    def place_order(number, fail=False, then_pay=False, cut=False, swallow=False, failing_hook=False,
                    durable_block=False):
        runs.append(number)
        if durable_block:
            with transaction.atomic(using=using, durable=True):
                Order.objects.using(using).create(number=f"{number}-durable")
        Order.objects.using(using).create(number=number)
        if failing_hook:  # the project's own callback, which fails after the commit
            transaction.on_commit(lambda: 1 / 0, using=using)
        if swallow:  # the same order again, its error caught: in a savepoint of its own, or not
            try:
                with transaction.atomic(using=using) if swallow == "in a savepoint" else nullcontext():
                    Order.objects.using(using).create(number=number)
            except IntegrityError:
                pass
        if cut and number not in cuts:
            cuts.append(number)
            terminate(connections[using])
            Order.objects.using(using).filter(number=number).count()  # meets the cut
        if then_pay:
            shop.pay.apply_async((number,), task_id=f"pay-{number}")
        if fail:
            raise ValueError("the body fails after its ORM write")

    @shop.app.task(name="shop.place", base=IdempotentTask, bind=True, shared=False)
    def place(self, number, **options):
        place_order(number, **options)

    @shop.app.task(name="shop.place_eager", base=IdempotentTask, bind=True, shared=False)
    def place_eager(self, number, **options):
        place_order(number, **options)

    place_eager.idempotency = "eager"
    shop.app.conf.task_routes = {**shop.app.conf.task_routes, "shop.place": {"queue": shop.plain},
                                 "shop.place_eager": {"queue": shop.plain}}
    shop.place, shop.place_eager, shop.runs, shop.cuts = place, place_eager, runs, cuts
    task_postrun.connect(close_connections, weak=False)
    with start_worker(shop.app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=10,
                      queues=[shop.plain]):
        yield shop
    task_postrun.disconnect(close_connections)


def terminate(connection) -> None:
    """Have PostgreSQL end ``connection``'s session, from a connection of its own."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(host=settings["HOST"] or None, port=settings["PORT"] or None, user=settings["USER"] or None,
                         password=settings["PASSWORD"] or None, dbname=settings["NAME"], autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])


def orders(shop, number: str) -> int:
    return Order.objects.using(shop.using).filter(number=number).count()


def handled(shop, task_id: str):
    row = shop.outbox.store.get_incoming(task_id)
    return row if row is not None and row.status in ("handled", "dead") else None


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_redelivered_copy_is_discarded_and_the_order_written_once(worker_shop, style):
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), **copy_options(f"place-{number}"))
    wait_until(lambda: handled(shop, f"place-{number}"), message="the first copy handled")
    task.apply_async((number,), **copy_options(f"place-{number}"))
    wait_until(lambda: shop.outbox.store.get_incoming(f"place-{number}").duplicates == 1,
               message="the second copy discarded")
    assert orders(shop, number) == 1 and shop.runs == [number]
    assert handled(shop, f"place-{number}").status == "handled"


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_failing_body_rolls_back_its_orm_write_with_its_claim(worker_shop, style):
    """Optimistic: the claim rolls back with the write; eager: the claim committed first, the write
    and the claim's finish roll back together, and the attempt ends dead."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"fail": True}, task_id=f"place-{number}")
    row = wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt ended")
    assert row.status == "dead" and orders(shop, number) == 0
    assert shop.outbox.store.count_dead_letters() == 1


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_body_that_swallows_a_database_error_fails_and_commits_nothing(worker_shop, style):
    """An ORM error caught without ``transaction.atomic()`` around it: Django marks the block for
    rollback (and PostgreSQL aborts its transaction), so its end would be a silent ROLLBACK. The
    attempt fails instead, naming the caught error, and ends dead with nothing written."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"swallow": True}, task_id=f"place-{number}")
    row = wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt ended")
    assert row.status == "dead" and orders(shop, number) == 0
    [letter] = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert letter.exception_type == "TransactionAborted", letter.exception_type
    assert "IntegrityError: " in letter.exception_message, letter.exception_message


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_body_that_catches_a_database_error_in_its_own_atomic_block_commits_the_rest(worker_shop, style):
    """The idiom docs/inbox.md gives: the statement that may fail in a nested ``atomic()``."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"swallow": "in a savepoint"}, task_id=f"place-{number}")
    row = wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt ended")
    assert row.status == "handled" and orders(shop, number) == 1


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_projects_on_commit_callback_failing_after_the_commit_leaves_the_attempt_handled(worker_shop, style):
    """The body's own ``on_commit`` callback raises once the block has committed: Django logs it
    (the attempt runs the project's callbacks as robust), the attempt is handled, not failed, and
    the message the body sent goes out."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"failing_hook": True, "then_pay": True}, task_id=f"place-{number}")
    row = wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt ended")
    assert row.status == "handled" and orders(shop, number) == 1
    assert shop.outbox.store.count_dead_letters() == 0
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]


def test_a_durable_atomic_block_in_a_body_ends_as_a_dead_letter_naming_djangos_reason(worker_shop):
    """docs/django.md: Django refuses ``atomic(durable=True)`` inside the attempt's block."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    shop.place.apply_async((number,), {"durable_block": True}, task_id=f"place-{number}")
    row = wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt ended")
    assert row.status == "dead" and orders(shop, number) == 0 and orders(shop, f"{number}-durable") == 0
    [letter] = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert (letter.reason, letter.exception_type) == ("failed", "RuntimeError")
    assert "durable atomic block cannot be nested" in letter.exception_message, letter.exception_message


@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_message_the_body_sends_commits_with_its_orm_write(worker_shop, style):
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"then_pay": True}, task_id=f"place-{number}")
    wait_until(lambda: handled(shop, f"place-{number}"), message="the attempt handled")
    assert orders(shop, number) == 1
    assert [m.id for m in receive(shop.app, shop.durable, 1)] == [f"pay-{number}"]



@pytest.mark.parametrize("using", ["pg"], indirect=True)
@pytest.mark.parametrize("style", ["optimistic", "eager"])
def test_a_connection_cut_under_the_body_sends_the_message_back_and_it_runs_once(worker_shop, style):
    """PostgreSQL ends the attempt's connection (Django's) after the body's ORM write: the write is
    gone (optimistic: with the claim; eager: the claim, committed before the body, is released),
    nothing is recorded as a failure, the message goes back to the broker and its next delivery
    writes the order once."""
    shop, number = worker_shop, f"order-{uuid.uuid4().hex[:8]}"
    task = shop.place if style == "optimistic" else shop.place_eager
    task.apply_async((number,), {"cut": True}, task_id=f"cut-{number}")
    row = wait_until(lambda: handled(shop, f"cut-{number}"), timeout=60, message="the second delivery handled")
    assert row.status == "handled" and shop.cuts == [number], "the first delivery met the cut"
    assert shop.runs == [number, number] and orders(shop, number) == 1
    assert shop.outbox.store.count_dead_letters() == 0
