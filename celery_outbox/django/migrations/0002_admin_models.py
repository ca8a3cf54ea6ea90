"""Unmanaged models over the outbox's tables, for the admin: no DDL (the tables are 0001's)."""

from django.db import migrations, models

from celery_outbox.django.settings import outbox_settings

PREFIX = outbox_settings().table_prefix


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('celery_outbox', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='DeadLetter',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('message_id', models.CharField(max_length=255)),
                ('destination', models.CharField(max_length=255)),
                ('task_name', models.CharField(max_length=255)),
                ('queue', models.CharField(max_length=255)),
                ('reason', models.CharField(max_length=32)),
                ('exception_type', models.CharField(max_length=255, null=True)),
                ('exception_message', models.TextField(null=True)),
                ('traceback', models.TextField(null=True)),
                ('retries', models.IntegerField()),
                ('nesting', models.IntegerField()),
                ('replays', models.IntegerField()),
                ('exchange', models.CharField(max_length=255)),
                ('routing_key', models.CharField(max_length=255)),
                ('body', models.BinaryField(null=True)),
                ('content_type', models.CharField(max_length=128, null=True)),
                ('content_encoding', models.CharField(max_length=64, null=True)),
                ('headers', models.TextField(null=True)),
                ('properties', models.TextField(null=True)),
                ('failed_at', models.DateTimeField()),
                ('replay_count', models.IntegerField()),
                ('replayed_at', models.DateTimeField(null=True)),
            ],
            options={
                'db_table': f'{PREFIX}dead_letters',
                'ordering': ['-failed_at', '-id'],
                'permissions': [('replay_deadletter', 'Can replay dead letters'),
                                ('purge_deadletter', 'Can purge dead letters')],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='IncomingMessage',
            fields=[
                ('message_id', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('destination', models.CharField(max_length=255)),
                ('send_id', models.CharField(max_length=64)),
                ('task_name', models.CharField(max_length=255)),
                ('queue', models.CharField(max_length=255)),
                ('status', models.CharField(max_length=16)),
                ('owner', models.IntegerField()),
                ('retries', models.IntegerField()),
                ('duplicates', models.IntegerField()),
                ('recoveries', models.IntegerField()),
                ('received_at', models.DateTimeField()),
                ('handled_at', models.DateTimeField(null=True)),
                ('keep_until', models.DateTimeField(null=True)),
            ],
            options={
                'db_table': f'{PREFIX}incoming',
                'ordering': ['-received_at'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='OutgoingMessage',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('message_id', models.CharField(max_length=255)),
                ('task_name', models.CharField(max_length=255)),
                ('destination', models.CharField(max_length=255)),
                ('attempts', models.IntegerField()),
                ('last_error', models.TextField(null=True)),
                ('created_at', models.DateTimeField()),
                ('deliver_at', models.DateTimeField(null=True)),
                ('expires_at', models.DateTimeField(null=True)),
                ('sent_at', models.DateTimeField(null=True)),
                ('redeliver_at', models.DateTimeField(null=True)),
                ('redeliveries', models.IntegerField()),
            ],
            options={
                'db_table': f'{PREFIX}outgoing',
                'ordering': ['id'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
    ]
