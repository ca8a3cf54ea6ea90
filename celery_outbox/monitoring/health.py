"""The health check: thresholds over one status report (``celery outbox check``).

``failed_conditions`` reads a report of ``Store.status`` and returns one ``Failure`` per
condition that does not hold; an empty list is healthy. It reads, never writes: a probe may run
it as often as it likes, on any process that reaches the store. ``CheckExit`` says what a
check's failures mean to whatever runs it: the store unreachable (a liveness probe's one
condition) is told apart from thresholds crossed (an alert's, a readiness probe's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum, IntEnum
from typing import Any, Sequence

__all__ = ["CheckExit", "Condition", "Failure", "Thresholds", "failed_conditions"]


class Condition(str, Enum):
    """The conditions the health check tests."""

    STORE = "store"  #: the message store answers
    PENDING_AGE = "pending_age"  #: the oldest due, unsent outgoing message is young enough
    DEAD_LETTERS = "dead_letters"  #: few enough dead letters in the recent window
    STUCK = "stuck"  #: few enough rows waiting longer than the stuck threshold
    NODE_SILENT = "node_silent"  #: every registered node beats
    NODES = "nodes"  #: enough live nodes


class CheckExit(IntEnum):
    """The exit codes of ``celery outbox check``, as monitoring plugins number them."""

    OK = 0  #: every condition holds
    THRESHOLDS = 1  #: the store answers, and a threshold is crossed (backlog, dead letters, nodes)
    STORE_DOWN = 2  #: the store does not answer (within the check's timeout)

    @classmethod
    def of(cls, failures: Sequence["Failure"]) -> "CheckExit":
        """The code of a check that found ``failures``."""
        if any(failure.condition is Condition.STORE for failure in failures):
            return cls.STORE_DOWN
        return cls.THRESHOLDS if failures else cls.OK


@dataclass(frozen=True)
class Thresholds:
    """What the check tolerates. ``None`` turns a condition off."""

    max_pending_age: float | None = 300.0  #: seconds the oldest pending outgoing message may wait
    max_dead_letters: int | None = 0  #: dead letters allowed within the status's recent window
    max_stuck: int | None = 0  #: rows allowed past the status's stuck threshold
    node_stale_after: float | None = 30.0  #: seconds without a heartbeat that make a node silent
    min_nodes: int = 0  #: live nodes expected at least


@dataclass(frozen=True)
class Failure:
    """One condition that does not hold: what, how much, against what, in one line."""

    condition: Condition
    value: Any
    threshold: Any
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "condition": self.condition.value}


def store_down(error: BaseException, timeout: float | None = None) -> Failure:
    """The failure of a check whose status query raised: within ``timeout`` seconds when the
    database gave up waiting for a locked table or cancelled a statement that ran past it."""
    if timeout is not None and _timed_out(error):
        return Failure(Condition.STORE, None, timeout,
                       f"the message store did not answer within {timeout:g} s: a table of it is locked (VACUUM "
                       f"FULL, a migration, LOCK TABLE) or the database is overloaded ({_first_line(error)})")
    return Failure(Condition.STORE, None, None, f"the message store did not answer: {error}")


def _timed_out(error: BaseException) -> bool:
    """PostgreSQL's lock_timeout (55P03) or statement_timeout (57014) cut the status query short."""
    from ..store import is_lock_timeout, is_statement_timeout

    if isinstance(error, TimeoutError):
        return True
    causes = (error, error.__cause__)  # the driver's error, or the one StoreUnavailable names
    return any(cause is not None and (is_lock_timeout(cause) or is_statement_timeout(cause)) for cause in causes)


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def failed_conditions(report: dict[str, Any], thresholds: Thresholds) -> list[Failure]:
    """Every condition of ``thresholds`` that ``report`` (``Store.status``) fails, in a fixed order."""
    failures: list[Failure] = []
    age = report["oldest_pending_outgoing_age_seconds"]
    if thresholds.max_pending_age is not None and age is not None and age > thresholds.max_pending_age:
        failures.append(Failure(Condition.PENDING_AGE, age, thresholds.max_pending_age,
                                f"the oldest pending outgoing message waits for {age:.1f} s (more than "
                                f"{thresholds.max_pending_age:g} s): the relay is behind, or the broker is down"))
    recent = report["recent_dead_letters"]
    if thresholds.max_dead_letters is not None and recent["count"] > thresholds.max_dead_letters:
        failures.append(Failure(Condition.DEAD_LETTERS, recent["count"], thresholds.max_dead_letters,
                                f"{recent['count']} dead letter(s) in the last {recent['seconds']:g} s (more than "
                                f"{thresholds.max_dead_letters}): `celery outbox dead-letters list` shows them"))
    stuck = report["stuck"]
    stuck_rows = stuck["outgoing"] + stuck["incoming"]
    if thresholds.max_stuck is not None and stuck_rows > thresholds.max_stuck:
        failures.append(Failure(Condition.STUCK, stuck_rows, thresholds.max_stuck,
                                f"{stuck_rows} message(s) waiting longer than {stuck['after_seconds']:g} s (more "
                                f"than {thresholds.max_stuck}): {stuck['outgoing']} outgoing not sent, "
                                f"{stuck['incoming']} claims running"))
    live = 0
    for node in report["nodes"]:
        beat = node["heartbeat_age_seconds"]
        if thresholds.node_stale_after is not None and (beat is None or beat > thresholds.node_stale_after):
            failures.append(Failure(Condition.NODE_SILENT, beat, thresholds.node_stale_after,
                                    f"node {node['id']} ({node['name'] or '?'}, pid {node['pid']} on "
                                    f"{node['hostname'] or '?'}) has not beaten for "
                                    f"{'ever' if beat is None else f'{beat:.1f} s'} (more than "
                                    f"{thresholds.node_stale_after:g} s)"))
        else:
            live += 1
    if live < thresholds.min_nodes:
        failures.append(Failure(Condition.NODES, live, thresholds.min_nodes,
                                f"{live} live node(s), expected at least {thresholds.min_nodes}"))
    return failures
