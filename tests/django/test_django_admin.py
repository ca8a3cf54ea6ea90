"""The Django admin as the outbox's dashboard, in a real browser (Debian's headless Chromium,
driven by Selenium, in a 1,280 by 900 window) against a live server: dead letters listed in
columns that fit the window, filtered, shown with their arguments decoded, their traceback from
the user's first frame and their envelope; replayed and purged by a user with those permissions,
from the list or from a letter's page once confirmed, the messages counting in plurals; a user
with view rights alone changes nothing, and no change is made without a posted CSRF token;
outgoing and incoming messages, and the status page linked from the index and the list. A
screenshot of each page is kept in ``test-artifacts/django-admin/``."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission

from celery_outbox.django.letter_html import SHOWN_ID
from celery_outbox.message.dead_letter_rows import dead_letter_row, stored_dead_letter_row
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import DeadLetterReason

from ..brokers import receive, receive_until_marker
from ..browser import chromium, screenshot

# users and sessions live in the default database (SQLite); the outbox's tables in the database
# CELERY_OUTBOX_DJANGO_DATABASE names: the default one, or PostgreSQL ("pg")
pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True)]

PASSWORD = "celery-outbox"
WINDOW = "1280,900"


@pytest.fixture(scope="module")
def browser():
    with chromium(WINDOW) as driver:
        driver.implicitly_wait(5)
        yield driver


@pytest.fixture
def admin_shop(shop, settings):
    """The shop on Django's database ``using``, named by ``CELERY_OUTBOX_DJANGO_DATABASE`` (the
    database the admin reads, whose outbox its actions use), and one dead letter made from a real
    durable message and a real failure."""
    settings.CELERY_OUTBOX_DJANGO_DATABASE = shop.using
    shop.number = f"order-{uuid.uuid4().hex[:8]}"
    shop.letter_id = add_letter(shop, shop.number)
    return shop


def declined(number: str) -> None:
    """The user's code a letter's traceback ends in."""
    raise ValueError(f"card declined for {number}")


def add_letter(shop, number: str) -> int:
    """The id of a new dead letter of ``shop.pay`` for order ``number``: its durable message,
    stored and forwarded (and taken off the queue), with the error of a task that failed in
    Celery's tracer, as a worker's does (its traceback starts in Celery's frames)."""
    shop.pay.apply_async((number,), task_id=f"pay-{number}")
    receive(shop.app, shop.durable, 1)

    @shop.app.task(name=f"shop.charge_{number}", shared=False)
    def charge(number):
        declined(number)

    error = charge.apply((number,)).result
    store = shop.outbox.store
    outgoing = store.tables.outgoing
    with store.begin() as conn:
        row = conn.execute(outgoing.select().where(outgoing.c.message_id == f"pay-{number}")).one()
        store.insert_dead_letters(conn, [stored_dead_letter_row(
            row, reason=DeadLetterReason.FAILED, failed_at=utcnow(), queue=row.destination, error=error)])
    (letter,) = [letter for letter in store.list_dead_letters(store.dead_letter_filter())
                 if letter.message_id == f"pay-{number}"]
    return letter.id


def replay_counts(shop) -> list[tuple[int, int]]:
    return [(letter.id, letter.replay_count)
            for letter in shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())]


def user(django_user_model, name: str, *permissions: str, superuser: bool = False):
    account = django_user_model.objects.create_user(name, password=PASSWORD, is_staff=True, is_superuser=superuser)
    account.user_permissions.add(*Permission.objects.filter(content_type__app_label="celery_outbox",
                                                            codename__in=permissions))
    return account


def log_in(browser, live_server, name: str) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(f"{live_server.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys(name)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    browser.find_element(By.ID, "user-tools")  # waits (implicitly) until the admin's index says who is in


def shoot(browser, name: str, using: str) -> Path:
    return screenshot(browser, "django-admin", f"{name}-{using}")


def text(browser, by: str, value: str) -> str:
    """The text of the element ``by``/``value``, read again while the page re-renders it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda driver: driver.find_element(by, value).text or None)


def absent(browser, by: str, value: str) -> bool:
    """Whether the page (loaded) has no element ``by``/``value``: asked at once, not waited for."""
    browser.implicitly_wait(0)
    try:
        return not browser.find_elements(by, value)
    finally:
        browser.implicitly_wait(5)


def rows(browser) -> list[str]:
    """The text of each row of the change list, read again while the page re-renders it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def read(driver):
        return [row.text for row in driver.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")] or None

    return WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(read)


def run_action(browser, action: str, every: bool = False) -> None:
    """Run the list's ``action`` on its first row, or on ``every`` row."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.find_element(By.CSS_SELECTOR, "#action-toggle" if every else "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value(action)
    page = browser.find_element(By.TAG_NAME, "html")
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    # the page before the action may show an earlier action's answer: wait for the new page first
    WebDriverWait(browser, 30).until(staleness_of(page))
    browser.find_element(By.CSS_SELECTOR, "ul.messagelist")  # waits until the action's answer is shown


def open_section(browser, title: str) -> None:
    """Open the collapsed fieldset ``title`` of a letter's page (a ``<details>`` since Django 5.1,
    shown by a link before)."""
    from selenium.webdriver.common.by import By

    (section,) = [fieldset for fieldset in browser.find_elements(By.CSS_SELECTOR, "fieldset.collapse")
                  if title in fieldset.text]
    section.find_element(By.CSS_SELECTOR, "summary, a.collapse-toggle").click()


def no_horizontal_scroll(browser) -> bool:
    """Whether the page, and the change list's table if there is one, fit the window's width."""
    widths = browser.execute_script(
        "const page = document.documentElement, table = document.querySelector('#result_list');"
        "return [page.scrollWidth, page.clientWidth,"
        " table ? table.scrollWidth : 0, table ? table.parentElement.clientWidth : 0];")
    page_width, window_width, table_width, room = widths
    assert page_width <= window_width and table_width <= room, f"too wide: {widths}"
    return True


def test_an_operator_finds_shows_replays_and_purges_a_dead_letter(admin_shop, browser, live_server, django_user_model):
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter",
         "view_outgoingmessage", "view_incomingmessage")
    log_in(browser, live_server, "operator")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/?reason__exact=failed&task_name=shop.pay")
    (row,) = rows(browser)
    assert "ValueError" in row and "failed" in row
    assert text(browser, By.ID, "changelist-filter").count("reason") >= 1
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/")
    page = text(browser, By.ID, "content")
    assert f"card declined for {shop.number}" in page and "ValueError" in page
    open_section(browser, "Envelope")
    assert f'"id": "pay-{shop.number}"' in text(browser, By.ID, "content"), "the envelope's headers are shown"

    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    run_action(browser, "replay_selected")
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Replayed 1 dead letter"
    (replayed,) = receive(shop.app, shop.durable, 1)
    assert (replayed.id, replayed.args) == (f"pay-{shop.number}", [shop.number])
    letter = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())[0]
    assert letter.replay_count == 1

    run_action(browser, "purge_selected")
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Purged 1 dead letter"
    assert shop.outbox.store.count_dead_letters() == 0

    browser.get(f"{live_server.url}/admin/celery_outbox/outgoingmessage/")
    assert f"pay-{shop.number}" in text(browser, By.ID, "result_list")  # replayed: sent, unacknowledged
    shoot(browser, "outgoing", shop.using)
    browser.get(f"{live_server.url}/admin/celery_outbox/incomingmessage/")
    assert "incoming message" in text(browser, By.ID, "content").lower()
    shoot(browser, "incoming", shop.using)


def test_the_list_actions_count_the_letters_in_plurals(admin_shop, browser, live_server, django_user_model):
    from selenium.webdriver.common.by import By

    shop = admin_shop
    add_letter(shop, f"order-{uuid.uuid4().hex[:8]}")
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter")
    log_in(browser, live_server, "operator")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    assert len(rows(browser)) == 2
    run_action(browser, "replay_selected", every=True)
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Replayed 2 dead letters"
    assert len(receive(shop.app, shop.durable, 2)) == 2
    run_action(browser, "purge_selected", every=True)
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Purged 2 dead letters"
    assert shop.outbox.store.count_dead_letters() == 0


def test_a_letters_page_replays_and_purges_it_once_confirmed(admin_shop, browser, live_server, django_user_model):
    """Replay and Purge on a letter's page ask to confirm (the asking changes nothing), then do
    what the list's actions do and say so."""
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter")
    log_in(browser, live_server, "operator")
    letter_page = f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/"
    browser.get(letter_page)
    browser.find_element(By.ID, "outbox-replay").click()
    assert f"Replay dead letter {shop.letter_id}" in text(browser, By.ID, "outbox-confirm-question")
    shoot(browser, "dead-letter-replay-confirmation", shop.using)
    assert receive_until_marker(shop.app, shop.durable, f"marker-{uuid.uuid4().hex}") == [], "asking replays nothing"
    assert replay_counts(shop) == [(shop.letter_id, 0)]
    browser.find_element(By.ID, "outbox-confirm").click()
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Replayed 1 dead letter"
    assert browser.current_url == letter_page, "the replayed letter's page is shown again"
    (replayed,) = receive(shop.app, shop.durable, 1)
    assert (replayed.id, replayed.args) == (f"pay-{shop.number}", [shop.number])
    assert replay_counts(shop) == [(shop.letter_id, 1)]

    browser.find_element(By.ID, "outbox-purge").click()
    assert f"Purge dead letter {shop.letter_id}" in text(browser, By.ID, "outbox-confirm-question")
    assert replay_counts(shop) == [(shop.letter_id, 1)], "asking purges nothing"
    browser.find_element(By.ID, "outbox-confirm").click()
    assert text(browser, By.CSS_SELECTOR, "ul.messagelist") == "Purged 1 dead letter"
    assert browser.current_url == f"{live_server.url}/admin/celery_outbox/deadletter/"
    assert shop.outbox.store.count_dead_letters() == 0


def test_a_letters_page_shows_its_arguments_and_the_users_frames(admin_shop, browser, live_server,
                                                                 django_user_model):
    """The arguments decoded from the body, the traceback from the user's first frame (the library
    frames above it counted, the whole traceback a click away), the raw body a click away."""
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter")
    log_in(browser, live_server, "operator")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/")
    arguments = text(browser, By.CSS_SELECTOR, "table.outbox-arguments")
    assert arguments == f"0 '{shop.number}'", arguments
    shown = text(browser, By.CSS_SELECTOR, "div.field-shown_traceback pre.outbox-traceback")
    assert shown.startswith("Traceback (most recent call last):\n  [") and "hidden]" in shown, shown
    assert "frames of celery" in shown and "celery/app/trace.py" not in shown, shown
    assert "in declined" in shown and f"ValueError: card declined for {shop.number}" in shown, shown
    whole = browser.find_element(By.CSS_SELECTOR, "details.outbox-full-traceback")
    assert "trace_task" not in whole.text, "the whole traceback waits for a click"
    shoot(browser, "dead-letter", shop.using)
    whole.find_element(By.TAG_NAME, "summary").click()
    assert "celery/app/trace.py" in text(browser, By.CSS_SELECTOR, "details.outbox-full-traceback pre")
    assert "in declined" in whole.text

    open_section(browser, "Envelope")
    raw = text(browser, By.CSS_SELECTOR, "div.field-shown_body pre")
    assert raw.startswith(f'[["{shop.number}"], {{}}'), raw
    assert no_horizontal_scroll(browser)
    browser.execute_script("document.querySelector('div.field-shown_traceback').scrollIntoView()")
    shoot(browser, "dead-letter-traceback", shop.using)


def test_the_list_fits_a_1280_pixel_window_with_task_ids_times_and_dates(admin_shop, browser, live_server,
                                                                        django_user_model):
    """Long task names, ids and exception names beside the letter of a real message, replayed: the
    results table needs no horizontal scroll; task ids, failure and replay times and the date
    hierarchy of the failures are shown."""
    from selenium.webdriver.common.by import By

    shop = admin_shop
    store = shop.outbox.store
    with store.begin() as conn:
        store.insert_dead_letters(conn, [dead_letter_row(
            reason=DeadLetterReason.UNKNOWN_TASK, failed_at=utcnow(), message_id=str(uuid.uuid4()),
            task_name="shop.payments.tasks.charge_the_card_of_an_order_placed_by_a_returning_customer",
            queue="payments_" + "q" * 80, error=ConnectionRefusedError("no route to the card processor"))])
        store.mark_replayed(conn, [shop.letter_id], utcnow())
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter")
    log_in(browser, live_server, "operator")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    assert len(rows(browser)) == 2
    headers = text(browser, By.CSS_SELECTOR, "#result_list thead").split("\n")
    assert {"FAILED", "TASK ID", "REPLAYED"} <= {header.strip() for header in headers}, headers
    ids = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#result_list td.field-shown_task_id")]
    assert f"pay-{shop.number}"[:SHOWN_ID - 1] + "…" in ids, ids
    failed = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#result_list td.field-shown_failed_at")]
    assert all(moment.startswith(f"{utcnow().year}-") for moment in failed), failed
    replayed = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "#result_list td.field-shown_replayed_at")]
    assert replayed[0] == "-" and replayed[1].startswith(f"{utcnow().year}-") and replayed[1].endswith("(1×)"), replayed
    hierarchy = text(browser, By.CSS_SELECTOR, ".toplinks")
    assert str(utcnow().year) in hierarchy, f"the date hierarchy offers the failures' dates: {hierarchy!r}"
    shoot(browser, "dead-letters", shop.using)
    assert no_horizontal_scroll(browser)


def test_the_status_page_is_linked_from_the_index_and_the_list(admin_shop, browser, live_server, django_user_model):
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "viewer", "view_deadletter")
    log_in(browser, live_server, "viewer")
    browser.get(f"{live_server.url}/admin/")
    section = browser.find_element(By.CSS_SELECTOR, "#content-main .app-celery_outbox")
    section.find_element(By.LINK_TEXT, "Status").click()
    counts = text(browser, By.ID, "outbox-counts")
    assert "outgoing" in counts and shop.durable in counts
    assert "Oldest pending outgoing message" in text(browser, By.ID, "outbox-oldest")
    shoot(browser, "status", shop.using)

    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    browser.find_element(By.ID, "outbox-status-link").click()
    assert "dead letters" in text(browser, By.ID, "outbox-counts")
    assert browser.current_url == f"{live_server.url}/admin/celery_outbox/status/"


def test_a_user_with_view_rights_alone_can_change_nothing(admin_shop, browser, live_server, django_user_model, client):
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "viewer", "view_deadletter", "view_outgoingmessage", "view_incomingmessage")
    log_in(browser, live_server, "viewer")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    assert len(rows(browser)) == 1
    assert absent(browser, By.NAME, "action"), "no action is offered"
    shoot(browser, "dead-letters-view-only", shop.using)
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/")
    assert "card declined" in text(browser, By.ID, "content")
    assert absent(browser, By.CSS_SELECTOR, "input[type=submit][name=_save]"), "nothing to save"
    assert absent(browser, By.CSS_SELECTOR, "#outbox-replay, #outbox-purge"), "no Replay or Purge button"
    shoot(browser, "dead-letter-view-only", shop.using)

    client.login(username="viewer", password=PASSWORD)  # the forms posted by hand: refused all the same
    for action in ("replay_selected", "purge_selected"):
        client.post("/admin/celery_outbox/deadletter/", {"action": action, "_selected_action": [shop.letter_id]})
    for command in ("replay", "purge"):
        page = f"/admin/celery_outbox/deadletter/{shop.letter_id}/{command}/"
        assert client.get(page).status_code == 403
        assert client.post(page).status_code == 403
    assert replay_counts(shop) == [(shop.letter_id, 0)]
    assert receive_until_marker(shop.app, shop.durable, f"marker-{uuid.uuid4().hex}") == []


def test_a_letters_buttons_change_nothing_without_a_posted_csrf_token(admin_shop, django_user_model):
    """A GET asks to confirm (with the form and its CSRF token); a POST without the token is refused."""
    from django.test import Client

    shop = admin_shop
    user(django_user_model, "operator", "view_deadletter", "replay_deadletter", "purge_deadletter")
    client = Client(enforce_csrf_checks=True)
    client.login(username="operator", password=PASSWORD)
    for command in ("replay", "purge"):
        page = f"/admin/celery_outbox/deadletter/{shop.letter_id}/{command}/"
        asked = client.get(page)
        assert asked.status_code == 200 and b'name="csrfmiddlewaretoken"' in asked.content
        assert b'method="post"' in asked.content
        assert client.post(page).status_code == 403
    assert replay_counts(shop) == [(shop.letter_id, 0)]
    assert receive_until_marker(shop.app, shop.durable, f"marker-{uuid.uuid4().hex}") == []
