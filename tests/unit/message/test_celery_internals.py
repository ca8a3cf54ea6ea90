"""One test per private Celery/kombu touch point of ``celery_outbox.message.celery_internals``: each pins the
Celery or kombu behaviour it relies on, with real Celery and kombu objects (the memory
transport; Redis where only a real transport batches), so that an upgrade that changes one of
them fails here, by name."""

from __future__ import annotations

import inspect
from contextvars import ContextVar

import pytest
from celery.worker.request import Request

from celery_outbox.message import celery_internals as hooks
from tests.versions import CELERY

from ..celery_objects import RecordingProducer, task_message


@pytest.mark.skipif(CELERY < (5, 7), reason="Celery 5.7 added AMQP._retry_publish and its ContextVar; "
                    "before it the hook sets a stand-in nothing reads")
def test_callback_publish_retry_is_what_makes_the_sender_retry_over_time(app):
    """Celery >= 5.7: inside ``AMQP._retry_publish`` the ContextVar is set and ``send_task_message``
    publishes through its own retry loop (``retry=False`` per try); ``without_callback_publish_retry``
    gives the one plain ``publish`` call the capture records."""
    from celery.app import amqp as celery_amqp

    assert isinstance(celery_amqp._callback_publish_retry, ContextVar)
    with app.connection_for_write() as conn:
        looping, plain = RecordingProducer(conn), RecordingProducer(conn)

        def send(producer: RecordingProducer) -> None:
            app.amqp.send_task_message(producer, "t.add", task_message(app), retry=True)

        def in_callback_publish() -> None:
            assert celery_amqp._callback_publish_retry.get() is True
            send(looping)
            with hooks.without_callback_publish_retry():
                send(plain)

        app.amqp._retry_publish(in_callback_publish)
    assert [kwargs["retry"] for _, kwargs in looping.calls] == [False], "Celery's own retry loop"
    assert [kwargs["retry"] for _, kwargs in plain.calls] == [True], "the call as the caller made it"


def test_send_task_message_publishes_once_with_the_keywords_the_capture_reads(app):
    """``envelope.capture`` records ``producer.publish(body, **kwargs)`` and splits the keywords into
    routing, sending options (``_SENDING_OPTIONS``) and properties."""
    producer = RecordingProducer()
    app.amqp.send_task_message(producer, "t.add", task_message(app))
    [(body, kwargs)] = producer.calls
    assert body == ((1, 2), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    timeouts = {"timeout", "confirm_timeout"} if CELERY >= (5, 5) else set()  # passed on since Celery 5.5
    assert {"exchange", "routing_key", "serializer", "compression", "retry", "retry_policy", "delivery_mode",
            "declare", "headers", *timeouts} <= set(kwargs)
    assert kwargs["headers"]["task"] == "t.add"


def test_store_errors_reads_the_messages_ignore_result_from_5_6():
    """``STORE_ERRORS_READS_THE_MESSAGE``: Celery's ``Request.store_errors`` reads the request's own
    ``ignore_result`` (the message's header) where it holds, the task's alone before."""
    source = inspect.getsource(Request.store_errors.fget)
    assert ("self._ignore_result" in source) is hooks.STORE_ERRORS_READS_THE_MESSAGE
    assert ("self.task.ignore_result" in source) is not hooks.STORE_ERRORS_READS_THE_MESSAGE
