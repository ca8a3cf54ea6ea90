"""Start-up checks that the dedupe window and durable scheduling fit the broker's redelivery.

No transaction: they read the settings and warn. ``check_dedupe_window`` warns when the broker's
``visibility_timeout`` (Redis, SQS) or a task's retry delays could bring a copy back after its
handled row is gone (``outbox_keep_after_handling``): that copy would run again.
``check_release_ahead`` warns when ``outbox_release_ahead`` reaches Redis' visibility timeout: the
broker would deliver a released scheduled message again while a worker holds it, and another
worker would hold a copy the inbox discards. See docs/operations.md.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["check_dedupe_window", "check_release_ahead", "redelivery_horizons", "visibility_timeout"]

logger = logging.getLogger("celery_outbox.window")

DEFAULT_VISIBILITY_TIMEOUT = 3600.0
VISIBILITY_TRANSPORTS = ("redis", "rediss", "sqs", "sentinel")


def _broker_scheme(app: Any) -> str:
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    return str(url).split("://", 1)[0].split("+", 1)[0].lower()


def visibility_timeout(app: Any) -> float | None:
    """Seconds after which ``app``'s broker delivers an unacknowledged message again (Redis, SQS);
    None for a broker that does not (RabbitMQ redelivers only when the consumer's channel closes)."""
    if _broker_scheme(app) not in VISIBILITY_TRANSPORTS:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


def redelivery_horizons(app: Any) -> list[tuple[str, float]]:
    """(what, seconds) for each way a message can come back after it was handled."""
    horizons: list[tuple[str, float]] = []
    timeout = visibility_timeout(app)
    if timeout is not None:
        horizons.append((f"the broker's visibility_timeout ({timeout:g}s)", timeout))
    from .tasks import IdempotentTask

    for task in list(app.tasks.values()):
        if not isinstance(task, IdempotentTask):
            continue
        retries = task.max_retries or 0
        delay = float(task.default_retry_delay or 0)
        if getattr(task, "retry_backoff", False):
            delay = float(getattr(task, "retry_backoff_max", delay) or delay)
        if retries and delay:
            horizons.append((f"{task.name}'s retries ({retries} x {delay:g}s)", retries * delay))
    return horizons


def check_dedupe_window(app: Any, window: float) -> list[str]:
    """Warn for every redelivery horizon of ``app`` at least as long as the dedupe ``window``
    (``outbox_keep_after_handling``); return the warnings."""
    warnings = []
    for what, seconds in redelivery_horizons(app):
        if seconds >= window:
            warnings.append(
                f"celery-outbox: {what} reaches beyond outbox_keep_after_handling ({window:g}s): a copy "
                f"redelivered after the window would run again. Raise outbox_keep_after_handling above {seconds:g}s."
            )
    for warning in warnings:
        logger.warning(warning)
    return warnings


def check_release_ahead(app: Any, release_ahead: float) -> list[str]:
    """Warn when ``release_ahead`` (``OutboxSettings.release_ahead_seconds``) reaches ``app``'s
    visibility timeout: a scheduled durable message held by a worker until its eta would be
    delivered again meanwhile. Return the warnings."""
    timeout = visibility_timeout(app)
    if timeout is None or release_ahead < timeout:
        return []
    warning = (f"celery-outbox: outbox_release_ahead ({release_ahead:g}s) reaches the broker's visibility_timeout "
               f"({timeout:g}s): a durable message published that long before its eta is delivered again while a "
               f"worker holds it. Lower outbox_release_ahead below {timeout:g}s.")
    logger.warning(warning)
    return [warning]
