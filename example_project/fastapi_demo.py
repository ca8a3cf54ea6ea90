"""The FastAPI shop under fire: ``python -m example_project.fastapi_demo`` (or ``tox -e fastapi-demo``).

The same fire as ``demo.py``, on the shop's async HTTP API (``shop/asgi.py``) served by uvicorn in
a process of its own: orders placed over HTTP by eight clients at once, each written with an
``AsyncSession`` inside ``outbox.atransaction()`` with its payment and cancellation messages; the
demo sends duplicates, SIGKILLs the payments worker in the middle, waits for the shop to settle and
prints a summary that checks itself. The exit code is 0 only when every invariant holds. (It ends
without the delivery audit: ``demo.py``'s runs it on the same tasks and messages.)

Runs on embedded defaults (SQLite through aiosqlite, and a filesystem broker: no server).
``--database-url`` (PostgreSQL, through psycopg's async mode; ``SHOP_ASYNC_DATABASE_URL`` in the
environment, ``postgresql+asyncpg://...``, for asyncpg) and ``--broker-url`` (Redis or RabbitMQ)
run it on real services.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from .demo import Process, Shop, main


class ASGIServer(Process):
    """uvicorn serving ``application`` on a free local port, once it answers."""

    def __init__(self, application: str, env: dict[str, str], log_dir: Path):
        with socket.socket() as probe:  # a port free now; uvicorn binds it with SO_REUSEADDR
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        super().__init__("uvicorn", ["uvicorn", application, "--host", "127.0.0.1", "--port", str(port),
                                     "--no-access-log"], env, log_dir)
        self.url = f"http://127.0.0.1:{port}"
        self.wait_for("Uvicorn running on")


class FastAPIShop(Shop):
    """The shop's tables and tasks, its HTTP API the async one (FastAPI on uvicorn)."""

    name = "celery-outbox FastAPI demo"
    command = "example_project.fastapi_demo"
    description = __doc__.splitlines()[0]
    clients = 8
    no_audit = "tox -e demo runs it, on the same messages"  # and its Spark run would double this demo's time
    asgi = "example_project.shop.asgi:api"

    def start(self) -> None:
        from example_project.shop.celery_app import app, outbox
        from example_project.shop.tasks import charge_payment

        self.app, self.outbox, self.charge_payment = app, outbox, charge_payment

    def serve(self, env: dict[str, str], log_dir: Path) -> ASGIServer:
        return ASGIServer(self.asgi, env, log_dir)


if __name__ == "__main__":
    sys.exit(main(shop=FastAPIShop()))
