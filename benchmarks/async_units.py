"""asyncio: async units of work (``outbox.atransaction()``, ``outbox.abegin()``) against plain Celery
called from the same async code, against the sync units of work, and the event loop's lag under a
burst of them.

Every unit of work writes one row of the user's data (``producer_row.Orders``' table, on the
outboxes' PostgreSQL) and sends N tasks to Redis. The ways, taking turns in rounds (``in_rounds``),
each timed over a round's units of work, one after another:

* plain Celery, async: the row written in an ``AsyncSession`` (``async with session.begin():``, on a
  plain async engine, psycopg's async mode), committed, then N ``apply_async`` each called in the
  loop's default executor (``await loop.run_in_executor(None, ...)``), as asyncio code calls Celery
  today (``apply_async`` blocks on the broker's round trips);
* ``async with outbox.atransaction() as session:`` the row written through ``session`` and N
  ``apply_async`` to a plain queue (in-memory) and to a durable queue (durable: the messages' rows
  go in with the COMMIT), published after the commit by the publishing threads, the block ending
  once they are published;
* ``async with outbox.abegin() as conn:`` the same on an ``AsyncConnection``, durable;
* the sync units of work in the same rounds, on the benchmark's own thread (no event loop):
  ``with outbox.transaction() as session:`` in-memory and durable, ``with outbox.begin() as conn:``
  durable; and plain Celery's sync unit (``producer_row``'s plain way: ``engine.begin()``, then
  ``apply_async``), whose async way against it says what asyncio costs plain Celery itself.

Against plain Celery's async way: the ratio, no target. Against the sync unit of work of the same
kind (the ``vs peer`` block, the sync unit the peer): the target at N = 1, 0.9, with plain Celery's
async way as the in-memory unit's floor (an ``AsyncSession``'s commit, then the publish off the loop)
and, for the durable units, that way with the messages' rows written by hand in the row's
transaction (``Units.durable_floor``): the least any async unit of the same guarantee does. A floor
that misses the target says the target is beyond the async driver on this host.

Then the event loop's lag: a monitor coroutine sleeps 1 ms again and again and records how late it
wakes, while 1,000 units of work (one row, one task), 50 at a time, run on the same loop: the p99 of
its lateness. Ours (``atransaction()``, durable and in-memory) against plain Celery's async way
(``apply_async`` in an executor) and against ``apply_async`` called on the loop, which blocks it;
beside them, in the note, the lag of the same units writing their row and sending nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from functools import partial
from typing import Any, Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from celery_outbox import Outbox

from . import producer
from .common import POSTGRES_URL, REDIS_URL, Options, Result, in_rounds, percentile, rate
from .producer_row import Orders, captured_rows

BATCHES = (1, 10, 100)
# Rounds per N and units of work per way and round. At N = 1, the target's, sixteen rounds: the
# interval of a ratio is the 5th to the 12th round's (92%); at N = 10 eight (the 2nd to the 7th);
# at N = 100 five (the lowest to the highest)
ROUNDS = {1: 16, 10: 8, 100: 5}
UNITS = {1: 300, 10: 100, 100: 20}
TARGET = 0.9
WAYS = ("plain async", "atransaction in-memory", "atransaction durable", "abegin durable",
        "transaction in-memory", "transaction durable", "begin durable", "plain sync", "durable floor")
SYNC_UNIT = "the sync unit of work"

# The loop's lag: a burst of units of work (a size the case names: not scaled), so many at a time,
# in rounds, the monitor's sleep
BURST = 1000
AT_A_TIME = 50
LAG_ROUNDS = 5
TICK = 0.001
LAG_WAYS = ("atransaction durable", "atransaction in-memory", "plain, apply_async in an executor",
            "plain, apply_async on the loop", "the row alone, nothing sent")


class Units:
    """The ways of one unit of work writing one row and sending N tasks, async and sync."""

    def __init__(self, outbox: Outbox, orders: Orders):
        self.outbox = outbox
        self.orders = orders
        self.write = orders.write
        self.engine = create_async_engine(POSTGRES_URL)  # plain Celery's: a plain async engine
        self.sessions = async_sessionmaker(self.engine, class_=AsyncSession, expire_on_commit=False)
        self._floor_rows: dict[int, tuple[Any, Any]] = {}  # N -> the floor's INSERT of N captured rows

    # -- one unit of each way, async -----------------------------------------------------------------

    async def row_alone(self) -> None:
        """The row written and committed in an ``AsyncSession``, nothing sent."""
        async with self.sessions() as session, session.begin():
            await session.execute(self.write)

    async def plain(self, task: Any, n: int) -> None:
        """Plain Celery from asyncio code: the row committed, then each ``apply_async`` in an executor."""
        await self.row_alone()
        loop = asyncio.get_running_loop()
        for i in range(n):
            await loop.run_in_executor(None, partial(task.apply_async, (i,)))

    async def plain_on_the_loop(self, task: Any, n: int) -> None:
        """Plain Celery called as if it were async: ``apply_async`` on the loop's thread (blocks it)."""
        await self.row_alone()
        for i in range(n):
            task.apply_async((i,))

    async def durable_floor(self, task: Any, n: int) -> None:
        """The durable unit's floor, by hand, with no library code: plain Celery's async way with
        the messages' rows (the library's own INSERT, marked sent, ``captured_rows``) written in the
        row's transaction, the COMMIT sent on its own (as the async driver sends it), then each
        ``apply_async`` of ``task`` (a plain one: the outbox's hook stores nothing for it) in an
        executor."""
        statement, values = self._floor_rows[n]
        async with self.engine.begin() as conn:
            await conn.execute(self.write)
            await conn.execute(statement, values)
        loop = asyncio.get_running_loop()
        for i in range(n):
            await loop.run_in_executor(None, partial(task.apply_async, (i,)))


    async def ours(self, task: Any, n: int) -> None:
        """``outbox.atransaction()``: the row through its ``AsyncSession``, N ``apply_async`` in it."""
        async with self.outbox.atransaction() as session:
            await session.execute(self.write)
            for i in range(n):
                task.apply_async((i,))

    async def ours_connection(self, task: Any, n: int) -> None:
        """``outbox.abegin()``: the row through its ``AsyncConnection``, N ``apply_async`` in it."""
        async with self.outbox.abegin() as conn:
            await conn.execute(self.write)
            for i in range(n):
                task.apply_async((i,))

    # -- rounds ----------------------------------------------------------------------------------------

    @staticmethod
    async def one_after_another(unit: Callable[[], Awaitable[None]], units: int) -> None:
        for _ in range(units):
            await unit()

    def ways(self, loop: asyncio.AbstractEventLoop, plain: Any, durable: Any) -> list[Callable[[int, int], None]]:
        """Each of ``WAYS`` as a call running ``units`` units of work of N sends, to its end."""

        def on_loop(unit: Callable[[Any, int], Awaitable[None]], task: Any) -> Callable[[int, int], None]:
            return lambda units, n: loop.run_until_complete(self.one_after_another(partial(unit, task, n), units))

        orders = self.orders
        for n in BATCHES:  # the floor's rows: the durable task's messages, captured once
            self._floor_rows[n] = captured_rows(self.outbox, durable, n, marked_sent=True)[:2]
        return [on_loop(self.plain, plain), on_loop(self.ours, plain), on_loop(self.ours, durable),
                on_loop(self.ours_connection, durable),
                partial(orders.ours, plain, in_a_session=True), partial(orders.ours, durable, in_a_session=True),
                partial(orders.ours, durable), partial(orders.plain, plain), on_loop(self.durable_floor, plain)]

    async def close(self) -> None:
        await self.engine.dispose()
        await self.outbox.async_engine.dispose()


def throughput(units_of: Units, loop: asyncio.AbstractEventLoop, plain: Any, durable: Any,
               options: Options) -> list[Result]:
    """Units of work per second of each way, N = 1, 10, 100, in rounds."""
    results = []
    ways = units_of.ways(loop, plain, durable)
    for n in BATCHES:
        units, repeats = max(5, options.units(UNITS[n], 10)), options.size(ROUNDS[n], 1)
        for way in ways:  # warm: connections made, statements compiled, threads started
            way(2, n)
        rounds = in_rounds(repeats, *(partial(rate, units, partial(way, units, n)) for way in ways))
        for each in rounds:
            print(f"  asyncio N={n}: " + ", ".join(
                f"{way} {value:.0f}/s" for way, value in zip(WAYS, each, strict=True)), file=sys.stderr)
        results += _throughput_rows(n, rounds)
    return results


def _throughput_rows(n: int, rounds: list[list[float]]) -> list[Result]:
    column = {way: index for index, way in enumerate(WAYS)}

    def paired(ours: str, other: str, floor: str | None = None) -> list[tuple[float, float | None, float | None]]:
        floor = floor if n == 1 else None  # the target's N: beyond it the floor's sends go one by one
        return [(each[column[ours]], each[column[other]], each[column[floor]] if floor else None) for each in rounds]

    plain_async = statistics.median(r[column["plain async"]] / r[column["plain sync"]] for r in rounds)
    target = (">=", TARGET) if n == 1 else None
    case = f"Redis, N={n}, one row and {n} send{'s' if n > 1 else ''} in a unit of work"
    against_plain = "vs plain Celery from asyncio (AsyncSession committed, then apply_async in an executor)"
    against_sync = (f"plain Celery's own async way at {plain_async:.2f} of its sync way (engine.begin(), "
                    "then apply_async) in the same rounds")
    return [
        Result.of_rounds("asyncio", f"{case}: atransaction(), in-memory, {against_plain}", "units/s",
                         paired("atransaction in-memory", "plain async")),
        Result.of_rounds("asyncio", f"{case}: atransaction(), durable, {against_plain}", "units/s",
                         paired("atransaction durable", "plain async")),
        Result.of_rounds("asyncio", f"{case}: abegin(), durable, {against_plain}", "units/s",
                         paired("abegin durable", "plain async")),
        Result.of_rounds("asyncio", f"{case}: atransaction() vs transaction(), in-memory", "units/s",
                         paired("atransaction in-memory", "transaction in-memory", "plain async"), target=target,
                         versus=SYNC_UNIT, note=against_sync),
        Result.of_rounds("asyncio", f"{case}: atransaction() vs transaction(), durable", "units/s",
                         paired("atransaction durable", "transaction durable", "durable floor"), target=target,
                         versus=SYNC_UNIT, note=against_sync),
        Result.of_rounds("asyncio", f"{case}: abegin() vs begin(), durable", "units/s",
                         paired("abegin durable", "begin durable", "durable floor"), target=target, versus=SYNC_UNIT,
                         note=against_sync),
    ]


# -- the event loop's lag --------------------------------------------------------------------------


async def lagged(unit: Callable[[], Awaitable[None]], count: int, at_a_time: int) -> tuple[list[float], float]:
    """Run ``count`` units of work, ``at_a_time`` at once, on the running loop while a monitor
    sleeps ``TICK`` again and again: how late each of its wakings came (seconds), and the seconds
    the units took."""
    lags: list[float] = []
    running = True

    async def monitor() -> None:
        while running:
            before = time.perf_counter()
            await asyncio.sleep(TICK)
            lags.append(time.perf_counter() - before - TICK)

    semaphore = asyncio.Semaphore(at_a_time)

    async def one() -> None:
        async with semaphore:
            await unit()

    watching = asyncio.ensure_future(monitor())
    await asyncio.sleep(0)  # the monitor is asleep before the first unit starts
    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    took = time.perf_counter() - started
    running = False
    await watching
    return lags, took


def loop_lag(units_of: Units, loop: asyncio.AbstractEventLoop, plain: Any, durable: Any,
             options: Options) -> list[Result]:
    """The p99 of the loop's lag during a burst of units of work, each way in turn, in rounds."""
    count, repeats = options.size(BURST, 100), options.size(LAG_ROUNDS, 1)
    units = [partial(units_of.ours, durable, 1), partial(units_of.ours, plain, 1), partial(units_of.plain, plain, 1),
             partial(units_of.plain_on_the_loop, plain, 1), units_of.row_alone]
    measured: dict[int, list[tuple[float, float, float]]] = {index: [] for index in range(len(units))}

    def measure(index: int) -> float:
        lags, took = loop.run_until_complete(lagged(units[index], count, AT_A_TIME))
        p99 = percentile(lags, 0.99) * 1e3
        measured[index].append((p99, max(lags) * 1e3, count / took))
        return p99

    for index in range(len(units)):  # warm: the pools filled, the threads started
        loop.run_until_complete(lagged(units[index], AT_A_TIME, AT_A_TIME))
    rounds = in_rounds(repeats, *(partial(measure, index) for index in range(len(units))))
    for each in rounds:
        print("  asyncio loop lag p99: " + ", ".join(f"{way} {value:.2f} ms" for way, value in
                                                       zip(LAG_WAYS, each, strict=True)), file=sys.stderr)

    def summary(index: int) -> str:
        p99s, maxima, rates = zip(*measured[index], strict=True)
        return (f"{LAG_WAYS[index]} p99 {statistics.median(p99s):.2f} ms, max {statistics.median(maxima):.1f} ms, "
                f"{statistics.median(rates):,.0f} units/s")

    note = "; ".join(summary(index) for index in range(len(units))) + " (medians of the rounds)"
    case = f"p99 of the event loop's lag, {count:,} units of work {AT_A_TIME} at a time, each one row and one send"
    return [
        Result.of_rounds("asyncio", f"{case}: atransaction(), durable, vs plain Celery, apply_async in an executor",
                         "ms", [(each[0], each[2], None) for each in rounds], note=note),
        Result.of_rounds("asyncio", f"{case}: atransaction(), in-memory, vs plain Celery, apply_async in an executor",
                         "ms", [(each[1], each[2], None) for each in rounds]),
        Result.of_rounds("asyncio", f"{case}: atransaction(), durable, vs plain Celery, apply_async on the loop",
                         "ms", [(each[0], each[3], None) for each in rounds]),
    ]


def run(options: Options) -> list[Result]:
    app, outbox, plain, durable = producer.build(REDIS_URL)
    orders = Orders(outbox)
    units_of = Units(outbox, orders)
    loop = asyncio.new_event_loop()
    try:
        return throughput(units_of, loop, plain, durable, options) + loop_lag(units_of, loop, plain, durable, options)
    finally:
        loop.run_until_complete(units_of.close())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        orders.close()
        producer._tear_down(app, outbox)
