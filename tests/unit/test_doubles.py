"""The suite's doubles (tests/unit/doubles.py) are true to what they stand for: the package reaches the
broker outlet and the clock only by name, so installing a double replaces them everywhere, and the
test's end puts the real ones back; the fake outlet answers a pass in the shape the real one does,
for a broker that takes every message, one that fails partway and one message refused."""

from __future__ import annotations

import ast
import sys
from typing import Any

import pytest
from kombu.exceptions import EncodeError

from celery_outbox.message.envelope import from_row
from celery_outbox.producer import broker

from ..apps.factory import make_shop, outgoing, strand
from .doubles import PACKAGE, REAL_OUTLET, REAL_UTCNOW, FakeOutlet, FixedClock, modules_naming

SEAMS = ("outlet", "utcnow")


def other_ways_to(name: str) -> list[str]:
    """Where a module of the package reaches ``name`` other than by importing it by that name: an
    attribute (``broker.outlet``) or an import under another name; a double would miss those."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == name:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{name}")
            if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname not in (None, name)
                                                        for a in node.names):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {name} as another name")
    return found


@pytest.mark.parametrize("name", SEAMS)
def test_the_package_reaches_each_seam_by_its_name_only(name):
    assert other_ways_to(name) == []


def test_installed_doubles_replace_every_holder_until_the_test_ends():
    with pytest.MonkeyPatch.context() as patch:
        fake, clock = FakeOutlet().install(patch), FixedClock().install(patch)
        assert {name: sys.modules[name].outlet == fake.outlet for name in modules_naming("outlet")} == \
            dict.fromkeys(modules_naming("outlet"), True)
        assert {name: sys.modules[name].utcnow is clock for name in modules_naming("utcnow")} == \
            dict.fromkeys(modules_naming("utcnow"), True)
        assert {"celery_outbox.maintenance.relay", "celery_outbox.maintenance.recover",
                "celery_outbox.producer.publishing"} <= set(modules_naming("outlet"))
    assert all(sys.modules[name].outlet is REAL_OUTLET for name in modules_naming("outlet"))
    assert all(sys.modules[name].utcnow is REAL_UTCNOW for name in modules_naming("utcnow"))


def test_the_fixed_clock_stands_still_until_moved():
    clock = FixedClock()
    assert clock() == clock() == FixedClock.START
    assert clock.advance(90) == FixedClock.START.replace(minute=1, second=30) == clock()
    with pytest.raises(ValueError, match="no time zone"):
        clock.set(FixedClock.START.replace(tzinfo=None))


class Flaky:
    """A real producer whose publishes fail as told: a broker error (``ConnectionRefusedError``)
    from the publish after the ``broker_takes``-th, an error of the message's own for the ids
    ``refused``."""

    def __init__(self, producer: Any, broker_takes: int | None = None, refused: tuple[str, ...] = ()):
        self._real, self._broker_takes, self._refused = producer, broker_takes, refused
        self._calls = 0

    def publish(self, body: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._broker_takes is not None and self._calls > self._broker_takes:
            raise ConnectionRefusedError("the broker went away")
        if kwargs["headers"]["id"] in self._refused:
            raise EncodeError("cannot take this one")
        return self._real.publish(body, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def shape(done: broker.PublishPass) -> tuple[list[str], list[str], list[str], bool]:
    """The ids published, failed and not sent, and whether the broker failed."""
    return ([m.message_id for _, m in done.published], [m.message_id for _, m, _ in done.failed],
            [m.message_id for _, m in done.not_sent], done.broker_error is not None)


@pytest.mark.parametrize("case", ["takes every message", "fails after one", "refuses the second"])
def test_the_fake_outlet_answers_a_pass_as_the_real_one_does(sqlite_url, table_prefix, case):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    strand(shop, 1, 2, 3)
    pairs = [(row, from_row(row, shop.app.amqp.queues)) for row in outgoing(shop)]
    second = pairs[1][1].message_id
    fake = FakeOutlet()
    if case == "fails after one":
        fake.fail_broker(after=1)
    elif case == "refuses the second":
        fake.refuse(second)
    with shop.app.connection_for_write() as connection:
        producer = Flaky(connection.Producer(), broker_takes=1 if case == "fails after one" else None,
                         refused=(second,) if case == "refuses the second" else ())
        with broker.outlet(shop.app, producer) as real:
            answered = shape(real.publish_each(pairs))
    first, _, third = [message.message_id for _, message in pairs]
    assert answered == {"takes every message": ([first, second, third], [], [], False),
                        "fails after one": ([first], [], [second, third], True),
                        "refuses the second": ([first, third], [second], [], False)}[case]
    with fake.outlet(shop.app):
        assert shape(fake.publish_each(pairs)) == answered
    assert fake.asked == [message for _, message in pairs]
