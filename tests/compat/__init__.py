"""The compatibility suite: Celery stays Celery with celery-outbox installed.

* ``tests/apps/compat_app.py``: one app, its mode from ``COMPAT_MODE`` (plain, outbox, durable,
  idempotent), defining every task the scenarios use;
* ``harness.py``: one real worker (threads pool) per mode, and beat for the durable modes, all
  started once per session; runs each scenario in all modes at once and caches the outcomes;
* ``scenarios.py``: the scenarios, each a function from a mode's context to a plain, comparable
  outcome, with what plain Celery gives;
* ``test_compat.py``: for each scenario and mode, the mode's outcome equals plain Celery's.

Run it alone with ``pytest -m compat tests/compat`` (about a minute and a half on two cores).
"""
