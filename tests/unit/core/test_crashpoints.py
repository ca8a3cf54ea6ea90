"""Crash points (``celery_outbox.core.crashpoints``): a spec names a known point and an optional whole
count."""

from __future__ import annotations

import pytest

from celery_outbox.core.crashpoints import _parse


def test_crashpoint_specs_are_validated():
    assert _parse(None) is None
    assert _parse("after_commit") == ("after_commit", 1)
    assert _parse("during_relay:3") == ("during_relay", 3)
    with pytest.raises(ValueError, match="names no crash point"):
        _parse("after_lunch")
    with pytest.raises(ValueError, match="whole number"):
        _parse("after_commit:x")
