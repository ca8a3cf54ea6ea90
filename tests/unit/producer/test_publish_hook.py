"""The publish hook's signal deferral: beat's shutdown handler never runs in the middle of a publish."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
from kombu.messaging import Producer

from celery_outbox.producer.publish_hook import defer_while_sending

from ...apps.factory import make_shop
from ...brokers import receive


@pytest.fixture
def shop(sqlite_url, table_prefix):
    shop = make_shop("memory://", sqlite_url, table_prefix)
    shop.outbox.ready()
    return shop


@pytest.fixture
def restored_signals():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_landing_during_a_send_runs_its_handler_once_the_send_has_ended(shop, monkeypatch,
                                                                                 restored_signals):
    happened: list[str] = []
    real_publish = Producer.publish

    def publish_interrupted(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # Python runs its handler before the next line
        happened.append("publish goes on")
        return real_publish(self, *args, **kwargs)

    signal.signal(signal.SIGUSR1, defer_while_sending(lambda signum, frame: happened.append("handler")))
    monkeypatch.setattr(Producer, "publish", publish_interrupted)
    shop.plain.delay(1)
    assert happened == ["publish goes on", "handler"]
    assert [m.args for m in receive(shop.app, shop.plain_queue, 1)] == [[1]]
    os.kill(os.getpid(), signal.SIGUSR1)  # outside a send: at once
    assert happened[-1] == "handler" and len(happened) == 3


def test_beats_shutdown_handlers_wait_for_a_publish_under_way(shop, restored_signals):
    """``beat_init`` comes after beat installed its SIGTERM and SIGINT handler (which closes the
    broker connection): the outbox wraps both, once."""
    beat_handler = lambda signum, frame: None  # noqa: E731 - stands for celery.apps.beat's _sync
    signal.signal(signal.SIGTERM, beat_handler)
    signal.signal(signal.SIGINT, beat_handler)
    service = SimpleNamespace(app=shop.app)
    shop.outbox._on_beat_init(service)
    shop.outbox._on_beat_init(service)
    for signum in (signal.SIGTERM, signal.SIGINT):
        wrapped = signal.getsignal(signum)
        assert getattr(wrapped, "defers_while_sending", False), signum
        assert wrapped.__closure__ and beat_handler in [cell.cell_contents for cell in wrapped.__closure__]
