from django.db import models


class Order(models.Model):
    """The user's own data, written with the ORM in the same transaction as the outbox's rows."""

    number = models.CharField(max_length=64, unique=True)

    class Meta:
        app_label = "shop"
