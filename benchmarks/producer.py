"""Producer: N ``apply_async`` inside one committed unit of work vs N plain ``apply_async``.

Three ways to send the same N task messages, in one process, on the same broker:

* plain Celery: N ``apply_async`` calls, no unit of work;
* in-memory unit of work: ``with outbox.transaction():`` around the N calls, to a plain
  queue: captured, then published after the commit with one producer;
* durable: the same to a durable queue: one INSERT of the N rows, marked sent, in the
  transaction, then the publish.

Messages per second for N = 1, 10 and 100, on Redis and RabbitMQ; nobody consumes
(the queues are deleted afterwards).

For N = 100 one more row measures the durable unit's floor: the in-memory unit of work, each
time followed by the durable path's database statements (the INSERT of the N rows, marked sent,
and its commit) on rows built once, in
the same loop (the statements' time alone is in its note). Where each publish goes out at once
(RabbitMQ), no implementation that stores the messages in the unit's transaction is faster than
that: it pays the in-memory unit's publishes and the statements, and right after the publishes
the broker, still taking the messages in, shares the machine with the database. Where
publishes are pipelined (Redis), the durable path's batch publish beats the in-memory unit's
one-by-one publishes, and so that row: there it is no floor, and the durable row does not carry it.

For N = 100, the durable unit and its floor again with delivery tracking off
(``outbox_redeliver_after = None``): the rows are inserted unsent and one DELETE takes them
before the publish: one INSERT, one DELETE.

Then the realistic rows (``producer_row``): a unit of work that also writes one row of the
user's data, N = 1 and 10, against plain Celery writing it on its own engine, committing, then
calling ``apply_async``.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

from celery import Celery

from celery_outbox import Outbox

from . import producer_row
from .common import (
    POSTGRES_URL,
    RABBITMQ_URL,
    REDIS_URL,
    Options,
    Result,
    delete_queues,
    drop_store,
    in_rounds,
    rate,
    unique_prefix,
)

BATCHES = (1, 10, 100)
# Rounds and messages per way and round: N = 100, the target's, in ten rounds of 2,000 messages
# (its interval the 2nd to the 9th round's ratio; five rounds give only the lowest to the
# highest); the rest in five rounds, of 2,000 at N = 1 and 3,000 at N = 10 (N = 1, durable,
# takes up to 14 s a round; no target applies to either)
ROUNDS = {1: 5, 10: 5, 100: 10}
MESSAGES = {1: 2000, 10: 3000, 100: 2000}


def build(broker_url: str, tracking: bool = True, prefix: str | None = None, database_url: str = POSTGRES_URL,
          **conf: Any) -> tuple[Celery, Outbox, Any, Any]:
    """The app (its tables and queues named by ``prefix``, a new one by default, its store at
    ``database_url``, ``conf`` settings more) and its tasks: ``plain`` to a plain queue,
    ``durable`` to a durable one. Without ``tracking`` its outbox deletes durable rows once
    published (``outbox_redeliver_after = None``) instead of keeping them until the consumer has them."""
    prefix = prefix or unique_prefix()
    app = Celery(f"bench_producer_{prefix}", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_queue=f"{prefix}plain", task_routes={"bench.durable": {"queue": f"{prefix}durable"}},
                    outbox_database_url=database_url, outbox_table_prefix=prefix,
                    outbox_durable_queues=[f"{prefix}durable"], **conf)
    if not tracking:
        app.conf.outbox_redeliver_after = None
    outbox = Outbox(app)

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(name="bench.durable", shared=False)
    def durable(n: int) -> int:
        return n

    outbox.ready()
    return app, outbox, plain, durable


def send(task: Any, units: int, n: int, outbox: Outbox | None) -> None:
    """``units`` times N ``apply_async``: each N in one unit of work with ``outbox``, plain without."""
    for _ in range(units):
        with outbox.transaction() if outbox is not None else nullcontext():
            for i in range(n):
                task.apply_async((i,))


def durable_statements(outbox: Outbox, durable: Any, n: int) -> Callable[[], None]:
    """One unit of work's durable statements on N rows built once: the INSERT (of rows marked sent,
    with delivery tracking) and its commit; without delivery tracking, then the DELETE taking them
    for the publish, and its commit."""
    store = outbox.store
    tracking = outbox.settings.redeliver_after is not None
    insert, given, _ = producer_row.captured_rows(outbox, durable, n, marked_sent=tracking)

    def run() -> None:
        with store.begin() as conn:
            ids = list(conn.execute(insert, given).scalars())
        if not tracking:
            with store.begin(durable=False) as conn:
                store.take_outgoing_to_delete(conn, ids)

    return run


def statements_alone(outbox: Outbox, durable: Any, units: int, n: int, repeats: int = 1) -> float:
    """Seconds per unit of work the durable statements take alone, back to back; the best of
    ``repeats`` runs."""
    statements = durable_statements(outbox, durable, n)

    def run() -> float:
        started = time.perf_counter()
        for _ in range(units):
            statements()
        return (time.perf_counter() - started) / units

    return min(run() for _ in range(repeats))


def interleaved(outbox: Outbox, plain: Any, durable: Any, units: int, n: int) -> Callable[[], None]:
    """The floor of the durable unit of work: ``units`` times the in-memory unit of N messages
    followed by the durable statements on rows built once. Right after a publish the broker is
    still taking in its messages, and on a small machine it shares the cores with the database
    running the statements: this measures that too, as the statements timed alone cannot."""
    statements = durable_statements(outbox, durable, n)

    def run() -> None:
        for _ in range(units):
            send(plain, 1, n, outbox)
            statements()

    return run


def batches_publishes(app: Celery) -> bool:
    """Whether the broker's transport sends a batch of publishes together (kombu's ``Producer.batch``):
    then the durable path's publish beats the in-memory unit's, and the interleaved row is no floor."""
    with app.producer_or_acquire() as producer:
        return bool(getattr(producer, "supports_batch_publish", False))


def measure(broker: str, broker_url: str, options: Options) -> list[Result]:
    app, outbox, plain, durable = build(broker_url)
    try:
        _warm_up(outbox, plain, durable)
        results = []
        for n in BATCHES:
            repeats, units = options.size(ROUNDS[n], 1), max(20, options.units(MESSAGES[n], 200) // n)
            rounds = _rates(outbox, plain, durable, units, n, repeats, floor=n == max(BATCHES))
            for each in rounds:
                print(f"  producer {broker} N={n}: plain {each[0]:.0f}/s, in-memory {each[1]:.0f}/s, "
                      f"durable {each[2]:.0f}/s" + (f", floor {each[3]:.0f}/s" if n == max(BATCHES) else ""),
                      file=sys.stderr)
            results += [
                Result.of_rounds("producer", f"{broker}, N={n} in one unit of work, in-memory", "msg/s",
                                 [(each[1], each[0], None) for each in rounds]),
                _durable(broker, n, rounds, floored=n == max(BATCHES) and not batches_publishes(app)),
            ]
            if n == max(BATCHES):
                statements = statements_alone(outbox, durable, units, n, repeats)
                results.append(_floor(broker, n, rounds, statements))
                results += _untracked(broker, broker_url, n, units, repeats)
        return results + producer_row.measure(broker, outbox, plain, durable, batches_publishes(app), options)
    finally:
        _tear_down(app, outbox)


def _untracked(broker: str, broker_url: str, n: int, units: int, repeats: int) -> list[Result]:
    """N in one durable unit of work with delivery tracking off, and its floor, against plain
    Celery measured again beside them."""
    app, outbox, plain, durable = build(broker_url, tracking=False)
    try:
        _warm_up(outbox, plain, durable)
        rounds = _rates(outbox, plain, durable, units, n, repeats, floor=True)
        for baseline, _, stored, floor in rounds:
            print(f"  producer {broker} N={n}, delivery tracking off: plain {baseline:.0f}/s, "
                  f"durable {stored:.0f}/s, floor {floor:.0f}/s", file=sys.stderr)
        mode = ", delivery tracking off"
        return [_durable(broker, n, rounds, floored=not batches_publishes(app), mode=mode),
                _floor(broker, n, rounds, statements_alone(outbox, durable, units, n, repeats), mode)]
    finally:
        _tear_down(app, outbox)


def _warm_up(outbox: Outbox, plain: Any, durable: Any) -> None:
    """Connect and declare the queues before anything is timed."""
    plain.apply_async((0,))
    with outbox.transaction():
        durable.apply_async((0,))


def _rates(outbox: Outbox, plain: Any, durable: Any, units: int, n: int, repeats: int,
           floor: bool = False) -> list[list[float]]:
    """Messages per second in each of ``repeats`` rounds, side by side: plain Celery, the in-memory
    unit of work, the durable one and, with ``floor``, the durable unit's floor (``interleaved``)."""
    messages = units * n
    measures = [partial(send, plain, units, n, None), partial(send, plain, units, n, outbox),
                partial(send, durable, units, n, outbox)]
    if floor:
        measures.append(interleaved(outbox, plain, durable, units, n))
    return in_rounds(repeats, *(partial(rate, messages, measure) for measure in measures))


def _durable(broker: str, n: int, rounds: list[list[float]], floored: bool, mode: str = "") -> Result:
    """The durable unit of work against plain Celery in each round (the target at N = 100), with
    the floor of the same round where ``floored``."""
    return Result.of_rounds("producer", f"{broker}, N={n} in one unit of work, durable{mode}", "msg/s",
                            [(each[2], each[0], each[3] if floored else None) for each in rounds],
                            target=(">=", 1.0) if n == 100 else None)


def _floor(broker: str, n: int, rounds: list[list[float]], statements: float, mode: str = "") -> Result:
    """The durable unit's floor against plain Celery in each round, with the time its statements
    take alone in the note."""
    return Result.of_rounds("producer", f"{broker}, N={n}, floor: in-memory unit then the durable statements{mode}",
                            "msg/s", [(each[3], each[0], None) for each in rounds],
                            note=f"statements alone {statements * 1e3:.2f} ms per unit of work")


def _tear_down(app: Celery, outbox: Outbox) -> None:
    delete_queues(app, list(app.amqp.queues))
    drop_store(outbox)


def run(options: Options) -> list[Result]:
    return measure("Redis", REDIS_URL, options) + measure("RabbitMQ", RABBITMQ_URL, options)
