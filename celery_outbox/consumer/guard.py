"""The consumer guard: a malformed message is dead-lettered and acked before Celery sees it.

Transaction boundary: the dead letter, with the acknowledgment of the sender's outgoing rows,
commits in a transaction of its own before the broker ack; the caller's result (for an unknown
task, what Celery's ``on_unknown_task`` gives) is written after the ack, and a result backend that
fails is logged, the dead letter kept. Guarantee: no message stops or stalls the worker, and none
is acked unrecorded: when the store cannot be reached, or the sender's row stays held past
``BUSY_ROW_WAIT``, the message goes back to the broker after a back-off taken from the consumer's
timer. What is refused, and why: docs/inbox.md (Bad input).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from celery import bootsteps, signals

from ..core import log_fields
from ..core.config import OutboxSettings
from ..core.runtime import Runtime, runtime_of
from ..core.tenancy import TENANT_HEADER, tenant_of_headers, using_tenant, valid_tenant_name
from ..message.checks import (
    body_reason,
    dead_letter_row_of,
    is_protocol_one,
    malformed_reason,
    shown,
    store_limits_reason,
)
from ..message.dead_letter_rows import dead_letter_row, is_storable_id
from ..message.envelope import send_id_of
from ..message.results import EndedMessage, store_dead_letter_results
from ..message.routing import queue_of
from ..signals import announce_dead_letters
from ..store import is_content_error, utcnow
from ..vocabulary import BUSY_ROW_WAIT, REQUEUE_BACKOFF, Attempt, DeadLetterReason, attempt_of
from .celery_internals import (
    TASKS_STEP,
    build_channel_messages_with,
    call_later,
    consumer_event_dispatcher,
    task_consumer_channel,
    task_strategies,
    wrap_task_handler,
)
from .main_process import installed_main_process

__all__ = ["MessageGuard", "sound_envelope", "tolerate_any_envelope"]

logger = logging.getLogger("celery_outbox.guard")

# -- the broker's envelope (kombu's virtual transports: Redis, SQS...) ----------------------------


def tolerate_any_envelope(channel: Any) -> None:
    """Make ``channel`` build a message from any envelope it receives. A virtual transport builds
    each message from the envelope's JSON as it is delivered, in the consumer's event loop, before
    any handler: an envelope kombu cannot read (headers that are not a mapping, properties or
    delivery info of the wrong shape, a body it cannot decode) raises there, which stops the
    worker with the message already taken off the queue. So the message is built from a sound
    copy of the envelope and carries what is wrong with it (``envelope_fault``) for the guard to
    dead-letter it. Other transports (py-amqp: headers are always a table) are left as they are."""
    build_channel_messages_with(channel, _TolerantMessage)


class _TolerantMessage:
    """Mixed in before a virtual transport's ``Message``: built from a sound copy of the envelope."""

    envelope_fault: str | None = None
    received_headers: Any = None  # the headers as received, kept for the dead letter

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any):
        faults, sound = sound_envelope(payload)
        try:
            super().__init__(sound, channel=channel, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the body cannot be decoded as the envelope says
            faults.append(f"the body cannot be decoded as the envelope says: {shown(exc)}")
            super().__init__({**sound, "body": None}, channel=channel, **kwargs)
        self.envelope_fault = "; ".join(faults) or None
        self.received_headers = payload.get("headers") if isinstance(payload, dict) else None


def sound_envelope(payload: Any) -> tuple[list[str], dict[str, Any]]:
    """What is wrong with a virtual transport's message envelope, and a copy kombu can read: the
    wrong parts replaced by empty ones (a delivery tag made up, so the message can be acked)."""
    faults: list[str] = []

    def part(container: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any, where: str) -> Any:
        value = container.get(key)
        if value is None or (isinstance(value, kinds) and not isinstance(value, bool)):
            return default if value is None else value
        faults.append(f"{where}{key!r} is {shown(value)}")
        return default

    if not isinstance(payload, dict):
        faults.append(f"the envelope is {shown(payload)}, not a mapping")
        payload = {}
    properties = part(payload, "properties", (dict,), {}, "envelope ")
    info = part(properties, "delivery_info", (dict,), {}, "properties' ")
    tag = part(properties, "delivery_tag", (str, int), "", "properties' ")
    if tag == "":
        if properties.get("delivery_tag") in (None, ""):
            faults.append("the envelope has no delivery tag")
        tag = uuid.uuid4().hex
    routing = {key: part(info, key, (str,), "", "delivery info's ") for key in ("exchange", "routing_key")}
    return faults, {
        **payload,
        "body": part(payload, "body", (str, bytes), None, "envelope "),
        "headers": part(payload, "headers", (dict,), {}, "envelope "),
        "content-type": part(payload, "content-type", (str,), None, "envelope "),
        "content-encoding": part(payload, "content-encoding", (str,), None, "envelope "),
        "properties": {**properties, "delivery_tag": tag, "delivery_info": {**info, **routing},
                       "body_encoding": part(properties, "body_encoding", (str,), None, "properties' ")},
    }


class MessageGuard(bootsteps.StartStopStep):
    """Consumer step: wraps Celery's task message handler with the checks above, and makes the task
    consumer's channel on a virtual transport (Redis) build a message from any envelope."""

    requires = (TASKS_STEP,)

    def __init__(self, c: Any, **kwargs: Any):
        super().__init__(c, **kwargs)
        runtime = runtime_of(c.app)
        if runtime is None:
            return

        outages = installed_main_process(c.app).outages

        def guarded(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def on_task_received(message: Any) -> Any:
                tenant = tenant_of_headers(message.headers) if isinstance(message.headers, dict) else None
                try:
                    unknown = _unknown_tenant(runtime, tenant)
                except Exception as exc:  # noqa: BLE001 - outbox_tenants' callable failed: ask again later
                    logger.error("celery-outbox: cannot tell whether tenant %r is known (outbox_tenants raised); "
                                 "handing the message back to the broker in %ss: %r", tenant, REQUEUE_BACKOFF, exc,
                                 **log_fields.of_broker_message(message))
                    _requeue_later(c, message)
                    return None
                if unknown is not None:  # recorded in the default store: no other is known to be its
                    _dead_letter(runtime, c, message, DeadLetterReason.UNKNOWN_TENANT, unknown)
                    return None
                verdict = _verdict(runtime, c, message)
                if verdict is None and outages.is_down(tenant) and _claims_in_store(runtime, c, message):
                    _dead_letter(runtime, c, message, DeadLetterReason.TENANT_UNAVAILABLE,  # taking no pool slot
                                 f"tenant {tenant!r}: its store cannot be reached (a pool process found it down "
                                 f"within the last {outages.pause:g} s); parked without a try")
                    return None
                if verdict is None:
                    return handler(message)
                with using_tenant(tenant):
                    _dead_letter(runtime, c, message, *verdict)
                return None

            return on_task_received

        wrap_task_handler(c, guarded)

    def start(self, c: Any) -> None:
        """Runs after the Tasks step made the task consumer, at each (re)connection."""
        channel = task_consumer_channel(c)
        if runtime_of(c.app) is not None and channel is not None:
            tolerate_any_envelope(channel)


def _verdict(runtime: Runtime, consumer: Any, message: Any) -> tuple[DeadLetterReason, str] | None:
    """(reason, description) when ``message`` must be dead-lettered instead of run, else None."""
    fault = getattr(message, "envelope_fault", None)
    if fault is not None:
        return DeadLetterReason.MALFORMED, fault
    headers = message.headers
    if isinstance(headers, dict) and "task" not in headers and is_protocol_one(message):
        return None  # Celery's own protocol 1 checks apply
    verdict = malformed_reason(headers, task_strategies(consumer))
    if verdict is not None:
        return verdict
    durable = runtime.settings.is_durable(_queue(runtime, message))
    if durable or _uses_inbox(consumer.app, headers["task"]):
        verdict = store_limits_reason(headers)
    if verdict is None and durable:
        verdict = body_reason(message)
    return verdict


def _unknown_tenant(runtime: Runtime, tenant: Any) -> str | None:
    """Why the tenant a message names cannot be its (not a tenant name, or one ``outbox_tenants``
    does not know, a callable source asked again), or None (no tenant: the default store)."""
    if tenant is None:
        return None
    if not valid_tenant_name(tenant):
        return f"its {TENANT_HEADER} header {shown(tenant)} is not a tenant name"
    if tenant not in runtime.tenant_places(refresh_for=tenant):
        return f"it names tenant {tenant!r}, which outbox_tenants does not know"
    return None


def _claims_in_store(runtime: Runtime, consumer: Any, message: Any) -> bool:
    """Whether running ``message`` claims it in its store (a durable queue's, or an inbox task's):
    only such a message is parked while its tenant's store is down; a plain task runs as it would."""
    headers = message.headers
    if not isinstance(headers, dict) or not isinstance(headers.get("task"), str):
        return False
    return runtime.settings.is_durable(_queue(runtime, message)) or _uses_inbox(consumer.app, headers["task"])


def _uses_inbox(app: Any, task_name: str) -> bool:
    from .tasks import IdempotentTask  # the tasks module imports celery.worker: loaded when a consumer starts

    return isinstance(app.tasks.get(task_name), IdempotentTask)


def _dead_letter(runtime: Runtime, consumer: Any, message: Any, reason: DeadLetterReason, description: str) -> None:
    """Dead-letter ``message`` and ack it; if the store cannot be reached, ack nothing: the message
    goes back to the broker after a back-off (``_requeue_later``)."""
    try:
        stored = _store_dead_letter(runtime, message, reason, description)
    except Exception as exc:  # noqa: BLE001 - not the row's fault: the store cannot be reached or used
        logger.error("celery-outbox: cannot dead-letter a %s message (%s); handing it back to the broker in %ss: "
                     "%s", reason.value, description, REQUEUE_BACKOFF, exc, **log_fields.of_broker_message(message))
        _requeue_later(consumer, message)
        return
    if stored:
        logger.error("celery-outbox: dead-lettered a %s message from %r: %s", reason.value,
                     message.delivery_info.get("routing_key"), description, **log_fields.of_broker_message(message))
    message.ack()
    if reason is DeadLetterReason.UNKNOWN_TASK:
        _announce_unknown_task(consumer, message)


def _announce_unknown_task(consumer: Any, message: Any) -> None:
    """What Celery's ``Consumer.on_unknown_task`` does for the caller, once the dead letter
    committed and the message is acked: ``FAILURE(NotRegistered(name))`` in the result backend
    (``AsyncResult.get()`` raises it), the ``task-failed`` event and the ``task_unknown`` signal.
    A failure here is logged; the dead letter is kept."""
    headers = message.headers
    task_id, name = headers["id"], headers["task"]
    store_dead_letter_results(consumer.app, DeadLetterReason.UNKNOWN_TASK,
                              [EndedMessage(task_id, name, headers, message.properties)])
    dispatcher = consumer_event_dispatcher(consumer)
    if dispatcher:
        try:
            dispatcher.send("task-failed", uuid=task_id, exception=f"NotRegistered({name!r})")
        except Exception as exc:  # noqa: BLE001 - an event that cannot be sent loses nothing
            logger.warning("celery-outbox: cannot send the task-failed event of %s[%s]: %r", name, task_id, exc)
    signals.task_unknown.send(sender=consumer, message=message, exc=KeyError(name), name=name, id=task_id)


def _store_dead_letter(runtime: Runtime, message: Any, reason: DeadLetterReason, description: str) -> bool:
    """Insert the message's dead letter, each try in a transaction of its own. A row the database
    refuses for its content is stored again reduced to the reason and the refusal; False when even
    that is refused (logged). Any other error (the store is down) propagates."""
    queue = _queue(runtime, message)
    # a message of an unknown tenant has no sender's row in any store known here to acknowledge; a
    # parked one's is in its tenant's store, and stays unacknowledged until the inbox there has it
    acknowledged = None if reason in (DeadLetterReason.UNKNOWN_TENANT, DeadLetterReason.TENANT_UNAVAILABLE) \
        else _acknowledgment(runtime.settings, message, queue)
    try:
        _insert(runtime, dead_letter_row_of(message, reason, description, queue), acknowledged)
        return True
    except Exception as exc:
        if not is_content_error(exc):
            raise
        refusal = exc
    try:
        _insert(runtime, dead_letter_row(reason=reason, failed_at=utcnow(), error=refusal,
                                        description=f"{description}; its dead letter was refused: {refusal!r}"),
                acknowledged)
        return True
    except Exception as exc:
        if not is_content_error(exc):
            raise
        logger.error("celery-outbox: the store refused the dead letter of a %s message (%s); acked without one: %r",
                     reason.value, description, exc, **log_fields.of_broker_message(message))
        return False


def _queue(runtime: Runtime, message: Any) -> str | None:
    """The queue ``message`` came from (``routing.queue_of``), or its routing key without an app."""
    if runtime.app is None:
        return message.delivery_info.get("routing_key")
    return queue_of(message.delivery_info, runtime.app, runtime.settings.durable_queues)


def _acknowledgment(settings: OutboxSettings, message: Any, queue: str | None,
                    ) -> tuple[str, str | None, Attempt, str] | None:
    """For a message from a durable queue: the key and attempt by which its sender's outgoing row
    is acknowledged (``Store.acknowledge_outgoing``), so delivery tracking does not publish a
    dead-lettered message again; None for other messages."""
    headers = message.headers
    if not isinstance(headers, dict) or not isinstance(headers.get("id"), str) or not is_storable_id(headers["id"]):
        return None  # no sender's row can have this id: the outbox stores only ids it can hold
    if not settings.is_durable(queue):
        return None
    return headers["id"], settings.destination_of(queue), attempt_of(headers), send_id_of(headers)


def _insert(runtime: Runtime, row: dict[str, Any],
            acknowledged: tuple[str, str | None, Attempt, str] | None) -> None:
    """Insert the dead letter and, in the same transaction, acknowledge the sender's outgoing row.
    In the consumer: a row another transaction holds (an attempt of the message running in another
    worker) is waited for at most ``BUSY_ROW_WAIT``, then the message goes back for a later try.
    With no row to acknowledge, no row can be held: no wait is set (one round trip less)."""
    store = runtime.ready().store
    with store.begin(lock_wait=None if acknowledged is None else BUSY_ROW_WAIT) as conn:
        store.insert_dead_letters(conn, [row])
        if acknowledged is not None:
            store.acknowledge_outgoing(conn, *acknowledged)
    announce_dead_letters(runtime.owner, [row])


def _requeue_later(consumer: Any, message: Any) -> None:
    """Hand ``message`` back to the broker after ``REQUEUE_BACKOFF`` seconds, from the consumer's
    timer (the event loop's own, where there is one): the consumer goes on meanwhile, and the
    store is not asked again at once. Until then the message stays unacked: a worker that dies
    meanwhile leaves it to the broker, which restores it."""
    call_later(consumer, REQUEUE_BACKOFF, _requeue, (message,))


def _requeue(message: Any) -> None:
    try:
        message.reject(requeue=True)
    except Exception as exc:  # noqa: BLE001 - the connection it came on is gone: the broker restores it
        logger.warning("celery-outbox: could not hand a message back to the broker: %r", exc)
