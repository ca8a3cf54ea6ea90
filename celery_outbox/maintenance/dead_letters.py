"""Dead letters, the envelopes that failed for good: the filter a command applies, replay and purge.

Transaction boundary: per batch of letters, ``replay`` locks them and, in one unit of work of
their store, sends its tenant's messages through the outbox (durable ones stored) and counts the
replay on each letter; the messages are published after the commit. A letter naming another
tenant (an ``unknown_tenant`` letter) is sent by a unit of work of that tenant's store, committed
first; a crash between the two commits leaves it uncounted. ``purge`` deletes in batches, each its
own transaction. Guarantee: a replay is a new attempt (header ``celery_outbox_replay``) that the
inbox runs in the store of the tenant it names; a letter is checked as the consumer guard checks a
new message (a malformed one, or one whose tenant is unknown, is refused and kept, never
re-published) and goes where the app routes its task now. See docs/operations.md, docs/tenancy.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from kombu.serialization import loads

from ..core.runtime import Runtime
from ..core.tenancy import TENANT_HEADER, current_tenant, tenant_of_headers, using_tenant, valid_tenant_name
from ..errors import UnknownTenant
from ..message.checks import malformed_reason, shown
from ..message.envelope import OutgoingMessage, from_row
from ..message.routing import published_route
from ..producer.publishing import Publisher
from ..producer.unit_of_work import current_unit_of_work, outside_unit_of_work, transaction
from ..store import utcnow
from ..vocabulary import REPLAY_HEADER, DeadLetterReason

__all__ = ["DeadLetterFilter", "Replayed", "purge", "replay"]

REPLAY_BATCH = 200


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a command applies to; every given criterion must hold."""

    ids: tuple[int, ...] | None = None
    task: str | None = None
    queue: str | None = None
    exception: str | None = None
    reason: str | None = None
    since: datetime | None = None
    failed_before: datetime | None = None

    def where(self, store: Any):
        return store.dead_letter_filter(
            ids=self.ids, task=self.task, queue=self.queue, exception=self.exception, reason=self.reason,
            since=self.since, failed_before=self.failed_before)


@dataclass
class Replayed:
    """What a replay did: the message ids re-published, and the dead letters refused with the reason."""

    message_ids: list[str] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)


def replay(publisher: Publisher, which: DeadLetterFilter,
           progress: Callable[[int], None] | None = None) -> Replayed:
    """Re-publish the matching dead letters of the current tenant's store through the outbox, each
    checked as the consumer guard checks a new message, routed by its task's current route and sent
    as a message of the tenant its ``TENANT_HEADER`` names (none: the default store), stored in
    that tenant's store; a malformed letter, or one naming a tenant ``outbox_tenants`` does not know
    or whose store cannot take it now, is refused (left as it is, with the reason in
    ``Replayed.refused``), never re-published."""
    runtime = publisher.runtime
    store = runtime.ready().store
    here = current_tenant()
    where = which.where(store)
    result = Replayed()
    last_id = 0
    while True:
        with transaction(publisher) as session:
            conn = session.connection()
            rows = store.lock_dead_letters(conn, where, REPLAY_BATCH, after_id=last_id)
            if not rows:
                break
            last_id = rows[-1].id
            by_tenant: dict[str | None, list[tuple[Any, OutgoingMessage]]] = {}
            for row in rows:
                message = _replay_message(row, runtime.app)
                tenant = None if isinstance(message, str) else tenant_of_headers(message.headers)
                if tenant is not None and not valid_tenant_name(tenant):
                    message = f"its {TENANT_HEADER} header {shown(tenant)} is not a tenant name; the letter is kept"
                if isinstance(message, str):
                    result.refused.append((row.id, message))
                else:
                    by_tenant.setdefault(tenant, []).append((row, message))
            taken = by_tenant.pop(here, [])
            uow = current_unit_of_work()
            assert uow is not None
            uow.add([message for _, message in taken])
            for tenant, letters in by_tenant.items():
                refusal = _send_for_other_tenant(publisher, tenant, [message for _, message in letters])
                if refusal is None:
                    taken.extend(letters)
                else:
                    result.refused.extend((row.id, refusal) for row, _ in letters)
            store.mark_replayed(conn, [row.id for row, _ in taken], utcnow())
        result.message_ids.extend(row.message_id for row, _ in sorted(taken, key=lambda letter: letter[0].id))
        if progress is not None:
            progress(len(rows))
    return result


def _send_for_other_tenant(publisher: Publisher, tenant: str | None, messages: list[OutgoingMessage]) -> str | None:
    """Send ``messages``, which name ``tenant``, as that tenant's: stored in its store by a unit of
    work of their own (outside the letters' store's, which is another database's), committed now
    and published after its commit. Returns None, or why they cannot be sent now (nothing sent)."""
    try:
        with outside_unit_of_work(), using_tenant(tenant), transaction(publisher):
            uow = current_unit_of_work()
            assert uow is not None
            uow.add(messages)
    except UnknownTenant as exc:
        return f"{exc}; the letter is kept: replay it once outbox_tenants names the tenant"
    except Exception as exc:  # noqa: BLE001 - that tenant's store only: the other letters go on
        where = "the default store" if tenant is None else f"tenant {tenant!r}'s store"
        return f"{where} cannot take it now: {shown(exc)}; the letter is kept"
    return None


def _replay_message(row: Any, app: Any) -> OutgoingMessage | str:
    """The message a dead letter replays as, or the reason it cannot be replayed."""
    if row.reason == DeadLetterReason.TENANT_UNAVAILABLE.value:
        return ("parked while its tenant's store was down: the tenant's recovery sends it again, unchanged, once the "
                "store answers (a replay would run it a second time); purge it to drop it")
    try:
        message = from_row(row, app.amqp.queues)
    except ValueError as exc:  # headers or properties that are not JSON
        return f"the stored envelope cannot be read: {exc}"
    verdict = malformed_reason(message.headers, app.tasks)
    if verdict is not None and verdict[0] is not DeadLetterReason.UNKNOWN_TASK:
        return verdict[1]
    try:
        body = loads(message.body, message.content_type, message.content_encoding, accept=None)
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the letter's fault
        return f"body cannot be decoded ({message.content_type}): {exc}"
    if verdict is None:
        _route_now(message, app, body)
    message.row_id = None
    message.headers[REPLAY_HEADER] = (row.replays or 0) + (row.replay_count or 0) + 1
    # a replay is a new attempt, sent now: no broker ETA, no expiry of the original
    message.headers["eta"] = None
    message.headers["expires"] = None
    message.deliver_at = message.expires_at = None
    return message


# the options of a task's own declaration (``@app.task(queue=...)``) that route its messages: its
# ``apply_async`` hands them to the router, under those the call gives (a replay gives none)
ROUTING_OPTIONS = ("queue", "exchange", "routing_key")


def _route_now(message: OutgoingMessage, app: Any, body: Any) -> None:
    """Give a message of a registered task the exchange, routing key and queue that its
    ``apply_async`` would give it now (the task's own routing options, ``task_routes``, routers,
    the default queue), as Celery's sender resolves them (``routing.published_route``)."""
    args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) and len(body) == 3 else ((), {})
    task = app.tasks[message.task_name]
    declared = {name: getattr(task, name) for name in ROUTING_OPTIONS if getattr(task, name, None) is not None}
    route = app.amqp.router.route(declared, message.task_name, args, kwargs, task_type=task)
    message.exchange, message.routing_key = published_route(app.amqp, route)
    message.destination = route["queue"].name
    message.sending["declare"] = [route["queue"]]


def purge(runtime: Runtime, which: DeadLetterFilter, batch_size: int | None = None,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete the matching dead letters in batches, each its own transaction; returns how many."""
    store = runtime.ready().store
    where = which.where(store)
    batch = batch_size or runtime.settings.cleanup_batch_size
    deleted = 0
    while True:
        with store.begin() as conn:
            ids = [row.id for row in store.lock_dead_letters(conn, where, batch, full=False)]
            count = store.delete_dead_letters(conn, ids)
        deleted += count
        if progress is not None and count:
            progress(count)
        if count < batch:
            return deleted
