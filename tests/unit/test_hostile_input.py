"""Hostile input on the consumer side: any envelope, header shape, text or id is judged without an
exception, and every dead-letter row built from it is accepted by a real INSERT (SQLite and
PostgreSQL). A store that cannot be reached sends the message back from the consumer's timer,
without sleeping; a row the database refuses for its content is stored reduced, never retried."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import Connection

from celery_outbox.consumer import guard
from celery_outbox.consumer.guard import tolerate_any_envelope
from celery_outbox.errors import UnstorableMessage
from celery_outbox.message.checks import body_reason, dead_letter_row_of, malformed_reason, store_limits_reason
from celery_outbox.message.dead_letter_rows import dead_letter_row, stored_text
from celery_outbox.message.envelope import OutgoingMessage, check_storable
from celery_outbox.store import build_tables, text_problem, utcnow
from celery_outbox.vocabulary import REQUEUE_BACKOFF, DeadLetterReason

KNOWN = {"t.add"}
HEADER_NAMES = ["task", "id", "retries", "replaced_task_nesting", "root_id", "eta", "timelimit", "compression",
                "group_index", "shadow"]

# any code point: NUL, control characters and lone surrogates included
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
huge_text = st.text(st.characters(exclude_categories=()), min_size=250, max_size=400)
texts = st.one_of(any_text, huge_text, st.sampled_from(["t.add", "a\x00b", "\ud800", "x" * 300]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**31), st.floats(), texts,
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=3), st.dictionaries(texts, children, max_size=3)), max_leaves=8)
headers = st.one_of(
    values,  # not a mapping at all, mostly
    st.dictionaries(st.one_of(st.sampled_from(HEADER_NAMES), texts), values, max_size=5),
    st.fixed_dictionaries({"task": st.one_of(st.just("t.add"), texts), "id": st.one_of(texts, huge_text)},
                          optional={"retries": values, "root_id": values, "timelimit": values}),
)
delivery_info = st.one_of(values, st.fixed_dictionaries(
    {}, optional={"exchange": st.one_of(st.just(""), values), "routing_key": st.one_of(st.just("q"), values),
                  "priority": values}))
properties = st.one_of(values, st.fixed_dictionaries(
    {}, optional={"delivery_tag": st.one_of(st.uuids().map(str), values), "delivery_info": delivery_info,
                  "body_encoding": st.one_of(st.just("base64"), values), "priority": values,
                  "correlation_id": values, "reply_to": values}))
envelopes = st.one_of(values, st.fixed_dictionaries(
    {"headers": headers, "properties": properties},
    optional={"body": st.one_of(st.just("W1tdLCB7fSwge31d"), texts, values), "content-type": values,
              "content-encoding": values}))

hostile = settings(max_examples=60, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def channel():
    """A virtual transport's channel (kombu's memory transport builds messages like Redis's)."""
    with Connection("memory://") as connection:
        channel = connection.channel()
        tolerate_any_envelope(channel)
        yield channel
        channel.close()


def insert(store, row) -> None:
    with store.begin() as conn:
        store.insert_dead_letters(conn, [row])


def verdict_of(message) -> tuple[DeadLetterReason, str]:
    """What the guard would decide, short of the queue's durability: never None here."""
    if message.envelope_fault is not None:
        return DeadLetterReason.MALFORMED, message.envelope_fault
    verdict = malformed_reason(message.headers, KNOWN)
    if verdict is None:
        verdict = store_limits_reason(message.headers) or body_reason(message)
    return verdict or (DeadLetterReason.MALFORMED, "a description")


@hostile
@given(envelope=envelopes)
def test_any_envelope_becomes_a_message_judged_and_dead_lettered_by_a_real_insert(store, channel, envelope):
    message = channel.Message(envelope, channel=channel)
    assert isinstance(message.headers, dict) and isinstance(message.delivery_info, dict)
    reason, description = verdict_of(message)
    insert(store, dead_letter_row_of(message, reason, description))


@hostile
@given(value=headers)
def test_any_header_shape_is_judged_without_an_exception(value):
    verdict = malformed_reason(value, KNOWN)
    if verdict is None:
        store_limits_reason(value)


@hostile
@given(message_id=values, task_name=values, queue=values, counts=st.lists(values, min_size=3, max_size=3),
       body=values, content_type=values, headers=values, properties=values, description=st.one_of(st.none(), texts))
def test_dead_letter_rows_of_any_values_are_accepted_by_a_real_insert(store, message_id, task_name, queue, counts,
                                                                      body, content_type, headers, properties,
                                                                      description):
    error = ValueError(description or "boom")
    insert(store, dead_letter_row(
        reason=DeadLetterReason.FAILED, failed_at=utcnow(), message_id=message_id, task_name=task_name, queue=queue,
        destination=queue, routing_key=queue, exchange=queue, error=error, description=description,
        retries=counts[0], nesting=counts[1], replays=counts[2], body=body, content_type=content_type,
        content_encoding=content_type, headers=headers, properties=properties))


OUTGOING = build_tables("hostile_").outgoing
fields = st.one_of(st.none(), st.just("t.add"), st.text(max_size=8), texts)


@given(message_id=fields, task_name=fields, destination=fields, exchange=fields, routing_key=fields,
       content_type=fields, content_encoding=fields)
@hostile
def test_a_message_is_refused_exactly_when_a_field_of_it_cannot_be_stored(message_id, task_name, destination,
                                                                          exchange, routing_key, content_type,
                                                                          content_encoding):
    """``check_storable`` checks every field at once first (ASCII text within its column's
    length, no NUL): whatever the values, it refuses a message exactly when ``text_problem``
    names a field of it, and its error names the first such field's problem."""
    given_fields = {"message_id": message_id, "task_name": task_name, "destination": destination,
                    "exchange": exchange, "routing_key": routing_key, "content_type": content_type,
                    "content_encoding": content_encoding}
    message = OutgoingMessage(**{name: (value or "") if name in ("task_name", "destination") else value
                                 for name, value in given_fields.items()},
                              body=b"", headers={}, properties={})
    problems = [problem for name in given_fields
                if (problem := text_problem(OUTGOING.c[name], getattr(message, name))) is not None]
    if not problems:
        check_storable(message, OUTGOING)
        return
    with pytest.raises(UnstorableMessage) as refused:
        check_storable(message, OUTGOING)
    assert problems[0] in str(refused.value)


def test_stored_text_escapes_what_a_database_rejects_and_cuts_to_the_size():
    assert stored_text("a\x00b\ud800c") == "a\\x00b\\ud800c"
    assert stored_text("x" * 300, 255) == "x" * 255
    assert stored_text("tab\tand\nnewline") == "tab\tand\nnewline"


@pytest.mark.parametrize("change, words", [
    ({"id": "x" * 256}, "header 'id' is 256 characters, the store holds at most 255"),
    ({"id": "bad\x00id"}, "header 'id' is 'bad\\x00id': NUL bytes"),
    ({"id": "\udcff"}, "lone surrogates"),
    ({"retries": 2**31}, "header 'retries' is 2147483648"),
    ({"celery_outbox_replay": 2**40}, "header 'celery_outbox_replay' is 1099511627776"),
    ({"celery_outbox_redelivery": 2**40}, "header 'celery_outbox_redelivery' is 1099511627776"),
])
def test_ids_and_counts_the_store_cannot_hold_are_named(change, words):
    headers = {"task": "t.add", "id": "abc", **change}
    assert malformed_reason(headers, KNOWN) is None, "plain Celery could run it"
    reason, description = store_limits_reason(headers)
    assert reason == "malformed" and words in description


@pytest.mark.parametrize("name", ["celery_outbox_replay", "celery_outbox_redelivery"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1, 1.5, "3", True])
def test_the_outboxs_own_counters_out_of_range_are_malformed(name, value):
    """A replay number or a redelivery count the outbox did not write (JSON allows Infinity)."""
    reason, description = malformed_reason({"task": "t.add", "id": "abc", name: value}, KNOWN)
    assert reason == "malformed" and f"header {name!r} is" in description and "whole number" in description


def test_an_id_of_255_characters_is_held():
    assert store_limits_reason({"task": "t.add", "id": "x" * 255}) is None


@pytest.mark.parametrize("body, words", [
    ('{"args": []}', "expected [args, kwargs, embed]"),
    ("[1, 2]", "expected [args, kwargs, embed]"),
    ('["x", {}, {}]', "args are 'x'"),
    ('[[], [], {}]', "kwargs are []"),
    ('[[], {}, 5]', "embed is 5"),
    ("\x00{", "body cannot be decoded"),
])
def test_bodies_that_are_not_a_task_call_are_named(channel, body, words):
    message = channel.Message({"body": body, "content-type": "application/json", "content-encoding": "utf-8",
                               "headers": {}, "properties": {"delivery_tag": "1"}}, channel=channel)
    reason, description = body_reason(message)
    assert reason == "malformed" and words in description


def test_a_task_call_body_passes(channel):
    message = channel.Message({"body": '[[1], {"a": 2}, null]', "content-type": "application/json",
                               "content-encoding": "utf-8", "headers": {}, "properties": {"delivery_tag": "1"}},
                              channel=channel)
    assert body_reason(message) is None


@pytest.mark.parametrize("envelope, words", [
    ({"headers": ["a", "list"], "properties": {"delivery_tag": "1"}}, "envelope 'headers' is ['a', 'list']"),
    ({"headers": "text", "properties": {"delivery_tag": "1"}}, "envelope 'headers' is 'text'"),
    ({"headers": {}, "properties": {}}, "no delivery tag"),
    ({"headers": {}, "properties": {"delivery_tag": "1", "delivery_info": [1]}}, "'delivery_info' is [1]"),
    ({"headers": {}, "properties": {"delivery_tag": "1", "body_encoding": "base64"}, "body": "a"},
     "the body cannot be decoded"),
    (["not", "an", "envelope"], "not a mapping"),
])
def test_an_envelope_kombu_cannot_read_is_built_and_carries_its_fault(channel, envelope, words):
    message = channel.Message(envelope, channel=channel)
    assert words in message.envelope_fault


def test_a_sound_envelope_carries_no_fault(channel):
    message = channel.Message({"headers": {"task": "t.add"}, "body": "e30=", "properties": {
        "delivery_tag": "1", "body_encoding": "base64", "delivery_info": {"exchange": "", "routing_key": "q"}}},
        channel=channel)
    assert message.envelope_fault is None and message.body == b"{}" and message.headers == {"task": "t.add"}


# -- the guard's store errors ----------------------------------------------------------------------


class FakeMessage:
    """A received message that records what the guard did with it."""

    def __init__(self, headers):
        self.headers, self.body, self.content_type, self.content_encoding = headers, b"[]", None, None
        self.delivery_info, self.properties = {"exchange": "", "routing_key": "q"}, {}
        self.acked, self.requeued = 0, 0

    def ack(self):
        self.acked += 1

    def reject(self, requeue=False):
        self.requeued += requeue


class FakeTimer:
    def __init__(self):
        self.entries = []

    def call_after(self, seconds, fun, args=()):
        self.entries.append((seconds, fun, args))


def fake_consumer():
    """A consumer with a timer and an app without a result backend (nothing to tell a caller)."""
    from celery import Celery

    return SimpleNamespace(timer=FakeTimer(), app=Celery("fake", set_as_current=False), event_dispatcher=None)


def fake_outbox(**parts):
    """An outbox with default settings (no durable queue) and no app."""
    from celery_outbox.core.config import OutboxSettings

    return SimpleNamespace(settings=OutboxSettings(), app=None, owner=None, **parts)


def no_sleep(seconds):
    raise AssertionError(f"the guard slept {seconds}s in the consumer")


def test_a_store_that_cannot_be_reached_requeues_from_the_timer_without_sleeping(monkeypatch):
    import time

    from sqlalchemy.exc import OperationalError

    def down(outbox, row, acknowledged):
        raise OperationalError("INSERT", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(guard, "_insert", down)
    monkeypatch.setattr(time, "sleep", no_sleep)
    consumer, message = fake_consumer(), FakeMessage({"task": "t.nope", "id": "1"})
    guard._dead_letter(fake_outbox(), consumer, message, DeadLetterReason.UNKNOWN_TASK, "not registered")
    assert (message.acked, message.requeued, len(consumer.timer.entries)) == (0, 0, 1)
    seconds, fun, args = consumer.timer.entries[0]
    fun(*args)
    assert seconds == REQUEUE_BACKOFF and (message.acked, message.requeued) == (0, 1)


def test_a_dead_letter_refused_for_its_content_is_stored_reduced_and_acked(store, monkeypatch):
    real_row = guard.dead_letter_row_of
    monkeypatch.setattr(guard, "dead_letter_row_of",  # a row not fitted to the table: refused by both databases
                        lambda *args: {**real_row(*args), "message_id": None})
    outbox = fake_outbox(ready=lambda: SimpleNamespace(store=store))
    consumer, message = fake_consumer(), FakeMessage({"task": "t.nope", "id": "1"})
    guard._dead_letter(outbox, consumer, message, DeadLetterReason.UNKNOWN_TASK, "not registered")
    assert (message.acked, message.requeued, consumer.timer.entries) == (1, 0, [])
    (letter,) = store.list_dead_letters(store.dead_letter_filter())
    assert letter.reason == "unknown_task" and "its dead letter was refused" in letter.exception_message


def test_a_dead_letter_refused_even_reduced_is_acked_not_requeued(monkeypatch):
    from sqlalchemy.exc import DataError

    def refused(outbox, row, acknowledged):
        raise DataError("INSERT", {}, ValueError("value out of range"))

    monkeypatch.setattr(guard, "_insert", refused)
    consumer, message = fake_consumer(), FakeMessage({"task": "t.nope", "id": "1"})
    guard._dead_letter(fake_outbox(), consumer, message, DeadLetterReason.UNKNOWN_TASK, "not registered")
    assert (message.acked, message.requeued, consumer.timer.entries) == (1, 0, [])
