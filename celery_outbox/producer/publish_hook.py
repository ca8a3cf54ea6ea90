"""The publish hook: every task message the app sends passes through ``send_task_message``.

Transaction boundary: the open unit of work's, when there is one: the message is captured into it
(``unit_of_work``). Outside one, a message for a durable queue is stored in a transaction of its
own and forwarded (``Publisher.store_and_forward``), and any other goes to Celery's own sender,
unchanged. Each send is stamped with its publish identity (``SEND_HEADER``), which a later attempt
of the same delivery keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from celery.app.amqp import AMQP

from ..core.tenancy import TENANT_HEADER, current_tenant, tenant_of_headers, using_tenant
from ..errors import OutboxError
from ..message.envelope import CapturingProducer, OutgoingMessage, capture, check_storable, new_send_id, valid_send_id
from ..message.routing import durable_destination, published_route
from ..monitoring import tracing
from ..vocabulary import SEND_HEADER
from .celery_internals import (
    backend_ignores_producer,
    default_event_dispatcher,
    install_send_task_producer,
    install_task_sender,
)
from .publishing import Publisher
from .unit_of_work import current_unit_of_work

__all__ = ["defer_while_sending", "install_publish_hook", "resending", "sending_through_outbox", "stamp_send_id"]


def _make_sender(publisher: Publisher, amqp: AMQP, celery_sender: Callable[..., Any]) -> Callable[..., Any]:
    runtime = publisher.runtime

    def durable_queue(exchange: str, routing_key: str) -> str | None:
        durable = runtime.settings.durable_queues
        return durable_destination(amqp.queues, durable, exchange, routing_key) if durable else None

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        token = _through_outbox.set(True)
        try:
            return send(producer, name, message, **options)
        finally:
            _through_outbox.reset(token)
            if _deferred_signals and not _through_outbox.get():
                _run_deferred_signals()

    def send(producer: Any, name: str, message: Any, **options: Any) -> Any:
        in_framework = framework_tenant()
        if in_framework is not None:  # a send inside a tenant's Django atomic block is that tenant's
            with using_tenant(in_framework):
                return send_as_stamped(producer, name, message, **options)
        return send_as_stamped(producer, name, message, **options)

    def framework_tenant() -> str | None:
        """The tenant whose framework database (Django's) has a transaction open here, when the
        send names no tenant and no unit of work is open."""
        if current_tenant() is not None or current_unit_of_work() is not None:
            return None
        joined = runtime.joined
        return None if joined is None else joined.tenant_in_transaction(publisher)

    def send_as_stamped(producer: Any, name: str, message: Any, **options: Any) -> Any:
        tenant = stamp_tenant(message.headers, options.get("headers"))
        uow = current_unit_of_work()
        if uow is not None and uow.tenant != tenant:
            raise OutboxError(f"a message for tenant {tenant!r} is sent inside a unit of work of "
                              f"{'the default store' if uow.tenant is None else repr(uow.tenant)}: its row would "
                              "be stored in one database and claimed in another")
        if tenant == current_tenant():
            return send_for_tenant(producer, name, message, **options)
        with using_tenant(tenant):
            return send_for_tenant(producer, name, message, **options)

    def send_for_tenant(producer: Any, name: str, message: Any, **options: Any) -> Any:
        continued = stamp_send_id(runtime.app, message.headers)
        tracing.inject(message.headers)
        uow = current_unit_of_work()
        if uow is None and (joined := runtime.joined) is not None:
            uow = joined.joined_transaction(publisher)
        if uow is None and durable_queue(*published_route(amqp, options)) is None:
            return celery_sender(producer, name, message, **options)
        captured = capture(celery_sender, producer, name, message, options, lambda: default_event_dispatcher(amqp))
        if captured:
            task_message = captured[0]
            destination = durable_queue(task_message.exchange, task_message.routing_key)  # as it is published
            if destination is not None:
                task_message.destination = destination
                task_message.make_durable()
                check_storable(task_message, runtime.store.tables.outgoing)  # fails the call, not the commit
                _declare_also(task_message, amqp.queues.get(destination))
            task_message.survives_rollback = continued
        if uow is not None:
            uow.add(captured)
        else:
            publisher.store_and_forward(captured, producer)
        return None

    return send_task_message


def stamp_tenant(headers: dict[str, Any], given: dict[str, Any] | None = None) -> str | None:
    """The tenant a task message is sent for, written in its headers (``TENANT_HEADER``): the
    running tenant's (a unit of work, a task body or ``using_tenant`` for it), or, outside any, the
    one the caller named (``apply_async(headers=...)``: ``given``, which Celery adds to the
    headers as it publishes). A message naming another tenant than the running one is refused
    (``OutboxError``): its durable row would be stored in one tenant's database and claimed in
    another's."""
    running, named = current_tenant(), tenant_of_headers(given) or tenant_of_headers(headers)
    tenant = running if running is not None else named
    if named is not None and named != tenant:
        raise OutboxError(f"a message naming tenant {named!r} is sent for tenant {running!r}: send it outside "
                          f"the unit of work of {running!r}")
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
        if given is not None:
            given[TENANT_HEADER] = tenant
    return tenant


def _declare_also(message: OutgoingMessage, queue: Any) -> None:
    """Declare the durable queue a message reaches with its publish, as the relay does: Celery
    declares only the queue it resolved, and a message routed by exchange and routing key to a
    queue no consumer has declared yet would reach no queue."""
    declare = list(message.sending.get("declare") or ())
    if queue is not None and queue not in declare:
        message.sending["declare"] = [*declare, queue]


_resent_attempt: ContextVar[Any] = ContextVar("celery_outbox_resent_attempt", default=None)
_through_outbox: ContextVar[bool] = ContextVar("celery_outbox_through_outbox", default=False)


_deferred_signals: list[Callable[[], Any]] = []


def defer_while_sending(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """``handler`` as a signal handler that, when its signal lands while this thread sends a task
    message through the hook, runs once that send has ended instead. Celery beat's SIGTERM and
    SIGINT handler closes the broker connection: run in the middle of a publish on py-amqp, it
    waits for the frame writer's lock the interrupted publish holds, for ever."""

    def on_signal(signum: int, frame: Any) -> Any:
        if _through_outbox.get():
            _deferred_signals.append(lambda: handler(signum, frame))
            return None
        return handler(signum, frame)

    on_signal.defers_while_sending = True  # type: ignore[attr-defined]
    return on_signal


def _run_deferred_signals() -> None:
    """The handlers of the signals that landed during the send that has just ended (one may raise
    ``SystemExit``, as beat's does: from here, between two sends)."""
    handlers = list(_deferred_signals)
    _deferred_signals.clear()
    for handler in handlers:
        handler()


def sending_through_outbox() -> bool:
    """Whether the task message being sent now passes through an outbox's publish hook (for a
    ``before_task_publish`` receiver: Celery sends that signal for every app's messages)."""
    return _through_outbox.get()


@contextmanager
def resending(request: Any) -> Iterator[None]:
    """While Celery re-sends ``request``'s task as a later attempt from outside its body (the
    worker's main process, after a lost worker process), the message keeps its publish identity."""
    token = _resent_attempt.set(request)
    try:
        yield
    finally:
        _resent_attempt.reset(token)


def stamp_send_id(app: Any, headers: Any) -> bool:
    """Give a task message its publish identity (``SEND_HEADER``): a new one per send, except for a
    later attempt of a delivery, a ``retry`` or ``replace`` of the task running now or Celery's
    re-send of a lost one, which keeps the identity of the delivery it continues. Returns whether
    the message continues the task running now (Celery decided on it: it survives a rollback)."""
    if not isinstance(headers, dict):
        return False
    running = request = _running_request_continued(app, headers)
    if request is None:
        resent = _resent_attempt.get()
        request = resent if resent is not None and _continues(resent, headers) else None
    if request is None:
        headers[SEND_HEADER] = new_send_id()
        return False
    inherited = valid_send_id(getattr(request, SEND_HEADER, None))
    if inherited:
        headers[SEND_HEADER] = inherited
    else:  # the delivery came from a sender without the outbox: keyed by its task id, so is this attempt
        headers.pop(SEND_HEADER, None)
    return running is not None


def _running_request_continued(app: Any, headers: dict[str, Any]) -> Any:
    """The request of the task running now when ``headers`` are a ``retry`` or ``replace`` of it
    (same id, later attempt), else None."""
    task = app.current_task
    if task is None:
        return None
    request = task.request
    return request if _continues(request, headers) else None


def _continues(request: Any, headers: dict[str, Any]) -> bool:
    """Whether ``headers`` are a later attempt (more retries, or a replacement) of ``request``."""
    if not headers.get("id") or headers.get("id") != request.id:
        return False
    return (headers.get("retries") or 0) > (request.retries or 0) or (
        (headers.get("replaced_task_nesting") or 0) > (getattr(request, "replaced_task_nesting", 0) or 0)
    )


def install_publish_hook(publisher: Publisher) -> None:
    """Make the app's AMQP an ``OutboxAMQP``: every publish passes through ``send_task_message``;
    and let a send that a unit of work captures skip the app's producer pool."""
    app = publisher.runtime.app
    install_task_sender(app, publisher, lambda amqp, celery_sender: _make_sender(publisher, amqp, celery_sender))
    install_send_task_producer(app, publisher, _producer_for_captured_sends(app))


def _producer_for_captured_sends(app: Any) -> Callable[[], CapturingProducer | None]:
    """For ``Celery.send_task`` with no producer given: while a unit of work is open, the send is
    captured, not published, so it gets a ``CapturingProducer`` instead of a pooled producer
    (taking and giving one back costs about as much CPU as a tenth of the send); unless the result
    backend uses the producer when a task is sent (the rpc backend declares its reply queue on
    its channel). Outside a unit of work, Celery acquires one as usual."""
    stand_in: CapturingProducer | None = None

    def producer_for_send() -> CapturingProducer | None:
        nonlocal stand_in
        if current_unit_of_work() is None or not backend_ignores_producer(app.backend):
            return None
        if stand_in is None:
            stand_in = CapturingProducer(app.connection_for_write())
        return stand_in

    return producer_for_send
