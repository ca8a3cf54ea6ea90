"""A delivery as the inbox sees it: the key of its inbox row, its attempt, and its envelope.

The key is (message id, destination, send id): the destination is the queue with message
identity ``id_and_destination`` (else ''); the send id is the publish identity the message
carries (``SEND_HEADER``), or one key per task when its task id is the dedupe key
(``deduplicate_task_ids``). The envelope is what recovery needs to publish the message again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kombu.serialization import dumps

from ..core.tenancy import TENANT_HEADER
from ..message import dead_letter_rows
from ..message.envelope import json_text, valid_send_id
from ..message.routing import queue_of
from ..monitoring import tracing
from ..vocabulary import REDELIVERY_HEADER, REPLAY_HEADER, SEND_HEADER, Attempt, header_count

__all__ = ["Delivery", "dead_letter_row", "envelope_of", "task_id_key"]


@dataclass(frozen=True)
class Delivery:
    """What the inbox needs to know of one delivered message."""

    message_id: str
    destination: str  # the key part: the queue, or '' with message identity "id"
    task_name: str
    queue: str
    retries: int
    nesting: int
    replays: int = 0
    redelivered: int = 0  # times delivery tracking re-sent this message (not part of the attempt)
    sent_as: str = ""  # the publish identity the message carries ('' from a sender without the outbox)
    send_id: str = ""  # the key part: ``sent_as``, or the task's own key when its task id is the dedupe key
    #: the task acks late (``acks_late``): the broker holds the message until the attempt ends, so a
    #: ``Reject(requeue=True)`` or a store outage's send-back hands it back; else Celery acked it on receipt
    acks_late: bool = False
    #: the tenant whose store the delivery is claimed in (``TENANT_HEADER``); None: the default store
    tenant: str | None = None

    @classmethod
    def from_request(cls, task: Any, settings: Any, queue: str | None = None) -> "Delivery":
        return cls.from_context(task, task.request, settings, queue)

    @classmethod
    def from_context(cls, task: Any, request: Any, settings: Any, queue: str | None = None) -> "Delivery":
        """The delivery a task's request context (``task.request``, or a worker Request's context) names;
        ``queue`` when the caller resolved it already (``routing.queue_of``)."""
        if queue is None:
            queue = queue_of(request.delivery_info, task.app, settings.durable_queues) or ""
        sent_as = valid_send_id(getattr(request, SEND_HEADER, None))
        by_task_id = getattr(task, "deduplicate_task_ids", None)
        by_task_id = settings.deduplicate_task_ids if by_task_id is None else bool(by_task_id)
        return cls(
            message_id=str(request.id),
            destination=settings.destination_of(queue) or "",
            sent_as=sent_as,
            send_id=task_id_key(task.name) if by_task_id else sent_as,
            task_name=task.name,
            queue=queue,
            retries=int(request.retries or 0),
            nesting=int(getattr(request, "replaced_task_nesting", 0) or 0),
            replays=header_count(getattr(request, REPLAY_HEADER, 0)),
            redelivered=header_count(getattr(request, REDELIVERY_HEADER, 0)),
            acks_late=bool(getattr(task, "acks_late", False)),
            tenant=getattr(request, TENANT_HEADER, None) or None,
        )

    @property
    def attempt(self) -> Attempt:
        return Attempt(self.nesting, self.replays, self.retries)

    def key(self) -> dict[str, Any]:
        return {"message_id": self.message_id, "destination": self.destination, "send_id": self.send_id}


def task_id_key(task_name: str) -> str:
    """The key part of every send of ``task_name`` when its task id is the dedupe key
    (``deduplicate_task_ids``): one per task, so a message of another task with the same id is
    still a message of its own, never discarded as a duplicate."""
    return "task:" + hashlib.sha1(task_name.encode("utf-8", "surrogatepass")).hexdigest()


def envelope_of(task: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The columns that let a delivery be published again: body, headers, routing."""
    request = task.request
    serializer = task.serializer or task.app.conf.task_serializer
    content_type, content_encoding, body = dumps([list(args), dict(kwargs), {}], serializer=serializer)
    if isinstance(body, str):
        body = body.encode(content_encoding or "utf-8")
    headers = {
        "id": request.id, "task": task.name, "retries": request.retries or 0,
        "replaced_task_nesting": getattr(request, "replaced_task_nesting", 0) or 0,
        "root_id": request.root_id, "parent_id": request.parent_id, "group": request.group,
        "eta": request.eta, "expires": request.expires, "origin": getattr(request, "origin", None),
        REPLAY_HEADER: header_count(getattr(request, REPLAY_HEADER, 0)),
        SEND_HEADER: valid_send_id(getattr(request, SEND_HEADER, None)) or None,
        **tracing.carried(request),
    }
    tenant = getattr(request, TENANT_HEADER, None)
    if tenant:
        headers[TENANT_HEADER] = tenant
    delivery_info = request.delivery_info or {}
    return {
        "exchange": delivery_info.get("exchange") or "",
        "routing_key": delivery_info.get("routing_key") or "",
        "body": body,
        "content_type": content_type,
        "content_encoding": content_encoding,
        "headers": json_text(headers),
        "properties": json_text({"priority": delivery_info.get("priority"), "correlation_id": request.id,
                                        "reply_to": request.reply_to}),
    }


def dead_letter_row(task: Any, delivery: Delivery, reason: "dead_letter_rows.DeadLetterReason", exc: BaseException,
                    now: datetime, description: str | None = None) -> dict[str, Any]:
    request = task.request
    return dead_letter_rows.dead_letter_row(
        reason=dead_letter_rows.DeadLetterReason(reason), failed_at=now, message_id=delivery.message_id,
        destination=delivery.destination, task_name=delivery.task_name, queue=delivery.queue, error=exc,
        description=description,
        retries=delivery.retries, nesting=delivery.nesting, replays=delivery.replays,
        **envelope_of(task, tuple(request.args or ()), dict(request.kwargs or {})),
    )
