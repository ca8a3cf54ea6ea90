"""The links a dead letter's result tells (``results._links``): the chord, chain and errbacks its
body embeds, read as Celery's worker reads them, and nothing from a body that cannot be read or
whose links have the wrong shape, with a warning naming the message and the result still stored.
An in-memory result backend; the behaviour against real workers is in
tests/integration/test_dead_letter_results.py."""

from __future__ import annotations

import logging

import pytest
from celery import Celery
from celery.exceptions import WorkerLostError
from kombu.serialization import dumps

from celery_outbox.message.results import EndedMessage, store_dead_letter_results
from celery_outbox.vocabulary import DeadLetterReason

from ...versions import CELERY


@pytest.fixture
def app():
    app = Celery("links", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.task_always_eager = True  # an errback sent as a task runs here, at once
    ran = []

    @app.task(name="links.record", shared=False)
    def record(task_id):
        ran.append(task_id)

    app.ran = ran
    return app


def ended(message_id, body, content_type="application/json", **headers) -> EndedMessage:
    """A message of task ``links.lost``: ``body`` as stored bytes, or a value to send as JSON."""
    if not isinstance(body, bytes):
        content_type, _, text = dumps(body, serializer="json")
        body = text.encode()
    return EndedMessage(message_id, "links.lost", {"id": message_id, "task": "links.lost", **headers}, {}, None,
                        body, content_type, "utf-8")


def test_the_errbacks_the_body_embeds_run(app):
    errback = dict(app.signature("links.record"))
    body = [[], {}, {"errbacks": [errback], "chain": None, "chord": None, "callbacks": None}]
    assert store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [ended("m1", body)]) == 1
    assert app.ran == ["m1"]
    assert isinstance(app.AsyncResult("m1").result, WorkerLostError)


def test_the_rest_of_the_chain_the_body_embeds_is_failed(app):
    following = dict(app.signature("links.record", options={"task_id": "next-1"}))
    body = [[], {}, {"errbacks": None, "chain": [following], "chord": None, "callbacks": None}]
    store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [ended("m2", body)])
    assert app.AsyncResult("next-1").state == "FAILURE"


def test_ignored_results_are_not_stored_but_the_errbacks_still_run(app):
    """A message sent with ``ignore_result=True``: as Celery's ``Request.store_errors`` from 5.6,
    no FAILURE is stored; before 5.6 Celery reads the task's ``ignore_result`` alone, and stores it."""
    errback = dict(app.signature("links.record"))
    body = [[], {}, {"errbacks": [errback], "chain": None, "chord": None, "callbacks": None}]
    message = ended("m3", body, ignore_result=True)
    ignored = CELERY >= (5, 6)
    assert store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [message]) == (0 if ignored else 1)
    assert app.ran == ["m3"] and app.AsyncResult("m3").state == ("PENDING" if ignored else "FAILURE")


@pytest.mark.parametrize("body, content_type, words", [
    (b"\x00not json", "application/json", "cannot be read"),
    ([[], {}, ["not", "a", "mapping"]], None, "not a mapping"),
    ([[], {}, {"errbacks": "links.record"}], None, "'errbacks' is not a list of signatures"),
    ([[], {}, {"chain": [1, 2]}], None, "'chain' is not a list of signatures"),
    ([[], {}, {"chord": ["x"]}], None, "'chord' is not a signature"),
    (b"\x80\x04pickled", "application/x-python-serialize", "cannot be read"),  # not in accept_content
])
def test_a_body_without_readable_links_still_stores_the_failure(app, caplog, body, content_type, words):
    message = ended("m4", body, content_type=content_type or "application/json")
    with caplog.at_level(logging.WARNING, logger="celery_outbox.results"):
        assert store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [message]) == 1
    assert isinstance(app.AsyncResult("m4").result, WorkerLostError)
    assert app.ran == []
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "links.lost[m4]" in warning and words in warning, warning


def test_hostile_headers_cannot_plant_links(app):
    """Links come from the body only, as in Celery: headers named like them are overridden."""
    errback = dict(app.signature("links.record"))
    message = ended("m5", [[], {}, {}], errbacks=[errback], chain=[errback], chord=errback)
    assert store_dead_letter_results(app, DeadLetterReason.WORKER_LOST, [message]) == 1
    assert app.ran == []
