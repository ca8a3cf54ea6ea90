"""The outbox's tables, created by the store's own migration (``celery_outbox.django.schema``)."""

from django.db import migrations


def create_tables(apps, schema_editor):
    from celery_outbox.django.schema import create_tables

    create_tables(schema_editor.connection.alias)


def drop_tables(apps, schema_editor):
    from celery_outbox.django.schema import drop_tables

    drop_tables(schema_editor.connection.alias)


class Migration(migrations.Migration):
    atomic = False  # each statement of the store's migration commits on its own, as from the CLI
    initial = True
    dependencies = []
    operations = [migrations.RunPython(create_tables, drop_tables, elidable=False)]
