"""The Django settings of the benchmarks' process (``django``, ``peers``): one PostgreSQL database,
celery-outbox's app and, where the ``bench`` extra installed it, django-celery-outbox's.

Django is set up once per process, so the two benchmarks share these settings, whichever runs
first. The database is ``postgres`` on the benchmarks' server, not the ``test`` database the other
benchmarks' outboxes use, so that none of them joins Django's transactions. Also usable as a
settings module: ``DJANGO_SETTINGS_MODULE=benchmarks.django_settings``.
"""

from __future__ import annotations

import importlib.util

from sqlalchemy.engine import make_url

from .common import POSTGRES_URL

DJANGO_DATABASE = "postgres"
# django-celery-outbox (a peer: benchmarks/peers.py) where installed; it needs no setting of its
# own here (its relay is built with the Celery app, and CELERY_OUTBOX_APP, the only setting it
# requires, is read by its relay command alone)
PEER_APPS = [app for app in ("django_celery_outbox",) if importlib.util.find_spec(app) is not None]

_url = make_url(POSTGRES_URL)
INSTALLED_APPS = ["django.contrib.contenttypes", "celery_outbox.django", *PEER_APPS]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# django-celery-outbox sends StatsD metrics by default (UDP, two a relayed message, one a stored one);
# celery-outbox sends none: off, so that both do the same work
MONITORING_METRICS_ENABLED = False
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": DJANGO_DATABASE,
                         "USER": _url.username or "", "PASSWORD": _url.password or "",
                         "HOST": _url.host or "", "PORT": str(_url.port or "")}}


def configure() -> None:
    """Set Django up in this process with these settings (once: a second call does nothing)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(INSTALLED_APPS=INSTALLED_APPS, USE_TZ=USE_TZ, DEFAULT_AUTO_FIELD=DEFAULT_AUTO_FIELD,
                       DATABASES=DATABASES, MONITORING_METRICS_ENABLED=MONITORING_METRICS_ENABLED)
    django.setup()
