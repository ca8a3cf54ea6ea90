"""CPU time spent so far, by part of the system a worker benchmark measures (read from ``/proc``)."""

from __future__ import annotations

import json
import os
import time

CPU_PARTS = ("worker", "pool", "PostgreSQL", "broker")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_by_process(worker_session: int) -> dict[str, dict[str, float]]:
    """CPU time (user + system) spent so far, by part, for each process, keyed by its pid and its
    start time (a reused pid is another process): the worker's main process (the leader of
    session ``worker_session``: it receives and acknowledges the messages), its pool (the
    session's other processes: they run the tasks), PostgreSQL (all its processes) and the broker
    (Redis and RabbitMQ).
    One pass over ``/proc``: about a millisecond with a hundred processes."""
    spent: dict[str, dict[str, float]] = {part: {} for part in CPU_PARTS}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the process ended meanwhile
            continue
        session, ticks = int(fields[3]), int(fields[11]) + int(fields[12])
        if session == worker_session:
            part = "worker" if int(entry.name) == session else "pool"
        else:
            part = ("PostgreSQL" if name in ("postgres", "postmaster")
                    else "broker" if name in ("redis-server", "beam.smp") else None)
        if part is not None:
            spent[part][f"{entry.name}:{fields[19]}"] = ticks / CLOCK_TICKS
    return spent


def cpu_seconds(worker_session: int) -> dict[str, float]:
    """CPU time spent so far by the processes of each part that run now (``cpu_by_process``)."""
    return {part: sum(each.values()) for part, each in cpu_by_process(worker_session).items()}


def spent_between(start: dict[str, dict[str, float]], end: dict[str, dict[str, float]]) -> dict[str, float]:
    """CPU time spent by each part between two readings of ``cpu_by_process``: by every process
    that runs at ``end``, since ``start`` or since it started. A process that ended in between is
    not counted (another client's PostgreSQL backend, a server another program stopped), so that a
    part never spends less than nothing when processes end."""
    return {part: sum(seconds - start[part].get(process, 0.0) for process, seconds in end[part].items())
            for part in CPU_PARTS}


def mark_reading(key: str) -> str:
    """What a block's mark ``key`` records, as JSON: the time, and the CPU the calling process's
    session (a worker and its pool) has spent so far, read before the time at a start
    (``...:start``) and after it at an end, so that the reading falls outside the block."""
    if key.endswith(":start"):
        cpu = cpu_by_process(os.getsid(0))
        now = time.time()
    else:
        now = time.time()
        cpu = cpu_by_process(os.getsid(0))
    return json.dumps({"time": now, "cpu": cpu})
