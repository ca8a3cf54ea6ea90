"""Settings: three spellings, validation with clear errors, did-you-mean, frozen result."""

from __future__ import annotations

import dataclasses
import types
from datetime import timedelta

import pytest
from celery import Celery

from celery_outbox import ConfigurationError, IdempotencyStyle, MessageIdentity, OutboxSettings
from celery_outbox.core.config import SETTINGS, read_settings, setting_docs
from celery_outbox.store import utcnow


def app_with(**conf) -> Celery:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def settings_of(app: Celery) -> OutboxSettings:
    return read_settings(app.conf, namespace=app.namespace)


def test_defaults_when_nothing_is_set():
    settings = settings_of(app_with())
    assert settings == OutboxSettings()
    assert settings.database_url.startswith("sqlite:///")
    assert settings.durable_queues == frozenset()
    assert settings.message_identity is MessageIdentity.ID
    assert settings.idempotency_style is IdempotencyStyle.OPTIMISTIC


def test_lowercase_spelling():
    settings = settings_of(app_with(outbox_database_url="sqlite:///a.db", outbox_durable_queues=["payments"]))
    assert settings.database_url == "sqlite:///a.db"
    assert settings.durable_queues == frozenset({"payments"})


def test_old_style_uppercase_spelling():
    settings = settings_of(app_with(CELERY_OUTBOX_DURABLE_QUEUES="payments, orders", CELERY_OUTBOX_RELAY_BATCH_SIZE=7))
    assert settings.durable_queues == frozenset({"payments", "orders"})
    assert settings.relay_batch_size == 7


def test_django_namespace_spelling():
    django_settings = types.SimpleNamespace(
        CELERY_BROKER_URL="memory://",
        CELERY_OUTBOX_DURABLE_QUEUES=("payments",),
        CELERY_OUTBOX_IDEMPOTENCY_STYLE="eager",
        OUTBOX_SOMETHING_ELSE="not ours: no CELERY_ prefix",
    )
    app = Celery("t", set_as_current=False)
    app.config_from_object(django_settings, namespace="CELERY")
    settings = settings_of(app)
    assert settings.durable_queues == frozenset({"payments"})
    assert settings.idempotency_style is IdempotencyStyle.EAGER


def test_other_namespace():
    app = Celery("t", set_as_current=False)
    app.config_from_object(types.SimpleNamespace(TASKS_OUTBOX_TABLE_PREFIX="shop_"), namespace="TASKS")
    assert settings_of(app).table_prefix == "shop_"


def test_unknown_setting_is_an_error_with_a_did_you_mean():
    expected = r"unknown setting outbox_durable_queue; did you mean outbox_durable_queues\?"
    with pytest.raises(ConfigurationError, match=expected):
        settings_of(app_with(outbox_durable_queue=["x"]))
    with pytest.raises(ConfigurationError, match="did you mean CELERY_OUTBOX_DATABASE_URL"):
        settings_of(app_with(CELERY_OUTBOX_DATABSE_URL="sqlite://"))


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("outbox_table_prefix", "drop table;", "SQL identifier"),
        ("outbox_table_prefix", "1abc", "SQL identifier"),
        ("outbox_table_prefix", "x" * 40, "at most 32"),
        ("outbox_message_identity", "uuid", "'id', 'id_and_destination'"),
        ("outbox_idempotency_style", "pessimistic", "'optimistic', 'eager'"),
        ("outbox_keep_after_handling", -1, "positive number of seconds"),
        ("outbox_keep_after_handling", "1 day", "positive number of seconds"),
        ("outbox_relay_batch_size", 0, "positive whole number"),
        ("outbox_relay_batch_size", True, "positive whole number"),
        ("outbox_durable_queues", 5, "queue names"),
        ("outbox_durable_queues", ["ok", ""], "non-empty string"),
        ("outbox_auto_create_schema", "maybe", "True or False"),
        ("outbox_database_url", "", "non-empty string"),
        ("outbox_keep_after_handling", float("inf"), "finite positive number of seconds"),
        ("outbox_node_heartbeat_interval", float("nan"), "finite positive number of seconds"),
        ("outbox_inbox_stale_time", float("inf"), "finite positive number of seconds"),
        ("outbox_keep_after_handling", 10**400, "finite positive number of seconds"),
        ("outbox_keep_after_handling", 1e15, "at most 3153600000"),
        ("outbox_dead_letter_retention", timedelta.max, "at most 3153600000"),
        ("outbox_cleanup_rest", float("inf"), "finite number from 0 to 1000"),
        ("outbox_cleanup_rest", float("nan"), "finite number from 0 to 1000"),
        ("outbox_cleanup_rest", 10**400, "finite number from 0 to 1000"),
        ("outbox_relay_batch_size", 2**31, "at most 2147483647"),
        ("outbox_release_ahead", 0, "finite positive number of seconds"),
        ("outbox_release_ahead", "15s", "finite positive number of seconds"),
        ("outbox_release_ahead", 4, "at least outbox_recover_interval (5 s)"),
        ("outbox_metrics_port", 0, "a TCP port from 1 to 65535"),
        ("outbox_metrics_port", 65536, "a TCP port from 1 to 65535"),
        ("outbox_metrics_port", "http", "a TCP port from 1 to 65535"),
        ("outbox_metrics_port", True, "a TCP port from 1 to 65535"),
        ("outbox_metrics_address", "", "non-empty string"),
    ],
)
def test_bad_values_name_the_setting_the_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigurationError) as error:
        settings_of(app_with(**{key: value}))
    message = str(error.value)
    assert key in message and repr(value) in message and allowed in message


def test_the_metrics_port_may_be_given_as_digits_as_from_the_environment():
    settings = settings_of(app_with(CELERY_OUTBOX_METRICS_PORT=" 9808 "))
    assert (settings.metrics_port, settings.metrics_address) == (9808, "127.0.0.1")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_no_number_setting_accepts_a_non_finite_value(value):
    numeric = [s.key for s in SETTINGS if isinstance(s.default, (int, float)) and not isinstance(s.default, bool)
               or s.key.endswith(("_time", "_retention", "_after"))]
    assert len(numeric) >= 15
    for key in numeric:
        with pytest.raises(ConfigurationError, match=key):
            settings_of(app_with(**{key: value}))


@pytest.mark.parametrize(
    "conf, namespace, right",
    [
        ({"OUTBOX_DURABLE_QUEUES": ["x"]}, None, "CELERY_OUTBOX_DURABLE_QUEUES"),
        ({"celery_outbox_durable_queues": ["x"]}, None, "outbox_durable_queues"),
        ({"Outbox_Durabel_Queues": ["x"]}, None, "CELERY_OUTBOX_DURABLE_QUEUES"),
        ({"CELERY_OUTBOX_durable_queues": ["x"]}, None, "CELERY_OUTBOX_DURABLE_QUEUES"),
        ({"CELERY_OUTBOX_TABLE_PREFIX": "shop_"}, "TASKS", "TASKS_OUTBOX_TABLE_PREFIX"),
        ({"outbox_durabel_queues": ["x"]}, None, "outbox_durable_queues"),
        ({"CELERY_OUTBOX_DURABLE_QUEUE": ["x"]}, None, "CELERY_OUTBOX_DURABLE_QUEUES"),
    ],
)
def test_a_setting_with_a_wrong_prefix_is_an_error_naming_the_right_spelling(conf, namespace, right):
    with pytest.raises(ConfigurationError, match=f"did you mean {right}\\?"):
        read_settings(conf, namespace=namespace)


def test_other_keys_mentioning_outbox_are_left_alone():
    conf = {"MYAPP_OUTBOX_ENABLED": True, "OUTBOX_SOMETHING_ELSE": 1, "shop_outbox_url": "x", "outbox": 1}
    assert read_settings(conf) == OutboxSettings()


def test_a_setting_given_twice_with_different_values_is_an_error():
    with pytest.raises(ConfigurationError, match="disagree"):
        settings_of(app_with(outbox_relay_batch_size=5, CELERY_OUTBOX_RELAY_BATCH_SIZE=6))


def test_durations_accept_timedelta_and_settings_are_frozen():
    settings = settings_of(app_with(outbox_keep_after_handling=timedelta(days=2), outbox_inbox_stale_time=90))
    assert settings.keep_after_handling == 2 * 86400.0
    assert settings.inbox_stale_time == 90.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.relay_batch_size = 1  # type: ignore[misc]


def test_scheduled_messages_are_released_three_recover_intervals_ahead_unless_set():
    """The release window defaults to three recover intervals, so a recover pass always falls in it."""
    now = utcnow()
    assert settings_of(app_with()).release_before(now) == now + timedelta(seconds=15)
    assert settings_of(app_with(outbox_recover_interval=2)).release_before(now) == now + timedelta(seconds=6)
    assert settings_of(app_with(outbox_release_ahead=timedelta(minutes=1))).release_before(now) == now + timedelta(
        minutes=1)


def test_a_scheduled_messages_redelivery_counts_from_its_eta():
    settings = settings_of(app_with(outbox_redeliver_after=60))
    now = utcnow()
    assert settings.first_redelivery(now) == now + timedelta(seconds=60)
    assert settings.first_redelivery(now, now + timedelta(seconds=10)) == now + timedelta(seconds=70)
    assert settings.first_redelivery(now, now - timedelta(seconds=10)) == now + timedelta(seconds=60)


def test_a_claim_released_for_a_copy_the_broker_holds_waits_as_delivery_tracking_does():
    """Released for a copy the broker holds, a claim's envelope waits for ``outbox_redeliver_after``
    (``outbox_node_stale_after`` without tracking); released with no copy anywhere else (a message
    acked on receipt), it is due at once."""
    now = utcnow()
    tracked = settings_of(app_with(outbox_redeliver_after=60, outbox_node_stale_after=20))
    assert tracked.released_claim_recovery(now, handed_back=True) == now + timedelta(seconds=60)
    assert tracked.released_claim_recovery(now, handed_back=False) == now
    untracked = settings_of(app_with(outbox_redeliver_after=None, outbox_node_stale_after=20))
    assert untracked.released_claim_recovery(now, handed_back=True) == now + timedelta(seconds=20)
    assert untracked.released_claim_recovery(now, handed_back=False) == now


def test_overrides_win_and_are_validated():
    assert read_settings({"outbox_relay_batch_size": 5}, relay_batch_size=9).relay_batch_size == 9
    with pytest.raises(ConfigurationError, match="unknown setting 'nope'"):
        read_settings({}, nope=1)


def shown_default(default):
    """A default as docs/settings.md shows it: `repr`, "unset" for None, days spelled out."""
    if default is None:
        return "unset"
    cell = f"`{default!r}`"
    if isinstance(default, float) and default >= 86400 and default % 86400 == 0:
        cell += f" ({int(default // 86400)} days)"
    return cell


def settings_table() -> str:
    """The table of docs/settings.md, from SETTINGS. Print it with
    `python -c "from tests.unit.core.test_config import settings_table; print(settings_table())"`."""
    lines = ["| setting | uppercase / Django spelling | default | what it does |", "|---|---|---|---|"]
    for key, upper, default, doc in setting_docs():
        lines.append(f"| `{key}` | `{upper}` | {shown_default(default)} | {doc} |")
    return "\n".join(lines)


def test_every_setting_is_documented_with_its_default():
    from pathlib import Path

    page = (Path(__file__).parents[3] / "docs" / "settings.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `outbox_")}
    for setting in SETTINGS:
        assert f"`{setting.key}`" in rows, f"docs/settings.md does not document {setting.key}"
        cells = [cell.strip() for cell in rows[f"`{setting.key}`"].split("|")[1:-1]]
        assert cells[1] == f"`CELERY_{setting.key.upper()}`", setting.key
        assert cells[2] == shown_default(setting.default), (
            f"docs/settings.md gives {setting.key} the default {cells[2]}, the code {setting.default!r}")
    assert set(rows) == {f"`{s.key}`" for s in SETTINGS}, "docs/settings.md documents a setting the code lacks"
    assert settings_table() in page, "docs/settings.md's table differs from SETTINGS: regenerate it (settings_table)"


@pytest.mark.parametrize(
    "conf",
    [
        {"outbox_database_url": "postgresql+psycopg://u:pw-one@h/db?sslpassword=pw-two",
         "CELERY_OUTBOX_DATABASE_URL": "postgresql+psycopg://u:pw-three@h/db?password=pw-four"},
        {"outbox_engine_options": {"connect_args": {"password": "pw-one"}},
         "CELERY_OUTBOX_ENGINE_OPTIONS": {"connect_args": {"sslpassword": "pw-two"}}},
        {"outbox_engine_options": "pool_size=5 password=pw-one"},
        {"outbox_engine_options": [("connect_args", {"password": "pw-one"})]},
        {"outbox_database_url": b"postgresql+psycopg://u:pw-one@h/db"},
    ],
)
def test_errors_about_the_store_settings_print_no_secret(conf):
    with pytest.raises(ConfigurationError) as error:
        read_settings(conf)
    message = str(error.value)
    assert "pw-" not in message
    assert "outbox_database_url" in message.lower() or "outbox_engine_options" in message.lower()


def test_the_environments_database_url_wins_over_the_apps_and_an_override_over_both():
    conf = {"outbox_database_url": "sqlite:///app.db"}
    environ = {"CELERY_OUTBOX_DATABASE_URL": "sqlite:///env.db"}
    assert read_settings(conf).database_url == "sqlite:///app.db"
    assert read_settings(conf, environ=environ).database_url == "sqlite:///env.db"
    assert read_settings(conf, environ={"CELERY_OUTBOX_DATABASE_URL": ""}).database_url == "sqlite:///app.db"
    assert read_settings(conf, environ=environ, database_url="sqlite:///given.db").database_url == "sqlite:///given.db"


def test_a_bad_database_url_in_the_environment_is_named_by_its_variable():
    with pytest.raises(ConfigurationError, match="CELERY_OUTBOX_DATABASE_URL"):
        read_settings({}, environ={"CELERY_OUTBOX_DATABASE_URL": "   "})


def test_every_setting_is_a_field_whose_default_is_the_tables():
    """``OutboxSettings`` has one field per setting of ``SETTINGS``, and each default is the table's
    default as its parser reads it: defaults are written once, in the table."""
    import dataclasses

    from celery_outbox.core.config import OutboxSettings

    fields = [field.name for field in dataclasses.fields(OutboxSettings)]
    assert fields == [setting.name for setting in SETTINGS]
    defaults = OutboxSettings()
    for setting in SETTINGS:
        assert getattr(defaults, setting.name) == setting.parse(setting.key, setting.default), setting.key
    assert OutboxSettings().engine_options is not defaults.engine_options, "a mutable default is each instance's own"
