"""Monkey-patching for the greenlet scripts (green_senders.py, green_lock_wait.py): imported first
thing, it patches the process for the library named as the script's first argument, as an
application does before it imports anything else."""

import sys

LIBRARY = sys.argv[1]
if LIBRARY == "gevent":
    from gevent import monkey

    monkey.patch_all()
elif LIBRARY == "eventlet":
    import eventlet

    eventlet.monkey_patch()
else:
    raise SystemExit(f"unknown greenlet library {LIBRARY!r}")


def spawn(function, *args):
    """Start ``function(*args)`` in a new greenlet of the library."""
    if LIBRARY == "gevent":
        import gevent

        return gevent.spawn(function, *args)
    return eventlet.spawn(function, *args)
