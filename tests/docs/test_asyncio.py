"""docs/asyncio.md's snippets, run from its Markdown in a process of their own: the page's shop (on
SQLite and a broker in memory where the page has PostgreSQL and Redis), its ``atransaction()``,
``abegin()`` and joined-AsyncSession functions, a rolled-back block, its FastAPI dependency served
through httpx, and its two ways of choosing the async engine. Each function's order commits and its
payment is published once, in call order; the rolled-back one publishes nothing."""

from __future__ import annotations

import json

from ..markdown import blocks, titled

PAGE = "docs/asyncio.md"
UNITS = blocks(PAGE, "The units of work")
ENGINE = blocks(PAGE, "The async engine")
FASTAPI = blocks(PAGE, "FastAPI")
DJANGO = blocks(PAGE, "Django's async views")

# where the page has PostgreSQL and Redis on their default ports: SQLite, and kombu's memory transport
SERVICES = {"redis://localhost:6379/0": "memory://",
            "postgresql+psycopg://shop@localhost/shop": "sqlite:///shop.sqlite3"}

CHECK = """\
import asyncio
import json

import httpx
from sqlalchemy import select

from shop import Base, Order, app, charge_payment, outbox

{snippets}


def published() -> list:
    with app.connection() as connection:
        queue = connection.SimpleQueue("payments", no_ack=True)
        args = []
        while True:
            try:
                args.append(json.loads(queue.get(timeout=0.1).body)[0][0])
            except queue.Empty:
                return args


async def main() -> dict:
    steps = {{}}
    await place_order(1)
    steps["atransaction"] = published()
    await place_order_core(2)
    steps["abegin"] = published()
    await place_order_in_my_session(3)
    steps["own session"] = published()
    try:
        async with outbox.atransaction() as session:
            session.add(Order(id=4, amount="1.00"))
            charge_payment.delay(4)
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    steps["rolled back"] = published()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://shop") as client:
        reply = await client.post("/orders/5")
    steps["fastapi"] = [reply.status_code, reply.json(), published()]
    async with outbox.atransaction() as session:
        steps["orders"] = list((await session.scalars(select(Order.id).order_by(Order.id))).all())
    return steps


Base.metadata.create_all(outbox.engine)
print(json.dumps(asyncio.run(main())))
"""

# each engine snippet on an app of its own, on the page's PostgreSQL URL (no connection is made)
ENGINES = """\
from celery import Celery

from celery_outbox import Outbox

for snippet in {snippets!r}:
    app = Celery("engines")
    app.conf.outbox_database_url = "postgresql+psycopg://shop@localhost/shop"
    scope = {{"app": app, "Outbox": Outbox}}
    exec(snippet, scope)
    outbox = scope.get("outbox") or Outbox(app)
    engine = outbox.async_engine
    print(engine.url.drivername, engine.pool.size())
"""


def test_the_pages_units_of_work_publish_after_their_commit_and_never_after_a_rollback(shell):
    shop = titled(UNITS, "shop.py").code
    for page_url, local_url in SERVICES.items():
        assert page_url in shop, page_url
        shop = shop.replace(page_url, local_url)
    (shell.cwd / "shop.py").write_text(shop)
    functions = [block.code for block in UNITS if block.language == "python" and block.title is None]
    assert len(functions) == 3, "atransaction(), abegin() and the joined AsyncSession"
    [fastapi] = [block.code for block in FASTAPI if block.language == "python"]
    (shell.cwd / "check.py").write_text(CHECK.format(snippets="\n\n".join([*functions, fastapi])))

    steps = json.loads(shell.run("python check.py").strip().splitlines()[-1])
    assert steps == {"atransaction": [1], "abegin": [2], "own session": [3], "rolled back": [],
                     "fastapi": [201, {"order_id": 5}, [5]], "orders": [1, 2, 3, 5]}, steps


def test_the_pages_engine_choices_give_asyncpg():
    snippets = [block.code for block in ENGINE if block.language == "python"]
    assert len(snippets) == 2, "outbox_async_database_url, and an engine given to Outbox"
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ENGINES.format(snippets=snippets)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["postgresql+asyncpg 5", "postgresql+asyncpg 20"], done.stdout


def test_the_django_async_view_is_valid_python_around_a_sync_atomic_block():
    """Not run here (it needs a Django app with an ``Order`` model; the outbox inside
    ``transaction.atomic()`` is django.md's, run by test_django_setup): checked as Python."""
    [view] = [block for block in DJANGO if block.language == "python"]
    compile(view.code, view.title or "view", "exec")
    assert "await sync_to_async(place_order_atomically)" in view.code
    assert "with transaction.atomic():" in view.code
