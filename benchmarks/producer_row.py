"""Producer, the realistic row: one unit of work writes one row of the user's data and sends N
messages (N = 1 and 10), vs plain Celery doing the same write, committing, then ``apply_async``.

Five ways, on the same broker and the same PostgreSQL, taking turns in rounds (``in_rounds``):

* plain Celery: the row written on a plain SQLAlchemy engine (``with engine.begin() as conn:``),
  committed, then N ``apply_async``;
* in-memory: ``with outbox.begin() as conn:`` (the same Core connection API) the row written
  through ``conn`` and N ``apply_async`` to a plain queue, published after the commit;
* durable: the same to a durable queue: the messages' rows are inserted marked sent in the
  transaction, by its last statement, which goes with the COMMIT in one round trip; after the
  commit they are published, with no round trip to the store;
* durable through a Session: the same in ``with outbox.transaction() as session:``, the row
  written through ``session`` (the ORM Session's own cost; the messages' INSERT goes with the
  COMMIT, sent from the connection's ``commit`` event);
* the durable unit's floor, by hand, with no library code: plain Celery's unit with the messages'
  rows (built once, marked sent) inserted in its transaction by one more statement, prepared once
  per connection and sent with the COMMIT in one network message (libpq's pipeline mode, driven
  directly as the store drives it), then the ``apply_async`` calls.
  No implementation that stores the messages in the user's transaction does less: one more
  statement in the transaction (the library's INSERT, its parameters made once here).
  Where publishes are pipelined (Redis) and N > 1, the durable path sends its publishes in one
  pipeline where the floor's ``apply_async`` calls go one by one: there the floor is not the
  least, and the durable row does not carry it.

The user's table (``<prefix>orders``) is the benchmark's own, on the outboxes' PostgreSQL. The
target, at N = 1: 0.9 of plain Celery. After the rounds, the durable row's note says what its
unit of work spends at N = 1, measured in a pass of its own (not in the rounds): the round trips
to PostgreSQL in order (counted by SQLAlchemy's events: psycopg sends a BEGIN, each statement
and a COMMIT in a round trip each; statements the store sends together in one network message
count as one), those after the commit, and the mean time of the parts
(timed by wrapping, for that pass only, the methods that run them).
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Callable, Iterator

from celery.utils import uuid
from psycopg.adapt import PyFormat, Transformer
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
)
from sqlalchemy.engine import Engine

from celery_outbox import Outbox
from celery_outbox.producer.broker import Outlet
from celery_outbox.producer.publishing import Publisher
from celery_outbox.producer.unit_of_work import UnitOfWork, current_unit_of_work
from celery_outbox.store import utcnow
from celery_outbox.store.one_message import OneMessage
from celery_outbox.store.outgoing import postgres_insert
from celery_outbox.store.pipeline import (
    COMMAND_OK,
    TUPLES_OK,
    pipeline_exchange,
    pipelined_query,
    prepared_statements,
)

from .common import POSTGRES_URL, Options, Result, in_rounds, rate

BATCHES = (1, 10)
# Rounds per N, and units of work per way and round. At N = 1, the target's, sixteen rounds of
# 450: the interval of a row's ratio is the 5th to the 12th round's (92%), where eight rounds give
# the 2nd to the 7th (93%), as wide as the host's noise (RabbitMQ's rounds move by ±0.05 here).
# At N = 10, eight; five would give the lowest to the highest. A unit of work at N = 1 takes 1 to
# 8 ms on a shared two-core host.
ROUNDS = {1: 16, 10: 8}
UNITS = {1: 450, 10: 200}
# Units of work of the pass that counts and times what one of them spends (N = 1)
SPENT_UNITS = 300
TARGET = 0.9
WAYS = ("plain", "in-memory", "durable", "durable, Session", "floor")


def captured_rows(outbox: Outbox, durable: Any, n: int, marked_sent: bool = False,
                  ) -> tuple[Any, dict[str, Any], list[str]]:
    """N messages of ``durable`` captured in a unit of work (neither stored nor published), as the
    library's INSERT of outgoing rows takes them on PostgreSQL: its statement, its parameters
    (one row's values, or the rows as one JSON text), made once, and the messages' ids; with
    ``marked_sent``, the rows marked sent as the publisher marks them (``sent_at``,
    ``redeliver_at``)."""
    with outbox.transaction():
        for i in range(n):
            durable.apply_async((i,))
        uow = current_unit_of_work()
        messages, uow.pending = uow.pending, []  # captured only: neither stored nor published
    now = utcnow()
    rows = [message.to_row(now) for message in messages]
    if marked_sent:
        rows = [dict(row, sent_at=now, redeliver_at=outbox.settings.first_redelivery(now)) for row in rows]
    statement, values, _, _ = postgres_insert(outbox.store.tables.outgoing, rows)
    return statement, values, [message.message_id for message in messages]


class Orders:
    """The user's table and the ways of writing one row of it: in a unit of work (on its Core
    connection, or its Session), and on a plain SQLAlchemy engine as a Celery user without
    celery-outbox would."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.metadata = MetaData()
        self.table = Table(f"{outbox.settings.table_prefix}orders", self.metadata,
                           Column("id", BigInteger, primary_key=True, autoincrement=True),
                           Column("item", String(100), nullable=False), Column("quantity", Integer, nullable=False))
        self.metadata.create_all(outbox.engine)
        self.write = insert(self.table).values(item="a book", quantity=1)
        self.engine = create_engine(POSTGRES_URL)

    def plain(self, task: Any, units: int, n: int) -> None:
        """Plain Celery: the row written and committed, then N ``apply_async``."""
        for _ in range(units):
            with self.engine.begin() as conn:
                conn.execute(self.write)
            for i in range(n):
                task.apply_async((i,))

    def ours(self, task: Any, units: int, n: int, in_a_session: bool = False) -> None:
        """One unit of work on a Core connection (``outbox.begin()``), or with ``in_a_session`` on a
        Session (``outbox.transaction()``): the row written through it, N ``apply_async`` in it."""
        for _ in range(units):
            with self.outbox.transaction() if in_a_session else self.outbox.begin() as conn:
                conn.execute(self.write)
                for i in range(n):
                    task.apply_async((i,))

    def ours_without_messages(self, units: int) -> None:
        """The unit of work writing its row and sending nothing."""
        for _ in range(units):
            with self.outbox.begin() as conn:
                conn.execute(self.write)

    def close(self) -> None:
        self.engine.dispose()
        self.metadata.drop_all(self.outbox.engine)


class Floor:
    """The durable unit of work by hand: plain Celery's unit, with the N messages' rows (built
    once, but for their message ids) inserted marked sent, that INSERT (prepared once per
    connection) and the COMMIT queued in libpq's pipeline mode and sent in one network message,
    then the ``apply_async`` calls; nothing after them. It drives libpq itself, as the store does:
    psycopg's ``pipeline()`` block costs more CPU than the round trip it saves on a local server.

    Each unit's rows carry the ids of the tasks it sends, new ones, as every implementation's do:
    rows inserted again and again with one id would add to one leaf of the message-id index, a
    page always in memory, where new ids land on pages all over it. The new ids take the places
    of the captured ones in the parameters made once (the row's id, and the headers and
    properties that name it) by plain byte substitution (``_with_ids``): no library code runs."""

    def __init__(self, orders: Orders, durable: Any, n: int):
        self.orders = orders
        insert, given, ids = captured_rows(orders.outbox, durable, n, marked_sent=True)
        query = pipelined_query(insert, orders.engine.dialect, tuple(sorted(given)), "floor")
        self.name, self.encoded_name, self.statement = query.name, query.encoded_name, query.ascii_statement
        params = Transformer().dump_sequence(query.values(given), [PyFormat.TEXT] * len(query.keys))
        self._pieces = _split_at_ids(params, [message_id.encode() for message_id in ids])

    def send(self, task: Any, units: int, n: int) -> None:
        orders = self.orders
        for _ in range(units):
            task_ids = [uuid() for _ in range(n)]
            params = _with_ids(self._pieces, [task_id.encode() for task_id in task_ids])
            with orders.engine.begin() as conn:
                conn.execute(orders.write)
                prepared, _ = prepared_statements(conn)  # follows psycopg's DEALLOCATE ALL
                prepare = self.name not in prepared
                send = partial(self._insert_and_commit, prepare, params)
                results = pipeline_exchange(conn.connection.driver_connection, send)
                failed = [result for result in results if result.status not in (COMMAND_OK, TUPLES_OK)]
                if failed:
                    raise RuntimeError(f"the floor's INSERT failed: {failed[0].error_message.decode()}")
                if prepare:
                    prepared.add(self.name)
                # SQLAlchemy's COMMIT that follows finds no transaction: psycopg sends none
            for i in range(n):
                task.apply_async((i,), task_id=task_ids[i])

    def _insert_and_commit(self, prepare: bool, params: list[bytes | None], pgconn: Any) -> None:
        if prepare:
            pgconn.send_prepare(self.encoded_name, self.statement)
        pgconn.send_query_prepared(self.encoded_name, params)
        pgconn.send_query_params(b"COMMIT", None)


def _split_at_ids(params: list[bytes | None], ids: list[bytes]) -> list[tuple[list[Any], list[int]]]:
    """Each parameter as its text around every occurrence of the message ids ``ids`` (a row's id,
    and the headers and properties that name it), with the index in ``ids`` of each id it held;
    a NULL (None) as it is."""
    pattern = re.compile(b"|".join(re.escape(each) for each in ids))
    position = {each: index for index, each in enumerate(ids)}
    pieces: list[tuple[list[Any], list[int]]] = []
    for param in params:
        if param is None:
            pieces.append(([param], []))
            continue
        parts, held, start = [], [], 0
        for found in pattern.finditer(param):
            parts.append(param[start:found.start()])
            held.append(position[found.group()])
            start = found.end()
        parts.append(param[start:])
        pieces.append((parts, held))
    return pieces


def _with_ids(pieces: list[tuple[list[Any], list[int]]], ids: list[bytes]) -> list[bytes | None]:
    """The parameters of ``_split_at_ids`` with ``ids`` in the places of the ids they held."""
    params = []
    for parts, held in pieces:
        chunks = [parts[0]]
        for index, part in zip(held, parts[1:], strict=True):
            chunks += (ids[index], part)
        params.append(b"".join(chunks) if held else parts[0])
    return params


def measure(broker: str, outbox: Outbox, plain: Any, durable: Any, batches_publishes: bool,
            options: Options) -> list[Result]:
    """The rows of one broker, with the app the producer benchmark built (its tasks: ``plain`` to
    a plain queue, ``durable`` to a durable one)."""
    orders = Orders(outbox)
    results = []
    try:
        for n in BATCHES:
            floor = Floor(orders, durable, n)
            units, repeats = max(5, options.units(UNITS[n], 20)), options.size(ROUNDS[n], 1)
            ways = [partial(orders.plain, plain), partial(orders.ours, plain), partial(orders.ours, durable),
                    partial(orders.ours, durable, in_a_session=True), partial(floor.send, plain)]
            for way in ways:  # warm: statements compiled, connections made
                way(1, n)
            rounds = in_rounds(repeats, *(partial(rate, units * n, partial(way, units, n)) for way in ways))
            for each in rounds:
                print(f"  producer {broker} N={n} writing one row: " + ", ".join(
                    f"{way} {value:.0f}/s" for way, value in zip(WAYS, each, strict=True)), file=sys.stderr)
            spent = what_it_spends(orders, plain, durable, options.units(SPENT_UNITS, 20)) if n == 1 else ""
            floored = n == 1 or not batches_publishes
            target = (">=", TARGET) if n == 1 else None
            case = f"{broker}, N={n} in one unit of work writing one row"
            results += [
                Result.of_rounds("producer", f"{case}, in-memory", "msg/s", [(r[1], r[0], None) for r in rounds],
                                 target=target),
                Result.of_rounds("producer", f"{case}, durable", "msg/s",
                                 [(r[2], r[0], r[4] if floored else None) for r in rounds], target=target, note=spent),
                Result.of_rounds("producer", f"{case}, durable, through a Session (outbox.transaction())", "msg/s",
                                 [(r[3], r[0], r[4] if floored else None) for r in rounds]),
                Result.of_rounds("producer", f"{broker}, N={n} writing one row, floor: its transaction inserting the "
                                 "messages' rows by hand, marked sent, with the COMMIT in one message", "msg/s",
                                 [(r[4], r[0], None) for r in rounds]),
            ]
    finally:
        orders.close()
    return results


# -- what one durable unit of work spends ----------------------------------------------------------


class _Trips:
    """The round trips to PostgreSQL of the engines listened to, by what starts each (``BEGIN``,
    a statement's first word, ``COMMIT``), split at the commit: those made while the publisher
    runs after it."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.after_commit = False
        self.before: list[str] = []
        self.after: list[str] = []
        self.committed_in_message = False  # the message had the COMMIT: SQLAlchemy's own sends nothing

    def note(self, what: str) -> None:
        (self.after if self.after_commit else self.before).append(what)

    def _begin(self, conn: Any) -> None:
        self.note("BEGIN")

    def _execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.note(_first_word(statement))

    def _commit(self, conn: Any) -> None:
        if self.committed_in_message:
            self.committed_in_message = False
            return
        self.note("COMMIT")

    @contextmanager
    def listening(self) -> Iterator["_Trips"]:
        handlers = (("begin", self._begin), ("before_cursor_execute", self._execute), ("commit", self._commit))
        for engine in self.engines:
            for name, handler in handlers:
                event.listen(engine, name, handler)
        try:
            yield self
        finally:
            for engine in self.engines:
                for name, handler in handlers:
                    event.remove(engine, name, handler)

    def one_message(self, entering: bool, args: tuple[Any, ...]) -> None:
        """The store sends statements together in one network message (``OneMessage``): one round
        trip, its BEGIN with it (SQLAlchemy's ``begin`` event sends nothing), and its COMMIT
        (SQLAlchemy's ``commit`` event that follows sends nothing)."""
        if entering:
            _store, _conn, query, _values, before, after, *_ = args
            if before[:1] == (b"BEGIN",):
                noted = self.after if self.after_commit else self.before
                if noted and noted[-1] == "BEGIN":
                    noted.pop()
            statements = [s.decode().split(None, 1)[0] for s in before] + [_first_word(query.statement)] \
                + [s.decode() for s in after]
            self.committed_in_message = b"COMMIT" in after
            self.note(f"one message ({', '.join(statements)})")

    def reset(self) -> None:
        self.before, self.after = [], []


def _first_word(statement: str) -> str:
    return statement.split(None, 1)[0].upper()


@contextmanager
def _timed(owner: type, name: str, spent: dict[str, float], key: str | Callable[..., str],
           around: Callable[[bool, tuple[Any, ...]], None] | None = None) -> Iterator[None]:
    """For the block: ``owner.name`` adds the seconds each call takes to ``spent[key]`` (``key``
    may be a function of the call's arguments; and calls ``around(True, args)`` before,
    ``around(False, args)`` after each call)."""
    original = owner.__dict__[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        label = key(*args) if callable(key) else key
        if around is not None:
            around(True, args)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started
            if around is not None:
                around(False, args)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def what_it_spends(orders: Orders, plain: Any, durable: Any, units: int) -> str:
    """What one durable unit of work at N = 1 spends, against plain Celery's unit: its round trips
    to PostgreSQL, and the mean time of its parts, in a pass of ``units`` of each."""
    trips = _Trips([orders.outbox.engine, orders.engine])
    spent: dict[str, float] = defaultdict(float)
    plain_spent: dict[str, float] = defaultdict(float)

    def publishing(entering: bool, _args: tuple[Any, ...]) -> None:
        trips.after_commit = entering

    with trips.listening():
        orders.plain(plain, 1, 1)
        trips.reset()
        orders.plain(plain, 1, 1)
        plain_trips = list(trips.before)
        for _ in range(units):
            started = time.perf_counter()
            with orders.engine.begin() as conn:
                conn.execute(orders.write)
            committed = time.perf_counter()
            plain.apply_async((0,))
            plain_spent["transaction"] += committed - started
            plain_spent["unit"] += time.perf_counter() - started
        started = time.perf_counter()
        orders.ours_without_messages(units)
        plain_spent["no message"] = time.perf_counter() - started
        with ExitStack() as stack:
            stack.enter_context(_timed(Publisher, "publish_committed", spent, "after the commit", publishing))
            stack.enter_context(_timed(OneMessage, "_send_one_message", spent,
                                       lambda _store, _conn, query, *_: f"message {_first_word(query.statement)}",
                                       trips.one_message))
            stack.enter_context(_timed(Outlet, "publish_each", spent, "publish"))
            stack.enter_context(_timed(UnitOfWork, "_store_durable", spent, "INSERT"))
            orders.ours(durable, 1, 1)
            trips.reset()
            orders.ours(durable, 1, 1)
            ours_before, ours_after = list(trips.before), list(trips.after)
            spent.clear()  # the timed units alone
            started = time.perf_counter()
            orders.ours(durable, units, 1)
            spent["unit"] = time.perf_counter() - started
    ms = {key: value / units * 1e3 for key, value in spent.items()}
    plain_ms = {key: value / units * 1e3 for key, value in plain_spent.items()}
    return (f"round trips to PostgreSQL per unit of work: {', '.join(ours_before)}, then after the commit "
            f"{', '.join(ours_after) or 'none'} (plain Celery's: {', '.join(plain_trips)}); ms per unit of work: ours "
            f"{ms['unit']:.2f}, plain Celery's {plain_ms['unit']:.2f} (its transaction {plain_ms['transaction']:.2f}, "
            f"apply_async {plain_ms['unit'] - plain_ms['transaction']:.2f}); of ours, after the commit "
            f"{ms['after the commit']:.2f} (the publish {ms['publish']:.2f}), the message row's INSERT sent with "
            f"the COMMIT {ms['INSERT']:.2f}; the unit of "
            f"work writing its row and sending nothing {plain_ms['no message']:.2f}")
