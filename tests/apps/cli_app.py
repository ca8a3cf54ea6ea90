"""A minimal Celery app for the CLI tests: store URL and prefix come from the environment."""

import os

from celery import Celery

from celery_outbox import Outbox

app = Celery("cli_app", broker=os.environ.get("TEST_BROKER_URL", "memory://"))
app.conf.outbox_database_url = os.environ["TEST_DATABASE_URL"]
app.conf.outbox_table_prefix = os.environ.get("TEST_TABLE_PREFIX", "celery_outbox_")
app.conf.outbox_relay_batch_size = int(os.environ.get("TEST_RELAY_BATCH_SIZE", 500))
outbox = Outbox(app)
