"""In-memory doubles at the package's two narrowest seams, for unit tests of the relay, recovery,
the publisher and the inbox with no broker and no waiting:

* ``FakeOutlet`` stands in for the broker outlet (``celery_outbox.producer.broker.outlet``), the
  one publish loop every path that publishes stored rows goes through: the commit-time publisher,
  the relay, redelivery and the re-publish of stranded envelopes.
* ``FixedClock`` stands in for the one clock the package reads (``celery_outbox.store.utcnow``;
  on SQLite the store's ``database_now`` too, so heartbeats and node checks follow it).

Each is installed for one test (``install(monkeypatch)``) in every module of the package that
holds the real one by name, wherever it was imported: ``tests/unit/test_doubles.py`` checks that
no module of the package reaches either seam another way."""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Sequence, TypeVar

import pytest
from kombu.exceptions import EncodeError, OperationalError

import celery_outbox
from celery_outbox.core.crashpoints import crashpoint
from celery_outbox.message.envelope import OutgoingMessage
from celery_outbox.monitoring import tracing
from celery_outbox.producer import broker
from celery_outbox.producer.broker import PublishPass
from celery_outbox.store import base as store_base

from .celery_objects import RecordingProducer

T = TypeVar("T")

# The real seams, kept before any test replaces them
REAL_OUTLET = broker.outlet
REAL_UTCNOW = store_base.utcnow

PACKAGE = Path(celery_outbox.__file__).parent


@functools.lru_cache(maxsize=None)
def modules_naming(name: str) -> tuple[str, ...]:
    """The package's modules that define ``name`` or import it by that name (``from x import name``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names)
               or isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return tuple(found)


def holders(name: str, value: Any) -> list[ModuleType]:
    """Every module of the package that holds ``value`` as its global ``name``, each imported first:
    a module imported while a double is installed would keep the double after the test."""
    for module_name in modules_naming(name):
        try:
            importlib.import_module(module_name)
        except ImportError:  # an extra this environment lacks: no test can import the module either
            continue
    return [module for module_name, module in sorted(sys.modules.items())
            if module is not None and module_name.split(".")[0] == "celery_outbox"
            and vars(module).get(name) is value]


class QueuesAsGiven:
    """``broker.BoundQueues`` without a channel: the app's queues by name, and a message's entities
    to declare as they are."""

    def __init__(self, queues: Any):
        self._queues = queues

    def __getitem__(self, name: str) -> Any:
        return self._queues[name]

    def bind(self, entities: list[Any]) -> list[Any]:
        return list(entities)


class FakeOutlet:
    """The broker outlet without a broker: ``outlet(app, producer=None)`` opens this object, whose
    ``publish_each`` records every message it is asked to publish and answers with the
    ``PublishPass`` the real loop returns. Told to, it fails the broker (``fail_broker``) or one
    message (``refuse``). Messages with no row (published one by one with Celery's retry policy,
    not through ``publish_each``) and ``task-sent`` events go to ``producer``, a
    ``RecordingProducer``. No spans are made; the crash point is passed as the real loop passes it."""

    def __init__(self) -> None:
        self.producer = RecordingProducer()
        self.queues: Any = None  #: the queues of the app whose outlet was opened last
        self.bound: Any = None
        self.opened = 0  #: how many times an outlet was opened
        self.asked: list[OutgoingMessage] = []  #: every message of every pass, in order
        self.published: list[OutgoingMessage] = []  #: the messages the broker took, in order
        self.passes: list[tuple[tracing.Step, PublishPass[Any]]] = []  #: each pass's step and answer
        self._broker_error: BaseException | None = None
        self._taken_before_error = 0
        self._answers = True
        self._refused: dict[str, BaseException] = {}

    # telling it what the broker does

    def fail_broker(self, error: BaseException | None = None, after: int = 0, answers: bool = True) -> None:
        """From now on each pass meets a broker error (``OperationalError`` unless ``error`` is given)
        after ``after`` messages: that message and the rest of the pass are not sent. With
        ``answers=False`` the quick check fails too (``unreachable``), so callers publish nothing."""
        self._broker_error = error or OperationalError("[Errno 111] Connection refused")
        self._taken_before_error = after
        self._answers = answers

    def mend_broker(self) -> None:
        """The broker answers and takes every message again."""
        self._broker_error, self._answers = None, True

    def refuse(self, message_id: str, error: BaseException | None = None) -> None:
        """Every publish of ``message_id`` fails for a reason of its own (``EncodeError`` unless
        ``error`` is given); the pass goes on with the next message."""
        self._refused[message_id] = error or EncodeError(f"the broker cannot take {message_id}")

    # what the package calls

    @contextmanager
    def outlet(self, app: Any, producer: Any = None) -> Iterator["FakeOutlet"]:
        """Stands in for ``broker.outlet``: this outlet, on ``app``'s queues, whatever the producer."""
        self.opened += 1
        self.queues = app.amqp.queues
        self.bound = QueuesAsGiven(self.queues)
        yield self

    def unreachable(self) -> str | None:
        """Why the broker does not answer, or None (``Outlet.unreachable``)."""
        if self._answers:
            return None
        error = self._broker_error
        return f"{type(error).__name__}: {error}"

    def publish_each(self, pairs: Sequence[tuple[T, OutgoingMessage]], crash_point: str | None = None,
                     step: tracing.Step = tracing.Step.PUBLISH) -> PublishPass[T]:
        """``Outlet.publish_each`` in memory: each pair's message in order is published, or
        ``failed`` when refused, until a broker error stops the pass (that message and the rest
        ``not_sent``)."""
        self.asked.extend(message for _, message in pairs)
        result: PublishPass[T] = PublishPass()
        for index, (item, message) in enumerate(pairs):
            if self._broker_error is not None and index >= self._taken_before_error:
                result.broker_error = self._broker_error
                result.not_sent = list(pairs[index:])
                break
            refusal = self._refused.get(message.message_id)
            if refusal is not None:
                result.failed.append((item, message, refusal))
                continue
            result.published.append((item, message))
            self.published.append(message)
        self.passes.append((step, result))
        if crash_point is not None:
            for _ in result.published:
                crashpoint(crash_point)
        return result

    # reading what happened

    @property
    def published_ids(self) -> list[str]:
        return [message.message_id for message in self.published]

    @property
    def steps(self) -> list[tracing.Step]:
        """The step of each pass, in order."""
        return [step for step, _ in self.passes]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeOutlet":
        """Open this outlet wherever the package opens the broker's, until the test ends."""
        for module in holders("outlet", REAL_OUTLET):
            monkeypatch.setattr(module, "outlet", self.outlet)
        return self


class FixedClock:
    """The package's clock standing still at ``now`` (aware, UTC) until a test sets or advances it."""

    START = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)

    def __init__(self, now: datetime = START):
        self.now = self.set(now)

    def __call__(self) -> datetime:
        return self.now

    def set(self, now: datetime) -> datetime:
        """Stand at ``now``, which must carry its time zone (the store only writes UTC)."""
        if now.tzinfo is None:
            raise ValueError(f"{now!r} has no time zone: the package's clock is aware UTC")
        self.now = now.astimezone(timezone.utc)
        return self.now

    def advance(self, seconds: float = 0, **delta: float) -> datetime:
        """Move ``seconds`` (and ``timedelta`` keywords) forward; the new instant."""
        return self.set(self.now + timedelta(seconds=seconds, **delta))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FixedClock":
        """Make this the clock every module of the package reads, until the test ends."""
        for module in holders("utcnow", REAL_UTCNOW):
            monkeypatch.setattr(module, "utcnow", self)
        return self
