"""docs/tenancy.md's snippets, run from its Markdown in a process of their own on real PostgreSQL: the
page's shop with two tenants in databases of their own and one in a schema of the default store's
database (each made for the test), its unit of work for a tenant, its middleware, and its loop over
the tenants; then an in-process worker consumes what they sent. Each tenant's order and its
payment are in its own database, none in another's, and the default store has none."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from ..markdown import blocks, titled
from ..services import require

PAGE = "docs/tenancy.md"
MODELS = blocks(PAGE, "The models supported")
CHOSEN = blocks(PAGE, "How a tenant is chosen")
OPERATIONS = blocks(PAGE, "Operations")

CHECK = """\
import json
import threading

from celery import signals
from celery.contrib.testing.worker import start_worker
from sqlalchemy import select

from celery_outbox import TENANT_HEADER, using_tenant
from shop import app, metadata, outbox, payments

{snippets}


class Request:
    def __init__(self, tenant, body):
        self.headers, self.body = {{"X-Tenant": tenant}}, body


for tenant in (None, "acme", "globex", "initech"):
    with using_tenant(tenant):
        outbox.ready()
        metadata.create_all(outbox.engine)

place_order("acme", 1)
place_order("initech", 3)
with using_tenant("globex"), outbox.transaction() as session:
    session.execute(payments.insert().values(order_id=2, status="placed"))
tenant_middleware(handle)(Request("globex", b"2"))

ended = []
done = threading.Condition()


@signals.task_postrun.connect
def count(**_):
    with done:
        ended.append(1)
        done.notify_all()


app.conf.broker_transport_options = {{"polling_interval": 0.01}}
with start_worker(app, pool="solo", perform_ping_check=False, queues=["payments"]):
    with done:
        assert done.wait_for(lambda: len(ended) >= 3, 60), ended

seen = {{}}
for tenant in (None, "acme", "globex", "initech"):
    with using_tenant(tenant), outbox.store.begin() as conn:
        rows = conn.execute(select(payments.c.order_id, payments.c.status).order_by(payments.c.order_id)).all()
        inbox = conn.execute(select(outbox.store.tables.incoming.c.status)).scalars().all()
        seen[tenant or "default"] = {{"payments": [list(row) for row in rows], "inbox": inbox,
                                     "database": conn.exec_driver_sql("select current_database()").scalar_one(),
                                     "schema": conn.exec_driver_sql("select current_schema()").scalar_one()}}
print(json.dumps(seen))
"""


@pytest.fixture
def databases():
    """The default store's database and two tenant databases, made for the test and dropped after it."""
    url = require("postgres")
    admin = url.replace("postgresql+psycopg", "postgresql")
    names = {role: f"tenancy_{role}_{uuid.uuid4().hex[:8]}" for role in ("shop", "acme", "globex")}
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f"CREATE DATABASE {name}")
    base = url.rsplit("/", 1)[0]
    yield {role: f"{base}/{name}" for role, name in names.items()}, names
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_the_pages_tenants_each_store_and_consume_in_their_own_database(shell, databases):
    urls, names = databases
    shop = titled(MODELS, "shop.py").code
    replacements = {"redis://localhost:6379/0": "memory://",
                    **{f"postgresql+psycopg://shop@localhost/{role}": url for role, url in urls.items()}}
    for page_url, local_url in replacements.items():
        assert page_url in shop, page_url
        shop = shop.replace(page_url, local_url)
    (shell.cwd / "shop.py").write_text(shop)
    snippets = [block.code for block in CHOSEN if block.language == "python"]
    assert len(snippets) == 2, "the unit of work for a tenant, and the middleware"
    [loop] = [block.code for block in OPERATIONS if block.language == "python"]
    (shell.cwd / "check.py").write_text(CHECK.format(snippets="\n\n".join([*snippets, loop])))

    output = shell.run("python check.py", timeout=180)
    seen = json.loads(output.strip().splitlines()[-1])
    assert seen == {
        "default": {"payments": [], "inbox": [], "database": names["shop"], "schema": "public"},
        "acme": {"payments": [[1, "charged"]], "inbox": ["handled"], "database": names["acme"], "schema": "public"},
        "globex": {"payments": [[2, "charged"]], "inbox": ["handled"], "database": names["globex"],
                   "schema": "public"},
        "initech": {"payments": [[3, "charged"]], "inbox": ["handled"], "database": names["shop"],
                    "schema": "initech"},
    }, seen
    for tenant in ("acme", "globex", "initech"):
        assert f"{tenant} " in output, "the page's loop printed each tenant's outgoing counts"
