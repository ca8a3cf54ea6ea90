"""Real Celery objects the unit tests of Celery's internals share: task messages as the memory
broker delivers them, a worker's request of one, and a producer that records its publishes."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery, Task
from celery.worker.request import Request


class RecordingProducer:
    """Stands in for a kombu Producer: records each publish (what ``envelope.capture`` relies on)."""

    def __init__(self, connection: Any = None):
        self.connection = connection
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.calls.append((body, kwargs))

    def revive(self, channel: Any) -> None:
        pass


def task_message(app: Celery, name: str = "t.add", sent_event: bool = False, **options: Any) -> Any:
    return app.amqp.create_task_message(str(uuid.uuid4()), name, (1, 2), {}, create_sent_event=sent_event, **options)


def delivered(app: Celery, name: str = "t.add", **options: Any) -> Any:
    """A task message as the worker receives it: published to and read from the memory broker."""
    message = task_message(app, name, **options)
    with app.connection_for_write() as conn:
        queue = app.amqp.queues[app.conf.task_default_queue]
        with app.amqp.Producer(conn) as producer:
            app.amqp.send_task_message(producer, name, message, queue=queue, declare=[queue])
        received = queue.bind(conn.default_channel).get(accept=["json"])
    assert received is not None
    return received


def request_of(app: Celery, task: Task, cls: type = Request, **options: Any) -> Request:
    message = delivered(app, task.name, **options)
    return cls(message, app=app, task=task, on_ack=lambda *a: None, on_reject=lambda *a: None,
               hostname="w@hooks", eventer=None)
