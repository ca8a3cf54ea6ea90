"""docs/django.md's setup, run as written from its Markdown: a project made by ``django-admin
startproject``, the docs' settings, ``proj/celery.py`` and ``proj/__init__.py``, ``migrate``; a
durable send inside ``transaction.atomic()`` stores its row. Without ``proj/__init__.py``'s import
the same send goes through Celery's default app: it warns once, naming the fix."""

from __future__ import annotations

import pytest
import redis

from ..markdown import blocks, titled
from ..markdown import shell as shell_blocks
from ..services import require

pytestmark = [pytest.mark.redis]

SETUP = blocks("docs/django.md", "Install")

# A durable send inside an atomic block, then the outbox's outgoing rows counted on Django's connection
SEND = """
from celery import shared_task
from django.db import connection, transaction

@shared_task(queue="payments", name="docs.charge")
def charge(order_id):
    return order_id

for _ in range(2):
    with transaction.atomic():
        charge.delay(1)
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM celery_outbox_outgoing")
    print("outgoing rows:", cursor.fetchone()[0])
"""


@pytest.fixture
def broker():
    """The docs' broker (Redis database 0), its ``payments`` queue emptied afterwards."""
    require("redis")
    yield
    redis.Redis.from_url("redis://127.0.0.1:6379/0").delete("payments")


def set_up(shell) -> None:
    install, migrate = (block.commands() for block in shell_blocks(SETUP))
    assert install[0].startswith("pip install"), install  # the install lines are tested in tests/install
    for command in install[1:]:
        shell.run(command)
    settings = shell.cwd / "proj" / "settings.py"
    settings.write_text(settings.read_text() + "\n" + titled(SETUP, "proj/settings.py").code)
    for name in ("proj/celery.py", "proj/__init__.py"):
        (shell.cwd / name).write_text(titled(SETUP, name).code)
    for command in migrate:
        shell.run(command)


def test_the_documented_setup_stores_a_durable_send_in_djangos_transaction(shell, broker):
    set_up(shell)
    out = shell.run(f"python manage.py shell -c '{SEND}'")
    assert "outgoing rows: 2" in out, out
    assert "OutboxBypassed" not in out, out


def test_a_process_that_never_imports_the_celery_module_warns_once_naming_the_fix(shell, broker):
    set_up(shell)
    (shell.cwd / "proj" / "__init__.py").write_text("")  # the line the docs say not to leave out
    # Celery's default app publishes to its own broker (amqp://localhost): kept off the real one
    out = shell.run(f"python manage.py shell -c '{SEND}'", env={"CELERY_BROKER_URL": "memory://"})
    assert "outgoing rows: 0" in out, out
    assert out.count("OutboxBypassed") == 1, out
    assert "from .celery import app as celery_app" in out, out
