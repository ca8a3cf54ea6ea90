"""Prometheus metrics of celery-outbox (the ``metrics`` extra: prometheus-client).

Transaction boundary: none that writes. The counters and histograms (``OutboxMetrics``) are fed by
the library's signals, sent once their transactions committed, and by Celery's task signals; the
gauges (``StoreCollector``) are read at each scrape with the one status query per store (the
default one and each tenant's), in a read-only transaction. Guarantee: a store that does not
answer makes its ``celery_outbox_store_up{tenant=...}`` 0, not a failed scrape. A worker serves
both on ``/metrics`` (``serve_from_worker``, a prefork pool through Prometheus' multiprocess
mode), ``celery outbox metrics`` the gauges; see docs/monitoring.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator

from ..core.tenancy import using_tenant
from ..errors import ConfigurationError
from ..signals import (
    claims_released,
    duplicate_discarded,
    message_dead_lettered,
    message_handled,
    message_published,
    message_redelivered,
    messages_stored,
    publish_failed,
)
from ..store import utcnow
from ..vocabulary import ClaimRelease, DeadLetterReason, RedeliveryReason

__all__ = ["MULTIPROCESS_DIR_VARIABLE", "OutboxMetrics", "StoreCollector", "install", "serve", "serve_from_worker"]

logger = logging.getLogger("celery_outbox.metrics")

MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "celery_outbox"
# seconds: from a millisecond (a publish at commit) to the relay's pace and redelivery's minutes
# dead letters whose task name is not one the worker registered: counted without it
UNREGISTERED_TASK_REASONS = frozenset({DeadLetterReason.MALFORMED, DeadLetterReason.UNKNOWN_TASK})
DELAY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError("celery-outbox metrics need prometheus-client: "
                                 "pip install 'celery-outbox[metrics]'") from None
    return prometheus_client


class OutboxMetrics:
    """The counters and histograms of one process, fed by the signals of one outbox.

    ``connect(sender)`` listens to the signals ``sender`` (an ``Outbox``) sends; every receiver
    only adds to a metric: it never raises into the path of a message. ``start_at_zero`` makes the
    series of every known label set exist at 0 before its first event, so that ``increase()`` and
    ``rate()`` see that event."""

    def __init__(self, registry: Any = None) -> None:
        client = _prometheus()
        registry = client.REGISTRY if registry is None else registry

        def counter(name: str, documentation: str, labels: Iterable[str]) -> Any:
            return client.Counter(f"{PREFIX}_{name}", documentation, list(labels), registry=registry)

        def histogram(name: str, documentation: str, labels: Iterable[str]) -> Any:
            return client.Histogram(f"{PREFIX}_{name}", documentation, list(labels), registry=registry,
                                    buckets=DELAY_BUCKETS)

        self.stored = counter("messages_stored", "Durable messages committed to the outgoing table", ["queue"])
        self.published = counter("messages_published", "Messages the broker accepted right after their commit",
                                 ["queue"])
        self.relayed = counter("messages_relayed", "Stored messages the relay published later", ["queue"])
        self.publish_failures = counter("publish_failures", "Publishes that failed (a durable message waits for "
                                        "the relay; any other is lost)", ["queue", "durable"])
        self.redelivered = counter("messages_redelivered", "Sent messages published again: unacknowledged by any "
                                   "inbox, or lost with their worker", ["queue", "reason"])
        self.duplicates = counter("duplicates_discarded", "Redelivered copies the inbox discarded", ["task", "queue"])
        self.dead_letters = counter("dead_letters", "Messages moved to dead letters", ["reason", "task"])
        self.claims_taken_over = counter("claims_taken_over", "Inbox claims released for another worker to take "
                                         "over: their node died, or they were stale", ["reason"])
        self.commit_to_publish = histogram("commit_to_publish_seconds", "From a message's commit to the broker "
                                           "accepting it (at commit, or by the relay)", ["via"])
        self.claim_to_handled = histogram("claim_to_handled_seconds", "From an attempt's inbox claim to its "
                                          "handled commit", ["task"])
        self.task_runtime = histogram("task_runtime_seconds", "A task's run in the worker, Celery's task_prerun to "
                                      "its task_postrun (an IdempotentTask's claim and commit included)", ["task"])
        self._started: dict[str, float] = {}  # task id -> monotonic moment of its prerun, until its postrun
        self._receivers: list[tuple[Any, Callable[..., None]]] = []

    def connect(self, sender: Any) -> "OutboxMetrics":
        """Count the signals ``sender`` sends from now on (in this process and those it forks)."""
        for signal, receiver in (
            (messages_stored, self._on_stored), (message_published, self._on_published),
            (publish_failed, self._on_publish_failed), (message_redelivered, self._on_redelivered),
            (duplicate_discarded, self._on_duplicate), (message_dead_lettered, self._on_dead_letter),
            (claims_released, self._on_claims_released), (message_handled, self._on_handled),
        ):
            signal.connect(receiver, sender=sender, weak=False)
            self._receivers.append((signal, receiver))
        app = getattr(sender, "app", None)
        if app is not None:  # the runs of this app's tasks (Celery's signals name the task, not the app)
            from celery.signals import task_postrun, task_prerun

            def prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
                if task_id is not None and getattr(task, "app", None) is app:
                    self._started[task_id] = time.monotonic()

            def postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
                started = self._started.pop(task_id, None) if task_id is not None else None
                if started is not None:
                    self.task_runtime.labels(task.name).observe(time.monotonic() - started)

            for signal, receiver in ((task_prerun, prerun), (task_postrun, postrun)):
                signal.connect(receiver, weak=False)
                self._receivers.append((signal, receiver))
        return self

    def start_at_zero(self, tasks: Iterable[str], durable_queues: Iterable[str]) -> "OutboxMetrics":
        """Create at 0 the series of every known label set: dead letters of each reason for each of
        ``tasks`` (or with no task, for the reasons counted without one), each task's run time,
        claims taken over for each reason, and, for each of ``durable_queues``, the messages stored,
        published, relayed, redelivered (for each reason) and failed to publish. Series of other
        label values (a plain queue, a task sent by name only) still appear at their first event."""
        tasks, durable_queues = sorted(set(tasks)), sorted(set(durable_queues))
        for reason in DeadLetterReason:
            for task in ([""] if reason in UNREGISTERED_TASK_REASONS else tasks):
                self.dead_letters.labels(reason.value, task)
        for task in tasks:
            self.task_runtime.labels(task)
        for release in ClaimRelease:
            self.claims_taken_over.labels(release.value)
        for queue in durable_queues:
            for counter in (self.stored, self.published, self.relayed):
                counter.labels(queue)
            self.publish_failures.labels(queue, "true")
            for redelivery in RedeliveryReason:
                self.redelivered.labels(queue, redelivery.value)
        return self

    def disconnect(self) -> None:
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)
        self._receivers.clear()

    def _on_stored(self, messages: list[Any], **_: Any) -> None:
        for message in messages:
            self.stored.labels(message.destination).inc()

    def _on_published(self, message: Any, relayed: bool, **_: Any) -> None:
        (self.relayed if relayed else self.published).labels(message.destination).inc()
        if message.committed_at is not None:
            delay = (utcnow() - message.committed_at).total_seconds()
            self.commit_to_publish.labels("relay" if relayed else "commit").observe(max(delay, 0.0))

    def _on_publish_failed(self, message: Any, **_: Any) -> None:
        self.publish_failures.labels(message.destination, str(bool(message.durable)).lower()).inc()

    def _on_redelivered(self, message: Any, reason: Any, **_: Any) -> None:
        self.redelivered.labels(message.destination, reason.value).inc()

    def _on_duplicate(self, task_name: str, queue: str | None, **_: Any) -> None:
        self.duplicates.labels(task_name or "", queue or "").inc()

    def _on_dead_letter(self, task_name: str | None, reason: Any, **_: Any) -> None:
        # a malformed message or an unknown task names whatever task its sender wrote: one series per
        # name would let hostile input grow the metrics without bound
        task = "" if reason in UNREGISTERED_TASK_REASONS else (task_name or "")
        self.dead_letters.labels(reason.value, task).inc()

    def _on_claims_released(self, count: int, reason: Any, **_: Any) -> None:
        self.claims_taken_over.labels(reason.value).inc(count)

    def _on_handled(self, task_name: str, seconds: float, **_: Any) -> None:
        self.claim_to_handled.labels(task_name).observe(seconds)


_installed: dict[tuple[int, int], OutboxMetrics] = {}


def install(outbox: Any, registry: Any = None) -> OutboxMetrics:
    """Count ``outbox``'s signals in this process, into ``registry`` (prometheus-client's default
    one unless given), for an application that serves its own ``/metrics`` (a web process that
    sends messages), every known series starting at 0 (``known_tasks``, the durable queues).
    Calling it again returns the same metrics."""
    key = (id(outbox), id(registry))
    if key not in _installed:
        _installed[key] = OutboxMetrics(registry).connect(outbox).start_at_zero(
            known_tasks(outbox.app), outbox.settings.durable_queues)
    return _installed[key]


def known_tasks(app: Any) -> list[str]:
    """The task names ``app`` registers, Celery's own (``celery.``) aside, once the app is finalized
    (a worker's is before it serves metrics); before that none, so that counting never finalizes an
    app early."""
    if not app.finalized:
        return []
    return sorted(name for name in app.tasks if not name.startswith("celery."))


class StoreCollector:
    """The gauges of the default store and of every tenant's, read by ``status`` (``Store.status``,
    called inside each store's ``using_tenant`` block) each time they are collected; each sample
    carries the ``tenant`` label ("" for the default store), whose values are the names
    ``tenants()`` (``runtime.tenants``, the configured ones) returns.

    A status that raises (that store's database is down) yields ``celery_outbox_store_up 0`` for
    its tenant and a warning; the other stores' gauges and the counters of the same scrape still
    arrive."""

    def __init__(self, status: Callable[[], dict[str, Any]],
                 tenants: Callable[[], Iterable[str]] | None = None) -> None:
        self.status = status
        self.tenants = tenants

    def describe(self) -> list[Any]:
        return []  # read at collection time only: the registry must not call the store when registering

    def collect(self) -> Iterator[Any]:
        up = _gauge("store_up", "1 when the message store answered the status query, else 0", ["tenant"])
        reports: list[tuple[str, dict[str, Any]]] = []
        for tenant in self._stores():
            report = self._read(tenant)
            up.add_metric([tenant or ""], 0 if report is None else 1)
            if report is not None:
                reports.append((tenant or "", report))
        yield up
        if reports:
            yield from _store_gauges(reports)

    def _stores(self) -> list[str | None]:
        """The default store (None), then each tenant's; only the default one when the tenants
        cannot be listed (a callable ``outbox_tenants`` that raised)."""
        if self.tenants is None:
            return [None]
        try:
            return [None, *self.tenants()]
        except Exception as exc:  # noqa: BLE001 - the default store's gauges still arrive
            logger.warning("celery-outbox metrics: the tenants could not be listed: %s", exc)
            return [None]

    def _read(self, tenant: str | None) -> dict[str, Any] | None:
        """``tenant``'s status report, or None (and a warning naming the store) when it raised."""
        try:
            with using_tenant(tenant):
                return self.status()
        except Exception as exc:  # noqa: BLE001 - the scrape goes on: store_up says the store is down
            where = "the store" if tenant is None else f"the store of tenant {tenant!r}"
            logger.warning("celery-outbox metrics: %s did not answer: %s", where, exc)
            return None


def _gauge(name: str, documentation: str, labels: Iterable[str] = ()) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=list(labels))


def _store_gauges(reports: list[tuple[str, dict[str, Any]]]) -> Iterator[Any]:
    """The gauges of the status reports of the stores that answered, by tenant ("": the default store)."""
    after = reports[0][1]["stuck"]["after_seconds"]
    outgoing = _gauge("outgoing_messages", "Outgoing rows by status: pending (due, not sent), scheduled (held "
                      "until their eta), sent (awaiting their inbox's acknowledgment)", ["status", "queue", "tenant"])
    incoming = _gauge("incoming_messages", "Inbox rows by status", ["status", "queue", "tenant"])
    dead_letters = _gauge("dead_letter_messages", "Dead letters kept, by reason and task", ["reason", "task", "tenant"])
    stuck = _gauge("stuck_messages", f"Rows waiting longer than {after:g} s: unsent due outgoing rows, and running "
                   "claims", ["table", "tenant"])
    when = {name: _gauge(f"{name}_timestamp_seconds", documentation, ["tenant"]) for name, documentation in (
        ("oldest_pending_outgoing", "When the oldest due outgoing row not sent yet was committed (Unix seconds; "
                                    "absent: none)"),
        ("oldest_running_incoming", "When the oldest running inbox claim's message was received (absent: none)"),
        ("newest_dead_letter", "When the newest dead letter kept failed (absent: none)"))}
    nodes = _gauge("nodes", "Registered nodes (worker and sender processes) by host", ["hostname", "tenant"])
    stalest = _gauge("stalest_heartbeat_timestamp_seconds", "The least recent heartbeat of a host's registered "
                     "nodes (Unix seconds, the database's clock)", ["hostname", "tenant"])
    for tenant, report in reports:
        for row in report["outgoing"]:
            outgoing.add_metric([row["status"], row["destination"], tenant], row["count"])
        for row in report["incoming"]:
            incoming.add_metric([row["status"], row["queue"] or "", tenant], row["count"])
        for row in report["dead_letters"]:
            dead_letters.add_metric([row["reason"], row["task"], tenant], row["count"])
        for table in ("outgoing", "incoming"):
            stuck.add_metric([table, tenant], report["stuck"][table])
        for name, family in when.items():
            moment = report["timestamps"][name]
            if moment is not None:
                family.add_metric([tenant], moment)
        for hostname, beats in _heartbeats_by_host(report["nodes"]):
            nodes.add_metric([hostname, tenant], len(beats))
            stalest.add_metric([hostname, tenant], min(beats))
    yield from (outgoing, incoming, dead_letters, stuck, *when.values(), nodes, stalest)


def _heartbeats_by_host(nodes: Iterable[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    """The heartbeat moments of the nodes that beat, by hostname, sorted by hostname."""
    hosts: dict[str, list[float]] = {}
    for node in nodes:
        if node["heartbeat_at"] is not None:
            hosts.setdefault(node["hostname"] or "", []).append(node["heartbeat_at"])
    return sorted(hosts.items())


def serve(status: Callable[[], dict[str, Any]], port: int, address: str = "127.0.0.1",
          tenants: Callable[[], Iterable[str]] | None = None) -> Any:
    """Serve ``/metrics`` over HTTP on ``address:port`` from a thread: the gauges of the default
    store and of each of ``tenants()`` (``StoreCollector``), and the counters of every process that
    counts into ``PROMETHEUS_MULTIPROC_DIR`` when it is set.
    Returns the server (``shutdown()`` stops it); the caller says where it serves. Raises
    ``ConfigurationError`` when the address cannot be bound."""
    client = _prometheus()
    registry = client.CollectorRegistry()
    if os.environ.get(MULTIPROCESS_DIR_VARIABLE):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    registry.register(StoreCollector(status, tenants))
    try:
        server, _ = client.start_http_server(port, address, registry)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
    return server


def use_multiprocess_dir() -> str:
    """Make this process and those it forks count into one multiprocess folder: the one
    ``PROMETHEUS_MULTIPROC_DIR`` names (it must exist; it is the operator's to empty between
    runs), or a new empty one, removed when the process that made it exits. Call before any
    counter is made."""
    directory = os.environ.get(MULTIPROCESS_DIR_VARIABLE)
    if directory:
        if not os.path.isdir(directory):
            raise ConfigurationError(f"{MULTIPROCESS_DIR_VARIABLE}={directory!r} is not a folder")
    else:
        directory = tempfile.mkdtemp(prefix="celery-outbox-metrics-")
        os.environ[MULTIPROCESS_DIR_VARIABLE] = directory
        maker = os.getpid()  # the pool's processes inherit the exit hook: only the maker removes it
        atexit.register(lambda: os.getpid() == maker and shutil.rmtree(directory, ignore_errors=True))
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # prometheus-client chose its value class at import
    return directory


def serve_from_worker(outbox: Any, port: int, address: str) -> Any:
    """A worker's metrics: counted by the main process and every pool process it forks (one
    multiprocess folder), and served with the gauges of every store on ``address:port``. Called at the
    worker's start, before Celery sets up its logging: where they are served is logged once the
    worker is ready."""
    from celery.signals import worker_ready

    _prometheus()
    use_multiprocess_dir()
    install(outbox)
    server = serve(outbox.status, port, address, outbox.runtime.tenants)

    def announce(**_: Any) -> None:
        worker_ready.disconnect(announce)
        logger.info("celery-outbox: metrics on http://%s:%d/metrics", address, port)

    worker_ready.connect(announce, weak=False)
    return server

