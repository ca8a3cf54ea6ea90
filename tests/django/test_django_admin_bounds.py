"""What the admin's pages read and offer whatever messages hold, on SQLite and PostgreSQL (Django's
test client: what the pages read, not how they look): a bounded prefix of each dead letter's body,
never the bodies themselves; a task filter of the app's registered tasks and one ``other``."""

from __future__ import annotations

import re

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from celery_outbox.dead_letter_rows import dead_letter_row
from celery_outbox.django.admin import SHOWN_BODY
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
    assert page.status_code == 200 and page.content.count(b"<td class=\"field-task_name\">shop.pay") == LETTERS
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
