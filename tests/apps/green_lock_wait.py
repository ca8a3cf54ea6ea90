"""Whether psycopg 3 lets other greenlets run while it waits for the server, in a process
monkey-patched first thing.

Run as ``python tests/apps/green_lock_wait.py LIBRARY`` (gevent or eventlet) with
``TEST_DATABASE_URL`` (a ``postgresql+psycopg://`` URL); ``PSYCOPG_WAIT_FUNC`` chooses
psycopg's wait function, as psycopg documents. Greenlet A takes an advisory lock in a
transaction and gives it back as soon as greenlet B has started waiting for it. B waits
with a server-side ``lock_timeout``: if psycopg's wait blocks the whole process, A never
runs again and B's wait ends in that timeout. Prints one JSON line: psycopg's wait function,
whether B got the lock, and B's error.
"""

# ruff: noqa: I001 - the patching import comes first, as in an application
from green_patch import LIBRARY, spawn  # patches the process (the script's directory is on sys.path)

import json  # noqa: E402 - after the monkey-patching, as an application does
import os  # noqa: E402
import threading  # noqa: E402

import psycopg  # noqa: E402
import psycopg.waiting  # noqa: E402

LOCK = 715_517  # the advisory lock both greenlets want
URL = os.environ["TEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")



def main() -> None:
    locked, b_waits, done = threading.Event(), threading.Event(), threading.Event()
    outcome = {"library": LIBRARY, "psycopg_wait": psycopg.waiting.wait.__name__, "b_got_lock": False,
               "b_error": None}

    def a() -> None:
        with psycopg.connect(URL) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK,))
            locked.set()
            b_waits.wait()  # B is about to wait on the server for the lock: let it go

    def b() -> None:
        try:
            locked.wait()
            with psycopg.connect(URL) as conn, conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '2s'")  # the server ends a wait nobody can end
                b_waits.set()
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK,))
                outcome["b_got_lock"] = True
        except psycopg.Error as exc:
            outcome["b_error"] = f"{type(exc).__name__}: {exc}".strip()
        finally:
            done.set()

    spawn(a)
    spawn(b)
    done.wait(60)
    print(json.dumps(outcome), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
