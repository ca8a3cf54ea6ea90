"""The worker's start-up checks (``celery_outbox.consumer.window``): when the dedupe window is too
short, or scheduled messages are released too early, for the broker's visibility timeout."""

from __future__ import annotations

from celery import Celery

from celery_outbox import IdempotentTask, Outbox
from celery_outbox.consumer.window import check_dedupe_window, check_release_ahead


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
