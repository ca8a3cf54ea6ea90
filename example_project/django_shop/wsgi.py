"""The shop's WSGI application (``gunicorn example_project.django_shop.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.django_shop.settings")
application = get_wsgi_application()
