"""The versions of the libraries the suite runs against, for the few tests whose expected outcome
is what that version of the library does (the suite runs on the newest releases and, in
``tox -e lowest``, on the oldest that ``setup.cfg`` admits)."""

from __future__ import annotations

import celery
import kombu

#: (major, minor) of Celery
CELERY = tuple(celery.VERSION[:2])
#: (major, minor) of kombu
KOMBU = tuple(kombu.VERSION[:2])
