"""Greenlets sending to a durable queue, in a process monkey-patched first thing.

Run as ``python tests/apps/green_senders.py LIBRARY MODE`` (``PYTHONPATH`` naming the
checkout) with ``TEST_BROKER_URL``, ``TEST_DATABASE_URL``, ``TEST_TABLE_PREFIX`` and
``TEST_QUEUE`` in the environment; ``TEST_POOL_LIMIT``, when set, is ``broker_pool_limit``.

LIBRARY is ``gevent`` or ``eventlet``. MODE is ``plain`` (plain Celery, no Outbox),
``outside`` (an Outbox, each ``delay`` outside a unit of work: store-and-forward) or
``transaction`` (an Outbox, each greenlet's sends in one ``outbox.transaction()``).
``GREENLETS`` greenlets each send ``MESSAGES`` messages with ``delay``; the main greenlet
waits for them until ``DEADLINE`` and prints one JSON line: the ids sent, how many greenlets
had not finished (blocked), the errors, the outgoing rows left unsent (Outbox modes), and
what the process ran on (patched socket, psycopg's wait function).
"""

# ruff: noqa: I001 - the patching import comes first, as in an application
from green_patch import LIBRARY, spawn  # patches the process (the script's directory is on sys.path)

import json  # noqa: E402
import sys  # noqa: E402 - after the monkey-patching, as an application does
import os  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

from celery import Celery  # noqa: E402

GREENLETS = 50
MESSAGES = 5
DEADLINE = 60.0  # seconds for every greenlet together; a blocked greenlet never finishes



def main() -> None:
    mode = sys.argv[2]
    queue = os.environ["TEST_QUEUE"]
    app = Celery(f"green_{queue}", broker=os.environ["TEST_BROKER_URL"], set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=False)
    if os.environ.get("TEST_POOL_LIMIT"):
        app.conf.broker_pool_limit = int(os.environ["TEST_POOL_LIMIT"])
    outbox = None
    if mode != "plain":
        from celery_outbox import Outbox

        app.conf.update(outbox_database_url=os.environ["TEST_DATABASE_URL"],
                        outbox_table_prefix=os.environ["TEST_TABLE_PREFIX"], outbox_durable_queues=[queue])
        outbox = Outbox(app)
        outbox.ready()

    @app.task(name="green.send", shared=False)
    def send(x):
        return x

    sent: list[str] = []
    errors: list[str] = []
    finished: list[int] = []
    all_finished = threading.Event()  # patched: a green event

    def sender(n: int) -> None:
        try:
            if mode == "transaction":
                with outbox.transaction():
                    ids = [send.delay(n * MESSAGES + i).id for i in range(MESSAGES)]
            else:
                ids = [send.delay(n * MESSAGES + i).id for i in range(MESSAGES)]
            sent.extend(ids)
        except BaseException as exc:  # noqa: BLE001 - reported in the summary
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            finished.append(n)
            if len(finished) == GREENLETS:
                all_finished.set()

    greenlets = [spawn(sender, n) for n in range(GREENLETS)]
    all_finished.wait(DEADLINE)
    summary = {
        "library": LIBRARY,
        "mode": mode,
        "greenlets": len(greenlets),
        "pool_limit": app.conf.broker_pool_limit,
        "socket_patched": socket.socket.__module__ != "socket",
        "blocked": GREENLETS - len(finished),
        "sent": sent,
        "errors": errors,
    }
    if outbox is not None:
        import psycopg.waiting

        from tests.conftest import unsent_rows

        summary["psycopg_wait"] = psycopg.waiting.wait.__name__
        summary["unsent_rows"] = unsent_rows(outbox.store)
    print(json.dumps(summary), flush=True)
    os._exit(0)  # a blocked greenlet would hold the interpreter's exit


if __name__ == "__main__":
    main()
