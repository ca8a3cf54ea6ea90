"""The Django admin as the outbox's dashboard, in a real browser (Debian's headless Chromium,
driven by Selenium) against a live server: dead letters listed, filtered, shown with their
envelope and traceback, replayed and purged by a user with those permissions; a user with view
rights alone changes nothing; outgoing and incoming messages and the status page. A screenshot
of each page is kept in ``test-artifacts/django-admin/``."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission

from celery_outbox.dead_letter_rows import stored_dead_letter_row
from celery_outbox.store import utcnow
from celery_outbox.vocabulary import DeadLetterReason

from ..brokers import receive
from ..browser import chromium, screenshot

# users and sessions live in the default database (SQLite); the outbox's tables in the database
# CELERY_OUTBOX_DJANGO_DATABASE names: the default one, or PostgreSQL ("pg")
pytestmark = [pytest.mark.django_db(databases=["default", "pg"], transaction=True)]

PASSWORD = "celery-outbox"


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        driver.implicitly_wait(5)
        yield driver


@pytest.fixture
def admin_shop(shop, settings):
    """The shop on Django's database ``using``, named by ``CELERY_OUTBOX_DJANGO_DATABASE`` (the
    database the admin reads, whose outbox its actions use), and one dead letter made from a real
    durable message."""
    settings.CELERY_OUTBOX_DJANGO_DATABASE = shop.using
    number = f"order-{uuid.uuid4().hex[:8]}"
    shop.pay.apply_async((number,), task_id=f"pay-{number}")  # stored and forwarded
    (sent,) = receive(shop.app, shop.durable, 1)
    store = shop.outbox.store
    with store.begin() as conn:
        row = conn.execute(store.tables.outgoing.select()).one()
        store.insert_dead_letters(conn, [stored_dead_letter_row(
            row, reason=DeadLetterReason.FAILED, failed_at=utcnow(), queue=row.destination,
            error=ValueError(f"card declined for {number}"))])
    letter_id = store.list_dead_letters(store.dead_letter_filter())[0].id
    shop.number, shop.letter_id, shop.sent = number, letter_id, sent
    return shop


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


def rows(browser) -> list[str]:
    """The text of each row of the change list, read again while the page re-renders it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def read(driver):
        return [row.text for row in driver.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")] or None

    return WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(read)


def run_action(browser, action: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value(action)
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    browser.find_element(By.CSS_SELECTOR, "ul.messagelist")  # waits until the action's answer is shown


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
    shoot(browser, "dead-letters", shop.using)
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/")
    page = text(browser, By.ID, "content")
    assert f"card declined for {shop.number}" in page and "ValueError" in page
    assert f'"id": "pay-{shop.number}"' in page, "the envelope's headers are shown"
    shoot(browser, "dead-letter", shop.using)

    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    run_action(browser, "replay_selected")
    assert "replayed 1 dead letter(s)" in text(browser, By.CSS_SELECTOR, "ul.messagelist").lower()
    (replayed,) = receive(shop.app, shop.durable, 1)
    assert (replayed.id, replayed.args) == (f"pay-{shop.number}", [shop.number])
    letter = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())[0]
    assert letter.replay_count == 1

    run_action(browser, "purge_selected")
    assert "purged 1 dead letter(s)" in text(browser, By.CSS_SELECTOR, "ul.messagelist").lower()
    assert shop.outbox.store.count_dead_letters() == 0

    browser.get(f"{live_server.url}/admin/celery_outbox/outgoingmessage/")
    assert f"pay-{shop.number}" in text(browser, By.ID, "result_list")  # replayed: sent, unacknowledged
    shoot(browser, "outgoing", shop.using)
    browser.get(f"{live_server.url}/admin/celery_outbox/incomingmessage/")
    assert "incoming message" in text(browser, By.ID, "content").lower()
    shoot(browser, "incoming", shop.using)
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/status/")
    counts = text(browser, By.ID, "outbox-counts")
    assert "outgoing" in counts and shop.durable in counts
    assert "Oldest pending outgoing message" in text(browser, By.ID, "outbox-oldest")
    shoot(browser, "status", shop.using)


def test_a_user_with_view_rights_alone_can_change_nothing(admin_shop, browser, live_server, django_user_model, client):
    from selenium.webdriver.common.by import By

    shop = admin_shop
    user(django_user_model, "viewer", "view_deadletter", "view_outgoingmessage", "view_incomingmessage")
    log_in(browser, live_server, "viewer")
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/")
    assert len(rows(browser)) == 1
    assert not browser.find_elements(By.NAME, "action"), "no action is offered"
    shoot(browser, "dead-letters-view-only", shop.using)
    client.login(username="viewer", password=PASSWORD)  # the form posted by hand: refused all the same
    for action in ("replay_selected", "purge_selected"):
        client.post("/admin/celery_outbox/deadletter/", {"action": action, "_selected_action": [shop.letter_id]})
    letters = shop.outbox.store.list_dead_letters(shop.outbox.store.dead_letter_filter())
    assert [(letter.id, letter.replay_count) for letter in letters] == [(shop.letter_id, 0)]
    browser.get(f"{live_server.url}/admin/celery_outbox/deadletter/{shop.letter_id}/change/")
    assert not browser.find_elements(By.CSS_SELECTOR, "input[type=submit][name=_save]"), "nothing to save"
