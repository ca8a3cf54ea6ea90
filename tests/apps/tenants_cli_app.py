"""A Celery app for the CLI tests of tenants: the default store's URL, the table prefix and the
tenants (``outbox_tenants`` as JSON) come from the environment."""

import json
import os

from celery import Celery

from celery_outbox import Outbox

app = Celery("tenants_cli_app", broker="memory://")
app.conf.outbox_database_url = os.environ["TEST_DATABASE_URL"]
app.conf.outbox_table_prefix = os.environ["TEST_TABLE_PREFIX"]
app.conf.outbox_tenants = json.loads(os.environ["TEST_TENANTS"])
outbox = Outbox(app)
