"""What the admin's pages read and offer whatever messages hold, on SQLite and PostgreSQL (Django's
test client: what the pages read, not how they look): a bounded prefix of each dead letter's body,
never the bodies themselves; arguments decoded each to a bounded length, and a body pickled
never unpickled; a task filter of the app's registered tasks and one ``other``."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from celery_outbox.django.admin import SHOWN_BODY
from celery_outbox.django.letter_html import DECODED_BODY
from celery_outbox.message.dead_letter_contents import SHOWN_ARGUMENTS, SHOWN_VALUE
from celery_outbox.message.dead_letter_rows import dead_letter_row
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import DeadLetterReason

pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True)]

BODY_SIZE = 2_000_000
LETTERS = 5


def columns_read_whole(sql: str, column: str) -> bool:
    """Whether ``sql`` reads ``column`` itself, not only its prefix or its length."""
    outside = re.sub(r"(SUBSTR(?:ING)?|LENGTH)\([^()]*\)", "", sql, flags=re.I)
    return f'"{column}"' in outside


def test_the_list_and_a_letters_page_read_at_most_a_prefix_of_each_body(shop, settings, django_user_model, client):
    settings.CELERY_OUTBOX_DJANGO_DATABASE = shop.using
    store = shop.outbox.store
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(
            reason=DeadLetterReason.FAILED, failed_at=utcnow(), message_id=f"heavy-{n}", task_name="shop.pay",
            queue=shop.durable, body=b"x" * BODY_SIZE, content_type="application/json", content_encoding="utf-8",
            error=ValueError("declined")) for n in range(LETTERS)])
    letter_id = store.list_dead_letters(store.dead_letter_filter())[0].id
    django_user_model.objects.create_superuser("admin", password="celery-outbox")
    client.login(username="admin", password="celery-outbox")
    with CaptureQueriesContext(connections[shop.using]) as listed:
        page = client.get("/admin/celery_outbox/deadletter/")
    assert page.status_code == 200
    assert page.content.count(b'<td class="field-shown_task_name">shop.<wbr>pay') == LETTERS
    letters_sql = [q["sql"] for q in listed.captured_queries if "dead_letters" in q["sql"]]
    assert letters_sql and not any(columns_read_whole(sql, "body") for sql in letters_sql), letters_sql
    assert len(page.content) < BODY_SIZE, "the list carries no body"

    with CaptureQueriesContext(connections[shop.using]) as shown:
        detail = client.get(f"/admin/celery_outbox/deadletter/{letter_id}/change/")
    assert detail.status_code == 200
    assert not any(columns_read_whole(q["sql"], "body") for q in shown.captured_queries if "dead_letters" in q["sql"])
    text = detail.content.decode()
    assert "x" * SHOWN_BODY in text and "x" * (SHOWN_BODY + 1) not in text
    assert f"{BODY_SIZE - SHOWN_BODY:,} more bytes ({BODY_SIZE:,} in all)" in text
    assert f"The body has {BODY_SIZE:,} bytes: only bodies up to {DECODED_BODY:,} bytes are decoded" in text


def test_the_task_filter_lists_registered_tasks_and_one_other(shop, settings, django_user_model, client):
    """300 letters naming 300 tasks the app does not register, beside its own task's: the filter
    offers that task and ``other``, and ``other`` finds the 300."""
    settings.CELERY_OUTBOX_DJANGO_DATABASE = shop.using
    store = shop.outbox.store
    names = [shop.pay.name, *(f"evil.{n}" for n in range(300))]
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(reason=DeadLetterReason.UNKNOWN_TASK, failed_at=utcnow(),
                                                         message_id=f"named-{n}", task_name=name)
                                         for n, name in enumerate(names)])
    django_user_model.objects.create_superuser("admin", password="celery-outbox")
    client.login(username="admin", password="celery-outbox")
    page = client.get("/admin/celery_outbox/deadletter/").content.decode()
    offered = sorted(set(re.findall(r'href="\?task=([^"&]+)"', page)))
    assert offered == sorted([shop.pay.name, "other"]), offered
    others = client.get("/admin/celery_outbox/deadletter/?task=other&all=")
    assert others.status_code == 200 and "300 dead letters" in others.content.decode()


def letter_page(shop, settings, django_user_model, client, body: bytes, content_type: str) -> str:
    """The page of a new dead letter of ``body``, as a superuser reads it."""
    settings.CELERY_OUTBOX_DJANGO_DATABASE = shop.using
    store = shop.outbox.store
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(
            reason=DeadLetterReason.FAILED, failed_at=utcnow(), message_id="odd", task_name="shop.pay",
            queue=shop.durable, body=body, content_type=content_type, content_encoding="utf-8",
            error=ValueError("declined"))])
    (letter,) = store.list_dead_letters(store.dead_letter_filter())
    django_user_model.objects.create_superuser("admin", password="celery-outbox")
    client.login(username="admin", password="celery-outbox")
    page = client.get(f"/admin/celery_outbox/deadletter/{letter.id}/change/")
    assert page.status_code == 200
    return page.content.decode()


def arguments_of(page: str) -> str:
    (table,) = re.findall(r'<table class="outbox-arguments">.*?</table>', page, flags=re.S)
    return table


def test_a_letters_arguments_are_decoded_each_to_a_bounded_length(shop, settings, django_user_model, client):
    """Protocol 2's ``[args, kwargs, embed]``: each argument's ``repr`` cut to ``SHOWN_VALUE``
    characters, at most ``SHOWN_ARGUMENTS`` of each kind, and what was left out counted."""
    args = ["a" * 10_000, *range(SHOWN_ARGUMENTS + 20)]
    kwargs = {"note": "n" * 1_000, **{f"k{n}": n for n in range(SHOWN_ARGUMENTS + 10)}}
    body = json.dumps([args, kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    table = arguments_of(letter_page(shop, settings, django_user_model, client, body.encode(), "application/json"))
    cut = "&#x27;" + "a" * (SHOWN_VALUE - 1)  # the repr's opening quote, escaped, and the first letters
    assert f"{cut}… ({10_002 - SHOWN_VALUE:,} more characters)" in table
    assert "a" * SHOWN_VALUE not in table
    assert "<th>note=</th>" in table and f"{'n' * (SHOWN_VALUE - 1)}… ({1_002 - SHOWN_VALUE:,} more" in table
    assert table.count("<tr>") == 2 * SHOWN_ARGUMENTS + 2
    assert f"{len(args) - SHOWN_ARGUMENTS:,} more positional arguments" in table
    assert f"{len(kwargs) - SHOWN_ARGUMENTS:,} more named arguments" in table


SPRUNG: list[str] = []


def spring(tag: str) -> str:
    """What a pickled body runs when it is unpickled."""
    SPRUNG.append(tag)
    return tag


class Trap:
    def __reduce__(self):
        return spring, ("unpickled",)


def test_a_pickled_body_is_shown_raw_never_unpickled(shop, settings, django_user_model, client):
    body = pickle.dumps(((Trap(),), {}, {}))
    page = letter_page(shop, settings, django_user_model, client, body, "application/x-python-serialize")
    assert SPRUNG == [], "the page unpickled the body"
    assert "the body is application/x-python-serialize: only JSON, msgpack and YAML bodies are decoded" in page
    assert "class=\"outbox-raw\"" in page, "the raw body is shown"
