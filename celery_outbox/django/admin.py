"""The Django admin as the outbox's dashboard.

Dead letters: filtered by reason, task, queue and exception, each with its envelope and
traceback; replayed (``deadletters.replay``, through the outbox) or purged
(``deadletters.purge``) by admin actions that need their own permissions
(``celery_outbox.replay_deadletter``, ``celery_outbox.purge_deadletter``): a user with view
rights alone changes nothing. Outgoing and incoming messages are read-only lists. A status
page (``admin/celery_outbox/deadletter/status/``) shows the counts by state, the oldest
pending message and the nodes, as ``celery outbox status`` does.

The pages read the Django database that holds the outbox's tables
(``CELERY_OUTBOX_DJANGO_DATABASE``, ``"default"`` unless set), and the actions and the status
page use the outbox whose store it is (the project's ``celery.py``).
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.html import format_html

from ..deadletters import DeadLetterFilter, purge, replay
from ..errors import OutboxError
from ..runtime import Runtime, installed_runtimes
from ..store.status import OTHER_TASKS
from .models import DeadLetter, IncomingMessage, OutgoingMessage
from .settings import outbox_settings

__all__ = ["DeadLetterAdmin", "IncomingMessageAdmin", "OutgoingMessageAdmin", "admin_database", "installed_runtime"]


def admin_database() -> str:
    """The Django database the admin reads: the one that holds the outbox's tables
    (``CELERY_OUTBOX_DJANGO_DATABASE``), read from Django's settings on each request."""
    return outbox_settings().django_database


def installed_runtime(using: str | None = None) -> Runtime:
    """The runtime of the outbox whose store is Django's database ``using`` (by default the one the
    admin reads); the latest installed, if several are."""
    using = using or admin_database()
    for runtime in reversed(installed_runtimes()):
        if runtime.joins_django and runtime.settings.django_database == using:
            return runtime
    raise OutboxError(f"no Outbox stores its messages in Django's database {using!r}: call Outbox(app) in your "
                      "project's celery.py, imported by the project (its __init__.py)")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows of the outbox's tables, read from the database that holds them: looked at, never edited here."""

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).using(admin_database())

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class RegisteredTaskFilter(admin.SimpleListFilter):
    """By task name: each task the app registers that has rows, and ``other`` for the rest (names
    come from messages: a sender of hostile ones must not make the filter list them all)."""

    title = "task name"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        registered = _registered_tasks()
        present = model_admin.get_queryset(request).filter(task_name__in=registered).order_by("task_name") \
            .values_list("task_name", flat=True).distinct()
        return [(name, name) for name in present] + [(OTHER_TASKS, OTHER_TASKS)]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        if self.value() is None:
            return queryset
        if self.value() == OTHER_TASKS:
            return queryset.exclude(task_name__in=_registered_tasks())
        return queryset.filter(task_name=self.value())


def _registered_tasks() -> list[str]:
    return sorted(installed_runtime().app.tasks.keys())


#: the bytes of a dead letter's body its page shows (and reads from the database)
SHOWN_BODY = 4000


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = ("id", "failed_at", "task_name", "queue", "reason", "exception_type", "replay_count")
    list_filter = ("reason", RegisteredTaskFilter, "queue", "exception_type")
    search_fields = ("message_id", "task_name", "exception_message")
    fields = ("message_id", "task_name", "queue", "destination", "reason", "exception_type", "exception_message",
              "failed_at", "retries", "nesting", "replays", "replay_count", "replayed_at", "exchange", "routing_key",
              "shown_traceback", "shown_headers", "shown_properties", "content_type", "content_encoding",
              "shown_body")
    readonly_fields = fields
    actions = ["replay_selected", "purge_selected"]

    def get_queryset(self, request: HttpRequest) -> Any:
        """The letters without their bodies: a page reads at most ``SHOWN_BODY`` bytes of each (and
        its size), whatever the bodies weigh. The other columns a letter's page shows are read
        when it shows them."""
        from django.db.models.functions import Length, Substr

        return super().get_queryset(request).defer("body", "traceback", "headers", "properties").annotate(
            body_prefix=Substr("body", 1, SHOWN_BODY + 1), body_size=Length("body"))

    @admin.display(description="traceback")
    def shown_traceback(self, letter: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", letter.traceback or "")

    @admin.display(description="headers")
    def shown_headers(self, letter: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", _pretty(letter.headers))

    @admin.display(description="properties")
    def shown_properties(self, letter: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", _pretty(letter.properties))

    @admin.display(description="body")
    def shown_body(self, letter: DeadLetter) -> str:
        prefix = bytes(getattr(letter, "body_prefix", None) or b"")
        size = getattr(letter, "body_size", None) or 0
        shown = prefix[:SHOWN_BODY].decode("utf-8", "backslashreplace")
        more = f"\n… {size - SHOWN_BODY:,} more bytes ({size:,} in all)" if size > SHOWN_BODY else ""
        return format_html("<pre>{}{}</pre>", shown, more)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("celery_outbox.replay_deadletter")

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("celery_outbox.purge_deadletter")

    @admin.action(permissions=["replay"], description="Replay the selected dead letters")
    def replay_selected(self, request: HttpRequest, queryset: Any) -> None:
        runtime = installed_runtime()
        replayed = replay(runtime.owner.publisher, DeadLetterFilter(ids=tuple(queryset.values_list("id", flat=True))))
        self.message_user(request, f"replayed {len(replayed.message_ids)} dead letter(s)", messages.SUCCESS)
        for letter_id, reason in replayed.refused:
            self.message_user(request, f"dead letter {letter_id} not replayed: {reason}", messages.WARNING)

    @admin.action(permissions=["purge"], description="Purge the selected dead letters")
    def purge_selected(self, request: HttpRequest, queryset: Any) -> None:
        deleted = purge(installed_runtime(), DeadLetterFilter(ids=tuple(queryset.values_list("id", flat=True))))
        self.message_user(request, f"purged {deleted} dead letter(s)", messages.SUCCESS)

    def get_urls(self) -> list[Any]:
        status = path("status/", self.admin_site.admin_view(self.status_view), name="celery_outbox_status")
        return [status, *super().get_urls()]

    def status_view(self, request: HttpRequest) -> TemplateResponse:
        """Counts by state, the oldest pending message and the nodes (``celery outbox status``)."""
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        status = installed_runtime().status()
        context = {**self.admin_site.each_context(request), "title": "celery-outbox status", "status": status,
                   "opts": self.model._meta}
        return TemplateResponse(request, "celery_outbox/status.html", context)


@admin.register(OutgoingMessage)
class OutgoingMessageAdmin(ReadOnlyAdmin):
    list_display = ("id", "created_at", "message_id", "task_name", "destination", "sent_at", "redeliveries", "attempts",
                    "deliver_at")
    list_filter = ("destination", RegisteredTaskFilter)
    search_fields = ("message_id", "task_name")


@admin.register(IncomingMessage)
class IncomingMessageAdmin(ReadOnlyAdmin):
    list_display = ("message_id", "received_at", "task_name", "queue", "status", "duplicates", "recoveries",
                    "handled_at")
    list_filter = ("status", "queue", RegisteredTaskFilter)
    search_fields = ("message_id", "task_name")
    list_display_links = None  # the key has three columns: a row has no page of its own

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_view_permission(request)


def _pretty(text: str | None) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, sort_keys=True) if text else ""
    except ValueError:
        return text or ""
