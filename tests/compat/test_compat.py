"""Celery stays Celery with the outbox installed: every scenario gives, in each mode, the outcome
plain Celery gives (and plain Celery gives the outcome Celery documents)."""

from __future__ import annotations

import pytest

from ..apps.compat_app import MODES
from ..services import require
from ..versions import CELERY
from . import harness as harness_module
from .scenarios import DIFFERENCES, DOCUMENTED_SINCE, EXPECTED, SCENARIOS

pytestmark = [pytest.mark.compat, pytest.mark.worker, pytest.mark.redis, pytest.mark.postgres]


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    broker_url, database_url = require("redis"), require("postgres")
    started = harness_module.start(broker_url, database_url, tmp_path_factory.mktemp("compat"))
    yield started
    harness_module.stop(started)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_same_outcome_as_plain_celery(harness, scenario, mode):
    plain = harness.outcome(scenario, "plain")
    if mode == "plain":
        since = DOCUMENTED_SINCE.get(scenario.__name__, (0, 0))
        if CELERY < since:
            pytest.skip(f"Celery {since[0]}.{since[1]} first gives the documented outcome; this one gives {plain!r}, "
                        "what the other modes are compared with")
        assert plain == EXPECTED[scenario.__name__], "plain Celery does what Celery documents"
        return
    different = DIFFERENCES.get((scenario.__name__, mode))
    if different is not None:
        assert different != plain, "a listed difference is one"
        assert harness.outcome(scenario, mode) == different, f"{mode}: the deliberate difference"
        return
    assert harness.outcome(scenario, mode) == plain, f"{mode} differs from plain Celery"
