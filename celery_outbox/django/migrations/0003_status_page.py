"""The status page's entry in the admin's index (a proxy model): no table, no DDL, no permission."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('celery_outbox', '0002_admin_models'),
    ]

    operations = [
        migrations.CreateModel(
            name='Status',
            fields=[
            ],
            options={
                'verbose_name': 'status',
                'verbose_name_plural': 'status',
                'proxy': True,
                'default_permissions': (),
                'indexes': [],
                'constraints': [],
            },
            bases=('celery_outbox.deadletter',),
        ),
    ]
