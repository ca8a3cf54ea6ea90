"""Settings of celery-outbox, read from ``app.conf``, validated once, frozen.

No transaction. ``SETTINGS`` is the table of settings, ``OutboxSettings`` the frozen result, and
``read_settings``, called once by ``Outbox(app)``, reads ``app.conf`` in any of the three spellings
(docs/settings.md); the parser of each value is in ``setting_values``. A bad value, an unknown
``outbox_*`` key, or one of these settings spelt with a wrong prefix (``OUTBOX_...``,
``celery_outbox_...``) raises ``ConfigurationError``, with a did-you-mean; nothing is read at
import time.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Mapping

from ..errors import ConfigurationError
from ..vocabulary import IdempotencyStyle, MessageIdentity
from . import setting_values as parse
from .setting_values import invalid, shown

__all__ = ["DATABASE_URL_VARIABLE", "OutboxSettings", "SETTINGS", "Setting", "read_settings", "setting_docs"]

DEFAULT_DATABASE_URL = "sqlite:///celery_outbox.sqlite3"
DATABASE_URL_VARIABLE = "CELERY_OUTBOX_DATABASE_URL"  # the environment's store URL, read as CELERY_BROKER_URL is
MISSPELT_CUTOFF = 0.8  # how close the rest of an "outbox" key must be to a setting name to be ours


@dataclass(frozen=True)
class Setting:
    """One setting: its name without prefix, default, parser and one line of documentation."""

    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str

    @property
    def key(self) -> str:
        return f"outbox_{self.name}"


SETTINGS: tuple[Setting, ...] = (
    Setting("database_url", DEFAULT_DATABASE_URL, parse.string,
            "SQLAlchemy URL of the message store. PostgreSQL (`postgresql+psycopg://...`) in production; "
            "the SQLite default needs no server. `CELERY_OUTBOX_DATABASE_URL` in the environment wins over it, "
            "as `CELERY_BROKER_URL` does over `broker_url`."),
    Setting("engine_options", None, parse.mapping,
            "Extra keyword arguments for `sqlalchemy.create_engine` (pool size, echo, ...). On PostgreSQL, "
            "`connect_args` adds to the library's connection options or overrides them: a 5 s connect timeout, "
            "TCP keepalives and a 30 s `tcp_user_timeout`, so that a connection to a vanished server fails "
            "within about a minute ([faults.md](faults.md))."),
    Setting("async_database_url", None, parse.optional_string,
            "The URL of the async engine of async units of work (`Outbox.atransaction`, `Outbox.abegin`), "
            "naming the store's database: `postgresql+asyncpg://...` for asyncpg. By default the store's URL "
            "with its async driver: psycopg's async mode for PostgreSQL, aiosqlite for SQLite "
            "([asyncio.md](asyncio.md))."),
    Setting("async_publish_threads", 4, parse.positive_int,
            "Threads that publish what async units of work committed, off the event loop (kombu is "
            "synchronous). Each holds at most one producer of the app's pool while it publishes: keep it "
            "at or under `broker_pool_limit` ([asyncio.md](asyncio.md))."),
    Setting("tenants", None, parse.tenants,
            "The tenants whose messages live in a database (or a PostgreSQL schema) of their own: a dict of "
            "names to database URLs or to `{\"url\": ..., \"schema\": ...}`, a callable that returns one "
            "(asked again for a name it did not know, so tenants can be added at run time), or its dotted "
            "path. A unit of work for a tenant stores its messages in that tenant's tables, and the inbox "
            "claims them there; none: one store ([tenancy.md](tenancy.md))."),
    Setting("durable_queues", None, parse.queue_names,
            "Queues whose messages are stored in the outgoing table in the sender's transaction and relayed, "
            "and whose consumers keep a full envelope in the inbox. A list or a comma-separated string."),
    Setting("table_prefix", "celery_outbox_", parse.table_prefix,
            "Prefix of the tables the library creates; an SQL identifier."),
    Setting("django_database", "default", parse.string,
            "With `celery_outbox.django` in Django's `INSTALLED_APPS`: the Django database (alias) that holds "
            "the outbox's tables. Publishes inside `transaction.atomic()` on it join Django's transaction, and "
            "the message store is that database unless `outbox_database_url` is set."),
    Setting("message_identity", "id", parse.member_of(MessageIdentity),
            "What makes an incoming message a duplicate: the task id, or the task id and the queue "
            "(for one message consumed from several queues)."),
    Setting("deduplicate_task_ids", False, parse.boolean,
            "`False` (as in Celery): a task id sent again (`apply_async(task_id=...)` twice, a frozen "
            "signature applied again) runs again; only copies of one send (a broker redelivery, the relay, "
            "recovery) are duplicates. `True`: a delivery whose task id the inbox already handled is a "
            "duplicate, whichever send it came from (the task id as a dedupe key, per task). A task's "
            "`deduplicate_task_ids` attribute overrides it."),
    Setting("idempotency_style", "optimistic", parse.member_of(IdempotencyStyle),
            "`optimistic`: the inbox claim commits with the task's own DB writes. `eager`: the claim commits "
            "before the body runs, for bodies with side effects outside the database."),
    Setting("keep_after_handling", 7 * 24 * 3600.0, parse.seconds,
            "Seconds (or a timedelta) a handled inbox row is kept to reject redelivered duplicates: "
            "the dedupe window. Must outlive the broker's redelivery horizon."),
    Setting("node_heartbeat_interval", 5.0, parse.seconds,
            "Seconds between two heartbeats of a worker node."),
    Setting("node_stale_after", 30.0, parse.seconds,
            "A node whose last heartbeat is older than this many seconds is suspected dead. Also the grace "
            "before recovery re-publishes the envelope of a durable-queue delivery that nobody is running "
            "(an eager claim, or an optimistic attempt whose message no tracked outgoing row holds)."),
    Setting("node_stale_checks", 3, parse.positive_int,
            "Consecutive recover passes a node must be found stale before it is declared dead "
            "and its rows are released; on PostgreSQL also only once its liveness lock is free."),
    Setting("inbox_stale_time", None, parse.optional_seconds,
            "Opt-in: an inbox claim older than this many seconds (from claim time), not yet handled, is "
            "released for recovery even if its node is alive (a hung task). Off by default."),
    Setting("outbox_stale_time", None, parse.optional_seconds,
            "Opt-in (PostgreSQL): a relay or redelivery transaction that holds outgoing rows and idles longer "
            "than this many seconds (a publish hung on the broker) is ended, so another relay takes the rows "
            "and an inbox's claim waiting on them goes on. Off by default."),
    Setting("redeliver_after", 600.0, parse.optional_seconds,
            "Delivery tracking of durable queues: a sent message stays in the outgoing table until the "
            "consuming inbox has it, and is published again when that has not happened after this many "
            "seconds (doubling each time, up to an hour): a broker that loses a message (a Redis restart, "
            "a killed worker's prefetched messages) delays it, never loses it. A sender that dies between "
            "its commit and its publish (the rows are stored marked sent, so the commit needs no round trip "
            "after it) delays it less: its rows name its node, and recovery publishes them once it "
            "declares that node dead. Also the delay before the message of an optimistic "
            "`IdempotentTask` whose worker died mid-attempt on a durable queue is published again (its "
            "rolled-back claim leaves the sender's row), and before recovery publishes again the envelope "
            "of an eager claim released for a message Celery handed back to the broker "
            "(`Reject(requeue=True)`, a lost pool process), whose copy waits in the queue. Consumers of "
            "durable queues must share the store. `None` deletes sent rows at once (no tracking)."),
    Setting("relay_batch_size", 500, parse.positive_int,
            "Outgoing rows one relay (or redelivery) batch locks, publishes and marks sent."),
    Setting("relay_max_attempts", 10, parse.positive_int,
            "Failed publishes of one outgoing row (not counting broker outages) before it is moved to "
            "dead letters with reason `poison`, so one bad row never blocks the relay."),
    Setting("recover_batch_size", 1000, parse.positive_int,
            "Rows one recover step handles per short transaction."),
    Setting("cleanup_batch_size", 5000, parse.positive_int,
            "Handled rows one cleanup batch deletes, in its own short transaction."),
    Setting("cleanup_rest", 1.0, parse.non_negative_number,
            "After each cleanup batch, cleanup rests this many times as long as the batch took, so the "
            "inbox inserts of busy workers keep their latency while it deletes; `0` runs the batches "
            "back to back, as fast as the database allows."),
    Setting("max_batches_per_run", 100, parse.positive_int,
            "Cap on the batches one relay, recover or cleanup pass runs; the next pass continues."),
    Setting("recover_interval", 5.0, parse.seconds,
            "Seconds between two beat runs of `celery_outbox.recover`."),
    Setting("release_ahead", None, parse.optional_seconds,
            "Seconds before its eta a durable message sent with `countdown`/`eta` is published to the broker, "
            "with its eta, so the worker holds it and runs it at its eta as Celery does; until then it waits "
            "in the outgoing table (long countdowns never sit in the broker, where Redis' visibility timeout "
            "would deliver them again). At least `outbox_recover_interval`, which releases it; keep it well "
            "under Redis' `visibility_timeout` (a worker or beat starting with it at or above that timeout "
            "warns). Unset: three recover intervals (15 s)."),
    Setting("cleanup_interval", 60.0, parse.seconds,
            "Seconds between two beat runs of `celery_outbox.cleanup`."),
    Setting("maintenance_queue", None, parse.optional_string,
            "Queue the beat maintenance tasks are routed to; the default queue when unset."),
    Setting("dead_letter_retention", None, parse.optional_seconds,
            "Seconds a dead letter is kept; forever when unset."),
    Setting("auto_create_schema", True, parse.boolean,
            "Create missing tables when `Outbox(app)` starts. Turn off in production and run "
            "`celery -A proj outbox migrate` instead."),
    Setting("archive_path", None, parse.optional_string,
            "Where cleanup archives rows (Parquet) for the delivery audit: a path, a `file://` URI or a URI "
            "pyarrow writes (`s3://`, `s3a://`, `gs://`, `hdfs://`); nothing is archived when unset. A tenant's "
            "rows go to its folder `tenants/<name>` in it."),
    Setting("metrics_port", None, parse.optional_port,
            "A worker serves Prometheus metrics over HTTP on this port (`/metrics`): the counts of every "
            "process of its pool and the store's gauges. Needs the `metrics` extra (prometheus-client). "
            "Off when unset."),
    Setting("metrics_address", "127.0.0.1", parse.string,
            "The address the worker's metrics endpoint listens on; `0.0.0.0` for every interface."),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def _field(name: str) -> Any:
    """The ``OutboxSettings`` field of setting ``name``: its default is the table's, as the setting's
    parser reads it (a fresh one for each instance where that is mutable)."""
    setting = _BY_NAME[name]
    value = setting.parse(setting.key, setting.default)
    if value.__class__.__hash__ is None:  # a dict, list or set: one per instance
        return dataclasses.field(default_factory=lambda: setting.parse(setting.key, setting.default))
    return dataclasses.field(default=value)


@dataclass(frozen=True)
class OutboxSettings:
    """The validated settings of one ``Outbox``; see ``SETTINGS`` for each field's meaning and its
    default, written there once (``_field``)."""

    database_url: str = _field("database_url")
    engine_options: Mapping[str, Any] = _field("engine_options")
    async_database_url: str | None = _field("async_database_url")
    async_publish_threads: int = _field("async_publish_threads")
    tenants: Any = _field("tenants")
    durable_queues: frozenset[str] = _field("durable_queues")
    table_prefix: str = _field("table_prefix")
    django_database: str = _field("django_database")
    message_identity: MessageIdentity = _field("message_identity")
    deduplicate_task_ids: bool = _field("deduplicate_task_ids")
    idempotency_style: IdempotencyStyle = _field("idempotency_style")
    keep_after_handling: float = _field("keep_after_handling")
    node_heartbeat_interval: float = _field("node_heartbeat_interval")
    node_stale_after: float = _field("node_stale_after")
    node_stale_checks: int = _field("node_stale_checks")
    inbox_stale_time: float | None = _field("inbox_stale_time")
    outbox_stale_time: float | None = _field("outbox_stale_time")
    redeliver_after: float | None = _field("redeliver_after")
    relay_batch_size: int = _field("relay_batch_size")
    relay_max_attempts: int = _field("relay_max_attempts")
    recover_batch_size: int = _field("recover_batch_size")
    cleanup_batch_size: int = _field("cleanup_batch_size")
    cleanup_rest: float = _field("cleanup_rest")
    max_batches_per_run: int = _field("max_batches_per_run")
    recover_interval: float = _field("recover_interval")
    release_ahead: float | None = _field("release_ahead")
    cleanup_interval: float = _field("cleanup_interval")
    maintenance_queue: str | None = _field("maintenance_queue")
    dead_letter_retention: float | None = _field("dead_letter_retention")
    auto_create_schema: bool = _field("auto_create_schema")
    archive_path: str | None = _field("archive_path")
    metrics_port: int | None = _field("metrics_port")
    metrics_address: str = _field("metrics_address")

    def is_durable(self, queue: str | None) -> bool:
        return queue is not None and queue in self.durable_queues

    def destination_of(self, queue: str) -> str | None:
        """The destination part of the key of a message from ``queue``: the queue with message
        identity ``id_and_destination``, None (any destination) with ``id``."""
        return queue if self.message_identity is MessageIdentity.ID_AND_DESTINATION else None

    def silent_before(self, now: datetime) -> datetime:
        """A node with no heartbeat since this instant, whose liveness lock is free (PostgreSQL),
        is dead: three heartbeats missed (at most ``node_stale_after``). A live node whose
        liveness connection dropped keeps heartbeating, so the lock alone never condemns it."""
        return now - timedelta(seconds=min(3 * self.node_heartbeat_interval, self.node_stale_after))

    @property
    def release_ahead_seconds(self) -> float:
        """How long before its eta a durable scheduled message goes to the broker (``release_ahead``,
        by default three recover intervals: a recover pass always falls inside the window)."""
        return 3 * self.recover_interval if self.release_ahead is None else self.release_ahead

    @functools.cached_property
    def _release_ahead(self) -> timedelta:
        return timedelta(seconds=self.release_ahead_seconds)

    def release_before(self, now: datetime) -> datetime:
        """The one release rule of durable scheduled messages, for the commit-time publisher and the
        relay alike: a message whose eta (``deliver_at``) is before this instant is published now,
        with its eta (the worker holds it until then); a later one waits in the outgoing table."""
        return now + self._release_ahead

    def first_redelivery(self, now: datetime, eta: datetime | None = None) -> datetime | None:
        """When a message sent ``now`` is published again if no inbox has acknowledged it; None
        without delivery tracking. A message released before its ``eta`` is held by the worker
        until then: its wait counts from its eta, so it is not redelivered while it is held."""
        if self.redeliver_after is None:
            return None
        return max(now, eta or now) + timedelta(seconds=self.redeliver_after)

    def released_claim_recovery(self, now: datetime, handed_back: bool) -> datetime:
        """When recovery re-publishes the envelope of a claim its attempt released ``now``.

        ``handed_back``: the message went back to the broker (``Reject(requeue=True)`` of an
        ``acks_late`` task, a store outage's send-back, a lost pool process or a hard time limit
        handed back). The broker holds that copy, which takes the claim over when it comes, however
        long the queue before it: recovery is the net for a copy the broker loses, and waits as
        delivery tracking waits for a sent message (``outbox_redeliver_after``), or
        ``outbox_node_stale_after`` without tracking. Due at once, it would send a second copy of
        a message still in the queue. Otherwise Celery acked the message on receipt: the envelope
        is its only copy, due at once."""
        if not handed_back:
            return now
        return self.first_redelivery(now) or now + timedelta(seconds=self.node_stale_after)

    def next_redelivery(self, now: datetime, redeliveries: int) -> datetime:
        """The redelivery after ``redeliveries`` of them: the delay doubles, up to an hour."""
        delay = min((self.redeliver_after or 0) * 2 ** min(redeliveries + 1, 20), 3600.0)
        return now + timedelta(seconds=max(delay, self.redeliver_after or 0))



def _setting_name(key: str, namespace: str) -> str | None:
    """The outbox setting a configuration key spells, without prefix, or None when it is not ours."""
    if key.startswith("outbox_"):
        return key[len("outbox_"):]
    upper_prefix = f"{namespace}_OUTBOX_"
    if key.startswith(upper_prefix) and key == key.upper():
        return key[len(upper_prefix):].lower()
    return None


def _misspelt(key: str, namespace: str) -> str | None:
    """The right spelling of the setting that a key with a wrong prefix or case names (``OUTBOX_...``,
    ``celery_outbox_...``, ``CELERY_OUTBOX_lower``), or None when the key does not name one of ours.

    Only keys containing "outbox" are looked at, and the part after it must be one of our setting
    names or very close to one (``MYAPP_OUTBOX_ENABLED`` is left alone)."""
    lowered = key.lower()
    if "outbox" not in lowered:
        return None
    rest = lowered.split("outbox", 1)[1].lstrip("_")
    close = difflib.get_close_matches(rest, list(_BY_NAME), n=1, cutoff=MISSPELT_CUTOFF)
    if not close:
        return None
    return f"outbox_{close[0]}" if key == lowered else f"{namespace}_OUTBOX_{close[0].upper()}"


def _unknown(key: str, name: str) -> ConfigurationError:
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
    hint = f"; did you mean {_spelled_like(key, close[0])}?" if close else ""
    known = ", ".join(s.key for s in SETTINGS)
    return ConfigurationError(f"unknown setting {key}{hint} (known settings: {known})")


def read_settings(conf: Mapping[str, Any], namespace: str | None = None, environ: Mapping[str, str] | None = None,
                  **overrides: Any) -> OutboxSettings:
    """Read and validate every ``outbox_*`` setting of a Celery ``app.conf``.

    ``CELERY_OUTBOX_DATABASE_URL`` in ``environ`` wins over ``conf``, as ``CELERY_BROKER_URL`` does
    for Celery's broker; ``overrides`` (lowercase names without the ``outbox_`` prefix) win over both.
    Raises ``ConfigurationError`` for an unknown key, a bad value, or one setting
    given twice with different values. A key that names one of our settings with a
    wrong prefix or case (``OUTBOX_DURABLE_QUEUES``, ``celery_outbox_durable_queues``)
    is an error too, with a did-you-mean, not a warning: the setting it meant would
    silently keep its default (a queue meant to be durable would not be).
    """
    namespace = (namespace or "CELERY").upper()
    found: dict[str, tuple[str, Any]] = {}
    for key in list(conf.keys()):
        name = _setting_name(key, namespace)
        if name is None:
            right = _misspelt(key, namespace)
            if right is not None:
                raise ConfigurationError(
                    f"setting {key} is not a spelling celery-outbox reads; did you mean {right}?")
            continue
        if name not in _BY_NAME:
            raise _unknown(key, name)
        value = conf[key]
        if name in found and found[name][1] != value:
            raise ConfigurationError(
                f"setting {found[name][0]} = {shown(key, found[name][1])} and {key} = {shown(key, value)} "
                "disagree: give it once"
            )
        found[name] = (key, value)
    from_environment = (environ or {}).get(DATABASE_URL_VARIABLE)
    if from_environment:
        found["database_url"] = (DATABASE_URL_VARIABLE, from_environment)
    for name, value in overrides.items():
        if name not in _BY_NAME:
            raise ConfigurationError(f"unknown setting {name!r} passed to Outbox()")
        found[name] = (_BY_NAME[name].key, value)
    values = {}
    for setting in SETTINGS:
        key, value = found.get(setting.name, (setting.key, setting.default))
        values[setting.name] = setting.parse(key, value)
    if values["release_ahead"] is not None and values["release_ahead"] < values["recover_interval"]:
        key = found["release_ahead"][0]
        raise invalid(key, found["release_ahead"][1],
                    f"expected at least outbox_recover_interval ({values['recover_interval']:g} s): a scheduled "
                    "message must be released by a recover pass before its eta")
    return OutboxSettings(**values)


def _spelled_like(key: str, name: str) -> str:
    if key.startswith("outbox_"):
        return f"outbox_{name}"
    return key[: len(key) - len(key.split("OUTBOX_", 1)[1])] + name.upper()


def setting_docs() -> list[tuple[str, str, Any, str]]:
    """(lowercase key, uppercase key, default, doc) for every setting: the README table's source."""
    return [(s.key, f"CELERY_{s.key.upper()}", s.default, s.doc) for s in SETTINGS]
