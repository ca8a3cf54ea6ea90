"""Pure checks: which messages the guard dead-letters; when the dedupe window is too short or
scheduled messages are released too early for the broker's visibility timeout."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_outbox import IdempotentTask, Outbox
from celery_outbox.consumer.window import check_dedupe_window, check_release_ahead
from celery_outbox.core.crashpoints import _parse
from celery_outbox.message.checks import malformed_reason

GOOD = {"task": "t.add", "id": "abc", "retries": 0, "timelimit": [None, None], "eta": None, "root_id": "abc"}


@pytest.mark.parametrize(
    "change, reason, words",
    [
        ({"id": None}, "malformed", "header 'id'"),
        ({"id": ""}, "malformed", "header 'id'"),
        ({"id": 5}, "malformed", "header 'id'"),
        ({"task": None}, "malformed", "header 'task'"),
        ({"retries": "1"}, "malformed", "'retries'"),
        ({"retries": -1}, "malformed", "'retries'"),
        ({"replaced_task_nesting": 1.5}, "malformed", "'replaced_task_nesting'"),
        ({"eta": 12}, "malformed", "'eta'"),
        ({"timelimit": "soon"}, "malformed", "'timelimit'"),
        ({"timelimit": [1, "x"]}, "malformed", "'timelimit'"),
        ({"task": "t.unknown"}, "unknown_task", "not registered"),
        ({"task": "t.unknown", "eta": 12}, "unknown_task", "not registered"),  # Celery looks at the name first
    ],
)
def test_malformed_headers_are_named(change, reason, words):
    verdict = malformed_reason({**GOOD, **change}, {"t.add"})
    assert verdict is not None and verdict[0] == reason and words in verdict[1]


def test_good_headers_pass_and_non_mappings_do_not():
    assert malformed_reason(GOOD, {"t.add"}) is None
    assert malformed_reason(["not", "a", "dict"], {"t.add"})[0] == "malformed"


def dedupe_warnings(outbox: Outbox) -> list[str]:
    """What the worker's start-up check says of ``outbox``'s app and dedupe window."""
    return check_dedupe_window(outbox.app, outbox.settings.keep_after_handling)


def make_app(**conf) -> Celery:
    app = Celery("w", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    app.conf.update(outbox_database_url="sqlite://", **conf)
    return app


def test_window_shorter_than_the_visibility_timeout_warns():
    app = make_app(outbox_keep_after_handling=600)
    warnings = dedupe_warnings(Outbox(app))
    assert len(warnings) == 1 and "visibility_timeout (3600s)" in warnings[0]
    assert "Raise outbox_keep_after_handling above 3600s" in warnings[0]


def test_window_shorter_than_a_retry_policy_warns():
    app = make_app(outbox_keep_after_handling=7200, broker_transport_options={"visibility_timeout": 60})
    outbox = Outbox(app)

    @app.task(base=IdempotentTask, bind=True, name="slow.retrier", max_retries=10, default_retry_delay=3600,
              shared=False)
    def retrier(self):
        return None

    warnings = dedupe_warnings(outbox)
    assert len(warnings) == 1 and "slow.retrier's retries (10 x 3600s)" in warnings[0]


def test_a_long_enough_window_is_quiet():
    assert dedupe_warnings(Outbox(make_app())) == []


def test_amqp_has_no_visibility_horizon():
    app = Celery("w", broker="amqp://guest@localhost//", set_as_current=False)
    app.conf.update(outbox_database_url="sqlite://", outbox_keep_after_handling=60)
    assert dedupe_warnings(Outbox(app)) == []


def release_warnings(outbox: Outbox) -> list[str]:
    """What the worker's start-up check says of ``outbox``'s release of scheduled messages."""
    return check_release_ahead(outbox.app, outbox.settings.release_ahead_seconds)


def test_a_release_ahead_reaching_the_visibility_timeout_warns():
    app = make_app(outbox_release_ahead=600, broker_transport_options={"visibility_timeout": 300})
    warnings = release_warnings(Outbox(app))
    assert len(warnings) == 1 and "outbox_release_ahead (600s)" in warnings[0]
    assert "visibility_timeout (300s)" in warnings[0] and "Lower outbox_release_ahead below 300s" in warnings[0]


def test_the_default_release_ahead_is_quiet_and_amqp_has_no_visibility_timeout():
    assert release_warnings(Outbox(make_app())) == []  # 15 s against Redis' default hour
    app = Celery("w", broker="amqp://guest@localhost//", set_as_current=False)
    app.conf.update(outbox_database_url="sqlite://", outbox_release_ahead=7200)
    assert release_warnings(Outbox(app)) == []


def test_a_worker_start_logs_both_checks(caplog):
    app = make_app(outbox_release_ahead=600, outbox_keep_after_handling=60,
                   broker_transport_options={"visibility_timeout": 300})
    outbox = Outbox(app)
    with caplog.at_level("WARNING", logger="celery_outbox.window"):
        outbox._on_worker_init(sender=None)
    logged = [record.getMessage() for record in caplog.records]
    assert any("reaches beyond outbox_keep_after_handling" in line for line in logged), logged
    assert any("Lower outbox_release_ahead below 300s" in line for line in logged), logged


def test_crashpoint_specs_are_validated():
    assert _parse(None) is None
    assert _parse("after_commit") == ("after_commit", 1)
    assert _parse("during_relay:3") == ("during_relay", 3)
    with pytest.raises(ValueError, match="names no crash point"):
        _parse("after_lunch")
    with pytest.raises(ValueError, match="whole number"):
        _parse("after_commit:x")
