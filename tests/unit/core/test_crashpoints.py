"""Crash points (``celery_outbox.core.crashpoints``): a spec names a known point, an optional whole
count and an optional tenant."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from celery_outbox.core.crashpoints import ENVIRONMENT_VARIABLE, EXIT_CODE, _parse


def test_crashpoint_specs_are_validated():
    assert _parse(None) is None
    assert _parse("after_commit") == ("after_commit", 1, None)
    assert _parse("during_relay:3") == ("during_relay", 3, None)
    assert _parse("after_claim:2@globex") == ("after_claim", 2, "globex")
    assert _parse("before_commit@acme") == ("before_commit", 1, "acme")
    with pytest.raises(ValueError, match="names no crash point"):
        _parse("after_lunch")
    with pytest.raises(ValueError, match="whole number"):
        _parse("after_commit:x")
    with pytest.raises(ValueError, match="a tenant name"):
        _parse("after_commit@")
    with pytest.raises(ValueError, match="a tenant name"):
        _parse("after_commit:2@../x")


def test_a_crash_point_for_a_tenant_fires_only_while_working_for_it():
    """A process with ``after_commit:2@globex`` passes the point for other tenants and the default
    store as often as it likes, and exits at its second pass working for ``globex``."""
    script = (
        "from celery_outbox.core.crashpoints import crashpoint\n"
        "from celery_outbox.core.tenancy import using_tenant\n"
        "for tenant in (None, 'acme', None, 'acme'):\n"
        "    with using_tenant(tenant):\n"
        "        crashpoint('after_commit')\n"
        "print('others passed', flush=True)\n"
        "with using_tenant('globex'):\n"
        "    crashpoint('after_commit')\n"
        "    print('first globex passed', flush=True)\n"
        "    crashpoint('after_commit')\n"
        "print('never', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, ENVIRONMENT_VARIABLE: "after_commit:2@globex"})
    assert done.returncode == EXIT_CODE, done.stderr
    assert done.stdout.splitlines() == ["others passed", "first globex passed"]
