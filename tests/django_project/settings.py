"""Django settings of the test project: a shop whose orders are written with the ORM, on SQLite
(``default``) and on the local PostgreSQL (``pg``), with celery-outbox installed."""

import os
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.services import POSTGRES_URL

_postgres = make_url(POSTGRES_URL)
_sqlite = Path(tempfile.gettempdir()) / f"celery_outbox_django_{os.getpid()}.sqlite3"

SECRET_KEY = "celery-outbox tests"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
ROOT_URLCONF = "tests.django_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_outbox.django",
    "tests.django_project.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "/static/"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(_sqlite),
        "ATOMIC_REQUESTS": True,
        "TEST": {"NAME": str(_sqlite.with_name(f"test_{_sqlite.name}"))},
    },
    "pg": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _postgres.database,
        "USER": _postgres.username or "",
        "PASSWORD": _postgres.password or "",
        "HOST": _postgres.host or "",
        "PORT": str(_postgres.port or ""),
        "ATOMIC_REQUESTS": True,
        "TEST": {"NAME": f"test_celery_outbox_django_{os.getpid()}"},
    },
}
CELERY_OUTBOX_TABLE_PREFIX = "dj_outbox_"

# A worker process started by a test uses the test's databases (their names as the test runner made
# them) as its own: CELERY_OUTBOX_DJANGO_TEST_DATABASES = '{"default": "...", "pg": "..."}'. A fault
# drill changes more of a database's settings: CELERY_OUTBOX_DJANGO_TEST_DATABASE_SETTINGS =
# '{"pg": {"HOST": "127.0.0.1", "PORT": "40001"}}' (a proxy in front of PostgreSQL, a throwaway server)
# replaces those keys of the alias's settings.
if os.environ.get("CELERY_OUTBOX_DJANGO_TEST_DATABASES"):
    import json

    for _alias, _name in json.loads(os.environ["CELERY_OUTBOX_DJANGO_TEST_DATABASES"]).items():
        DATABASES[_alias]["NAME"] = _name
if os.environ.get("CELERY_OUTBOX_DJANGO_TEST_DATABASE_SETTINGS"):
    import json

    for _alias, _settings in json.loads(os.environ["CELERY_OUTBOX_DJANGO_TEST_DATABASE_SETTINGS"]).items():
        DATABASES[_alias].update(_settings)
