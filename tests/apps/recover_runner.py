"""Runs one recover pass in a fresh process, started together with others by a barrier."""

from __future__ import annotations

import os


def run(env: dict[str, str], barrier, results) -> None:
    os.environ.update(env)
    from tests.apps import cli_app

    cli_app.outbox.ready()
    barrier.wait(timeout=60)
    results.put(cli_app.outbox.recover(max_batches=100_000).as_dict())
