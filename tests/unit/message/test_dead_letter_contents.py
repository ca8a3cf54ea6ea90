"""A dead letter's contents as a person reads them (``celery_outbox.dead_letter_contents``): the
arguments of protocol 1 and 2 bodies decoded and bounded, bodies that cannot or must not be
decoded refused with the reason; tracebacks trimmed to the user's frames in each link of a chain,
and shown whole when they have no frame of the user's."""

from __future__ import annotations

import json
import pickle
import zlib

from celery_outbox.message.dead_letter_contents import (
    SHOWN_ARGUMENTS,
    SHOWN_VALUE,
    Arguments,
    bounded,
    decoded_arguments,
    trimmed_traceback,
)

SITE = "/srv/app/.venv/lib/python3.12/site-packages"


def frame(path: str, name: str, source: str = "pass") -> str:
    return f'  File "{path}", line 7, in {name}\n    {source}\n'


def test_a_protocol_2_body_gives_its_positional_and_named_arguments():
    body = json.dumps([["order-1", 2], {"currency": "EUR"}, {"callbacks": None}]).encode()
    assert decoded_arguments(body, "application/json", "utf-8") == Arguments(
        positional=("'order-1'", "2"), named=(("currency", "'EUR'"),))


def test_a_protocol_1_body_gives_its_arguments_too():
    body = json.dumps({"task": "shop.pay", "id": "x", "args": ["order-1"], "kwargs": {}}).encode()
    assert decoded_arguments(body, "application/json", "utf-8") == Arguments(positional=("'order-1'",), named=())


def test_each_argument_and_their_number_are_bounded():
    body = json.dumps([["x" * 1000, *range(SHOWN_ARGUMENTS)], {"k" * 500: 1}, {}]).encode()
    arguments = decoded_arguments(body, "application/json", "utf-8")
    assert arguments.positional[0] == bounded("'" + "x" * 1000 + "'")
    assert arguments.positional[0].endswith(f"… ({1002 - SHOWN_VALUE:,} more characters)")
    assert len(arguments.positional) == SHOWN_ARGUMENTS and arguments.more_positional == 1
    assert arguments.named[0][0] == bounded("k" * 500)


def test_bodies_that_must_not_or_cannot_be_decoded_give_the_reason():
    pickled = pickle.dumps(((1,), {}, {}))
    assert "only JSON, msgpack and YAML" in decoded_arguments(pickled, "application/x-python-serialize", "binary")
    packed = zlib.compress(b'[[1], {}, {}]')
    assert "compressed" in decoded_arguments(packed, "application/json", "utf-8", {"compression": "zlib"})
    assert "cannot be decoded" in decoded_arguments(b"[[1], {", "application/json", "utf-8")
    assert "not a Celery task message" in decoded_arguments(b'{"a": 1}', "application/json", "utf-8")
    assert "not a Celery task message" in decoded_arguments(b'["a", "b", "c"]', "application/json", "utf-8")


def test_the_library_frames_at_the_top_are_hidden_and_counted():
    text = ("Traceback (most recent call last):\n"
            + frame(f"{SITE}/celery/app/trace.py", "trace_task", "R = retval = fun(*args, **kwargs)")
            + "                 ^^^^^^^^^^^^^^^^^^^^\n"
            + frame(f"{SITE}/celery_outbox/consumer/tasks.py", "__call__")
            + frame("/srv/app/shop/tasks.py", "pay", "charge(order)")
            + frame(f"{SITE}/kombu/utils.py", "helper")  # below the user's first frame: kept
            + "ValueError: declined\n")
    trimmed = trimmed_traceback(text)
    assert trimmed.hidden == 2 and trimmed.full == text
    assert trimmed.shown.splitlines() == [
        "Traceback (most recent call last):", "  [2 frames of celery, celery_outbox hidden]",
        '  File "/srv/app/shop/tasks.py", line 7, in pay', "    charge(order)",
        f'  File "{SITE}/kombu/utils.py", line 7, in helper', "    pass", "ValueError: declined"]


def test_each_traceback_of_a_chain_is_trimmed():
    link = "Traceback (most recent call last):\n" + frame(f"{SITE}/billiard/pool.py", "run") + frame(
        "/srv/app/shop/tasks.py", "pay")
    text = (link + "KeyError: 'card'\n\nDuring handling of the above exception, another exception occurred:\n\n"
            + link + "ValueError: declined\n")
    trimmed = trimmed_traceback(text)
    assert trimmed.hidden == 2 and trimmed.shown.count("[1 frame of billiard hidden]") == 2
    assert "During handling of the above exception" in trimmed.shown and "pool.py" not in trimmed.shown


def test_a_traceback_without_a_frame_of_the_users_is_shown_whole():
    text = "Traceback (most recent call last):\n" + frame(f"{SITE}/celery/app/trace.py", "trace_task") + "E: x\n"
    assert trimmed_traceback(text).shown == text.rstrip("\n") and trimmed_traceback(text).hidden == 0


def test_a_project_folder_named_like_a_library_is_not_a_library():
    text = ("Traceback (most recent call last):\n" + frame(f"{SITE}/celery/app/trace.py", "trace_task")
            + frame("/srv/celery/venv/lib/python3.12/site-packages/shop/tasks.py", "pay") + "E: x\n")
    trimmed = trimmed_traceback(text)
    assert trimmed.hidden == 1 and "shop/tasks.py" in trimmed.shown


def test_a_text_that_is_no_traceback_is_shown_as_it_is():
    trimmed = trimmed_traceback("ValueError: card declined")
    assert (trimmed.shown, trimmed.hidden) == ("ValueError: card declined", 0)
