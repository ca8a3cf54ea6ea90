"""Maintenance in bounded batches: each batch its own short transaction, up to the run's cap.

Transaction boundary: ``in_batches`` runs each step in a transaction of its own, until a batch
comes back short or ``outbox_max_batches_per_run`` is reached; the next run continues.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..core.runtime import Runtime

__all__ = ["in_batches"]


def in_batches(runtime: Runtime, batch_size: int, max_batches: int | None,
                step: Callable[[Any], int], durable: bool = True, rest: float = 0.0) -> tuple[int, int]:
    """Run ``step(conn)`` (which handles at most ``batch_size`` rows and returns how many), each time in
    its own short transaction, until a batch comes back short or the cap per run is reached.
    ``durable=False`` for steps whose lost commit is simply done again by the next pass: their
    commits do not wait for the WAL flush (nor hold up the flushes of other transactions). Before
    each next batch, sleep ``rest`` times as long as the batch took.
    Returns (rows handled, batches that handled any)."""
    total = batches = 0
    took = 0.0
    for _ in range(max_batches or runtime.settings.max_batches_per_run):
        if rest and took:
            time.sleep(rest * took)
        started = time.monotonic()
        with runtime.store.begin(durable=durable) as conn:
            count = step(conn)
        took = time.monotonic() - started
        total += count
        batches += bool(count)
        if count < batch_size:
            break
    return total, batches
