"""A process whose wall clock, as celery-outbox reads it, runs behind or ahead of the host's: the
library's ``utcnow`` shifted by a number of seconds, in every module that imported it. (libfaketime
offsets the whole process, but under it Python's sleeps fail with EINVAL or never end.)"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta


def shift(seconds: float) -> None:
    """From now on celery-outbox reads ``seconds`` added to the host's clock (negative: behind)."""
    from celery_outbox.store import base

    real = base.utcnow
    offset = timedelta(seconds=seconds)

    def skewed() -> datetime:
        return real() + offset

    for name, module in list(sys.modules.items()):
        if (name == "celery_outbox" or name.startswith("celery_outbox.")) and getattr(module, "utcnow", None) is real:
            module.utcnow = skewed
