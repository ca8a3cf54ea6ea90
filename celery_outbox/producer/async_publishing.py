"""The publishing threads of async units of work: what they committed is published off the event loop.

Transaction boundary: none of its own; the work it runs is the ``Publisher``'s (its publish after a
commit, and its bookkeeping transactions on the store's sync engine). Guarantee: a publish handed
over is submitted to a bounded pool of threads (``outbox_async_publish_threads``) at once, before
the event loop runs anything else, and runs to its end whatever happens to the coroutine that
waits for it (a cancellation, the loop shutting down): the threads finish their work before the
interpreter exits. Publishes handed over one after another by one unit of work run in that order.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .publishing import Publisher

__all__ = ["AsyncPublishing", "wait_for"]


class AsyncPublishing:
    """A bounded pool of threads for ``publisher``'s blocking work, made on first use (again in a
    forked child: threads do not survive a fork)."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self._lock = threading.Lock()
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    @property
    def threads(self) -> int:
        return self.publisher.runtime.settings.async_publish_threads

    def _executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None or pool[0] != os.getpid():
            with self._lock:
                pool = self._pool
                if pool is None or pool[0] != os.getpid():
                    executor = ThreadPoolExecutor(self.threads, thread_name_prefix="celery-outbox-publish")
                    pool = self._pool = (os.getpid(), executor)
        return pool[1]

    def submit(self, work: Callable[..., Any], *args: Any, after: "Future[Any] | None" = None) -> "Future[Any]":
        """Run ``work(*args)`` in a publishing thread, after ``after`` (the unit of work's previous
        publish) has ended, so one unit's publishes keep their order. Submitted now: it runs even
        if nobody waits for it."""
        context = contextvars.copy_context()  # the caller's tenant goes with the work
        if after is None or after.done():
            return self._executor().submit(context.run, work, *args)

        def in_order() -> Any:
            try:
                after.result()
            except BaseException:  # noqa: BLE001 - the earlier publish reported its own error
                pass
            return context.run(work, *args)

        return self._executor().submit(in_order)

    async def run(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` in a publishing thread, awaited without blocking the loop."""
        return await wait_for(self.submit(work, *args))

    def ready(self) -> bool:
        """Whether the store is known to answer and no sender needs registering: the unit of work
        may begin without a blocking call."""
        runtime = self.publisher.runtime
        return runtime.is_ready and (not runtime.store.is_postgres or self.publisher.node.registered()
                                     or not runtime.settings.durable_queues)

    async def prepare(self) -> None:
        """Before an async unit of work begins: the store checked and the sender registered
        (``Runtime.ready``, ``Publisher.prepare_sender``), in a publishing thread the first time."""
        if not self.ready():
            await self.run(self._prepare)

    def _prepare(self) -> None:
        self.publisher.runtime.ready()
        self.publisher.prepare_sender()

    def shutdown(self) -> None:
        """Wait for the publishes handed over, then stop the threads."""
        pool, self._pool = self._pool, None
        if pool is not None and pool[0] == os.getpid():
            pool[1].shutdown(wait=True)


async def wait_for(future: "Future[Any]") -> Any:
    """The result of ``future`` (a publishing thread's), awaited; a cancellation of the waiter
    leaves the work running (it was submitted: it ends in its thread)."""
    return await asyncio.shield(asyncio.wrap_future(future))
