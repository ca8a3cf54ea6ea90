"""Read-only Django models over the outbox's tables, for the admin (``celery_outbox.django.admin``).

The tables are the store's (``manage.py migrate`` creates them with the store's own
migration): these models are unmanaged, their ``db_table`` follows
``CELERY_OUTBOX_TABLE_PREFIX``. The inbox table's key has three columns; Django's admin needs
one, so its model names ``message_id`` as the key and its admin only lists rows. ``Status`` is
no table: it gives the status page its entry in the admin's index.
"""

from __future__ import annotations

from django.db import models

from .settings import outbox_settings

PREFIX = outbox_settings().table_prefix


class DeadLetter(models.Model):
    """A message that could not be delivered or handled, with its envelope for a replay."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.CharField(max_length=255)
    destination = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    queue = models.CharField(max_length=255)
    reason = models.CharField(max_length=32)
    exception_type = models.CharField(max_length=255, null=True)
    exception_message = models.TextField(null=True)
    traceback = models.TextField(null=True)
    retries = models.IntegerField()
    nesting = models.IntegerField()
    replays = models.IntegerField()
    exchange = models.CharField(max_length=255)
    routing_key = models.CharField(max_length=255)
    body = models.BinaryField(null=True)
    content_type = models.CharField(max_length=128, null=True)
    content_encoding = models.CharField(max_length=64, null=True)
    headers = models.TextField(null=True)
    properties = models.TextField(null=True)
    failed_at = models.DateTimeField()
    replay_count = models.IntegerField()
    replayed_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = f"{PREFIX}dead_letters"
        ordering = ["-failed_at", "-id"]
        default_permissions = ("view",)
        permissions = [("replay_deadletter", "Can replay dead letters"),
                       ("purge_deadletter", "Can purge dead letters")]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.message_id}] ({self.reason})"


class Status(DeadLetter):
    """The status page's entry in the admin's index: a proxy with no rows and no permissions of its own
    (the page is seen by the users who may view dead letters)."""

    class Meta:
        proxy = True
        default_permissions = ()
        verbose_name = verbose_name_plural = "status"


class OutgoingMessage(models.Model):
    """A durable message committed by a sender, kept until the consuming inbox acknowledges it."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    destination = models.CharField(max_length=255)
    attempts = models.IntegerField()
    last_error = models.TextField(null=True)
    created_at = models.DateTimeField()
    deliver_at = models.DateTimeField(null=True)
    expires_at = models.DateTimeField(null=True)
    sent_at = models.DateTimeField(null=True)
    redeliver_at = models.DateTimeField(null=True)
    redeliveries = models.IntegerField()

    class Meta:
        managed = False
        db_table = f"{PREFIX}outgoing"
        ordering = ["id"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.task_name}[{self.message_id}]"


class IncomingMessage(models.Model):
    """A delivery an inbox claimed: running, handled, retried, dead or revoked."""

    message_id = models.CharField(max_length=255, primary_key=True)
    destination = models.CharField(max_length=255)
    send_id = models.CharField(max_length=64)
    task_name = models.CharField(max_length=255)
    queue = models.CharField(max_length=255)
    status = models.CharField(max_length=16)
    owner = models.IntegerField()
    retries = models.IntegerField()
    duplicates = models.IntegerField()
    recoveries = models.IntegerField()
    received_at = models.DateTimeField()
    handled_at = models.DateTimeField(null=True)
    keep_until = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = f"{PREFIX}incoming"
        ordering = ["-received_at"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.task_name}[{self.message_id}] {self.status}"
