"""The Django admin as the outbox's dashboard: dead letters, outgoing and incoming rows, status.

Transaction boundary: the pages read the outbox's tables in ``CELERY_OUTBOX_DJANGO_DATABASE``
through read-only models; the Replay and Purge actions and buttons, each behind its own
permission and acting only on a confirmed POST with Django's CSRF token, run
``maintenance.dead_letters.replay`` and ``purge`` of the outbox whose store that database is, in
their transactions. Guarantee: a user with view rights alone changes nothing. What each page
shows: docs/django.md (The admin as a dashboard).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.translation import ngettext

from ..core.runtime import Runtime, installed_runtimes
from ..core.tenancy import using_tenant
from ..errors import OutboxError
from ..maintenance.dead_letters import DeadLetterFilter, purge, replay
from ..store.status import OTHER_TASKS
from .letter_html import (
    DECODED_BODY,
    SHOWN_BODY,
    arguments_html,
    body_html,
    id_html,
    moment_html,
    name_html,
    pretty_json,
    replayed_html,
    traceback_html,
)
from .models import DeadLetter, IncomingMessage, OutgoingMessage, Status
from .settings import outbox_settings

__all__ = ["SHOWN_BODY", "DeadLetterAdmin", "IncomingMessageAdmin", "OutgoingMessageAdmin", "StatusAdmin",
           "admin_database", "installed_runtime"]

#: the query parameter that names the tenant whose rows a page shows
TENANT_PARAMETER = "tenant"
#: the columns of a dead letter that the list never reads (its page reads them, and a prefix of the body)
LARGE_COLUMNS = ("body", "traceback", "headers", "properties")


def admin_database(request: HttpRequest | None = None) -> str:
    """The Django database the admin reads: the one that holds the outbox's tables
    (``CELERY_OUTBOX_DJANGO_DATABASE``), read from Django's settings on each request; or, for a
    request that names a tenant placed in a Django database (``tenant_of``), that database."""
    tenant = None if request is None else tenant_of(request)
    if tenant is None:
        return outbox_settings().django_database
    return django_tenants()[tenant]


def django_tenants() -> dict[str, str]:
    """The tenants placed in Django databases (``outbox_tenants``), with their aliases: the ones
    whose rows the admin can read."""
    places = installed_runtime().tenant_places()
    return {tenant: place.django for tenant, place in sorted(places.items()) if place.django is not None}


def tenant_of(request: HttpRequest) -> str | None:
    """The tenant a request names: ``?tenant=`` on a list, or in the list's filters that a page
    reached from it carries (``_changelist_filters``); None for the default store. A name that is
    no tenant placed in a Django database is a 404, never another database's rows."""
    tenant = request.GET.get(TENANT_PARAMETER)
    if tenant is None:
        tenant = QueryDict(request.GET.get("_changelist_filters", "")).get(TENANT_PARAMETER)
    if tenant in (None, ""):
        return None
    if tenant not in django_tenants():
        raise Http404(f"no tenant {tenant!r} in a Django database")
    return tenant


def tenant_query(request: HttpRequest) -> str:
    """``?tenant=<name>`` for a link that must stay in the request's tenant, or ''."""
    tenant = tenant_of(request)
    return "" if tenant is None else "?" + urlencode({TENANT_PARAMETER: tenant})


def installed_runtime(using: str | None = None) -> Runtime:
    """The runtime of the outbox whose store is Django's database ``using`` (by default the one the
    admin reads); the latest installed, if several are."""
    using = using or admin_database()
    for runtime in reversed(installed_runtimes()):
        if runtime.joined is not None and runtime.joined.name == "django" and runtime.settings.django_database == using:
            return runtime
    raise OutboxError(f"no Outbox stores its messages in Django's database {using!r}: call Outbox(app) in your "
                      "project's celery.py, imported by the project (its __init__.py)")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows of the outbox's tables, read from the database that holds them (the request's tenant's,
    ``admin_database``): looked at, never edited here."""

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).using(admin_database(request))

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


class TenantFilter(admin.SimpleListFilter):
    """By tenant: the default store, or a tenant placed in a Django database (``?tenant=``), whose
    database the list reads (``ReadOnlyAdmin.get_queryset``); shown only when there is one."""

    title = "tenant"
    parameter_name = TENANT_PARAMETER

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(tenant, f"{tenant} ({alias})") for tenant, alias in django_tenants().items()]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        return queryset  # the tenant's database is chosen by get_queryset


def _registered_tasks() -> list[str]:
    return sorted(installed_runtime().app.tasks.keys())


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = ("id", "shown_failed_at", "shown_task_name", "shown_task_id", "shown_reason", "shown_exception",
                    "shown_replayed_at")
    ordering = ("-failed_at",)  # the list adds the key, for a stable order: one sort mark
    list_filter = (TenantFilter, "reason", RegisteredTaskFilter, "queue", "exception_type")
    search_fields = ("message_id", "task_name", "exception_message")
    date_hierarchy = "failed_at"
    fieldsets = (
        ("Task", {"fields": ("task_id", "task_name", "shown_arguments")}),
        ("Failure", {"fields": ("reason", "exception_type", "exception_message", "failed_at", "shown_traceback")}),
        ("Delivery", {"fields": ("queue", "destination", "exchange", "routing_key", "retries", "nesting", "replays",
                                 "replay_count", "replayed_at")}),
        ("Envelope", {"classes": ("collapse",), "fields": ("shown_headers", "shown_properties", "content_type",
                                                            "content_encoding", "shown_body")}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])
    actions = ["replay_selected", "purge_selected"]
    change_list_template = "celery_outbox/deadletter_change_list.html"
    change_form_template = "celery_outbox/deadletter_change_form.html"

    def get_queryset(self, request: HttpRequest) -> Any:
        """The letters without their bodies, tracebacks, headers and properties: the list shows none."""
        return super().get_queryset(request).defer(*LARGE_COLUMNS)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> DeadLetter | None:
        """One letter, with at most ``DECODED_BODY`` bytes of its body (and its size) whatever the body
        weighs; None if there is no such letter."""
        from django.core.exceptions import ValidationError
        from django.db.models.functions import Length, Substr

        letters = self.get_queryset(request).defer(None).defer("body").annotate(
            body_prefix=Substr("body", 1, DECODED_BODY + 1), body_size=Length("body"))
        key = self.opts.pk if from_field is None else self.opts.get_field(from_field)
        try:
            return letters.get(**{key.name: key.to_python(object_id)})
        except (DeadLetter.DoesNotExist, ValidationError, ValueError):
            return None

    @admin.display(description="failed", ordering="failed_at")
    def shown_failed_at(self, letter: DeadLetter) -> str:
        return moment_html(letter.failed_at, self.get_empty_value_display())

    @admin.display(description="task id", ordering="message_id")
    def shown_task_id(self, letter: DeadLetter) -> str:
        return id_html(letter.message_id)

    @admin.display(description="task id")
    def task_id(self, letter: DeadLetter) -> str:
        return letter.message_id

    @admin.display(description="task", ordering="task_name")
    def shown_task_name(self, letter: DeadLetter) -> str:
        return name_html(letter.task_name)

    @admin.display(description="reason", ordering="reason")
    def shown_reason(self, letter: DeadLetter) -> str:
        return name_html(letter.reason)

    @admin.display(description="exception", ordering="exception_type")
    def shown_exception(self, letter: DeadLetter) -> str:
        return name_html(letter.exception_type) if letter.exception_type else self.get_empty_value_display()

    @admin.display(description="replayed", ordering="replayed_at")
    def shown_replayed_at(self, letter: DeadLetter) -> str:
        return replayed_html(letter.replayed_at, letter.replay_count, self.get_empty_value_display())

    @admin.display(description="arguments")
    def shown_arguments(self, letter: DeadLetter) -> str:
        return arguments_html(_prefix(letter), _size(letter), letter.content_type, letter.content_encoding,
                              letter.headers)

    @admin.display(description="traceback")
    def shown_traceback(self, letter: DeadLetter) -> str:
        return traceback_html(letter.traceback)

    @admin.display(description="headers")
    def shown_headers(self, letter: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", pretty_json(letter.headers))

    @admin.display(description="properties")
    def shown_properties(self, letter: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", pretty_json(letter.properties))

    @admin.display(description="body (raw)")
    def shown_body(self, letter: DeadLetter) -> str:
        return body_html(_prefix(letter), _size(letter))

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("celery_outbox.replay_deadletter")

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("celery_outbox.purge_deadletter")

    @admin.action(permissions=["replay"], description="Replay the selected dead letters")
    def replay_selected(self, request: HttpRequest, queryset: Any) -> None:
        self.replay_letters(request, tuple(queryset.values_list("id", flat=True)))

    @admin.action(permissions=["purge"], description="Purge the selected dead letters")
    def purge_selected(self, request: HttpRequest, queryset: Any) -> None:
        self.purge_letters(request, tuple(queryset.values_list("id", flat=True)))

    def replay_letters(self, request: HttpRequest, ids: tuple[int, ...]) -> None:
        """Replay the letters ``ids`` through the outbox (``deadletters.replay``) and tell the user
        how many were replayed, and why each refused one was."""
        with using_tenant(tenant_of(request)):
            replayed = replay(installed_runtime().owner.publisher, DeadLetterFilter(ids=ids))
        count = len(replayed.message_ids)
        self.message_user(request, ngettext("Replayed %(count)d dead letter", "Replayed %(count)d dead letters",
                                            count) % {"count": count}, messages.SUCCESS)
        for letter_id, reason in replayed.refused:
            self.message_user(request, f"Dead letter {letter_id} not replayed: {reason}", messages.WARNING)

    def purge_letters(self, request: HttpRequest, ids: tuple[int, ...]) -> None:
        """Delete the letters ``ids`` (``deadletters.purge``) and tell the user how many were."""
        with using_tenant(tenant_of(request)):
            count = purge(installed_runtime(), DeadLetterFilter(ids=ids))
        self.message_user(request, ngettext("Purged %(count)d dead letter", "Purged %(count)d dead letters",
                                            count) % {"count": count}, messages.SUCCESS)

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> Any:
        """A letter's page, with a Replay and a Purge button for the users who may use them."""
        context = {**(extra_context or {}), "has_replay_permission": self.has_replay_permission(request),
                   "has_purge_permission": self.has_purge_permission(request), "tenant_query": tenant_query(request)}
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[Any]:
        name = f"{self.opts.app_label}_{self.opts.model_name}"
        own = [path("<path:object_id>/replay/", self.admin_site.admin_view(self.replay_view), name=f"{name}_replay"),
               path("<path:object_id>/purge/", self.admin_site.admin_view(self.purge_view), name=f"{name}_purge")]
        return [*own, *super().get_urls()]

    def replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET asks to confirm; POST (with Django's CSRF token) replays the letter, as the list's
        action does, and returns to its page. Without the replay permission: 403, nothing done."""
        letter = self._letter(request, object_id, self.has_replay_permission(request))
        if request.method != "POST":
            return self._confirmation(request, letter, "Replay", "Yes, replay it", (
                "Its message is sent again through the outbox, as a new attempt of the same task id, routed "
                "by its task's current route; the letter stays here, its replay counted."))
        self.replay_letters(request, (letter.id,))
        return HttpResponseRedirect(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
                                            args=(quote(letter.pk),), current_app=self.admin_site.name)
                                    + _filters_of(request))

    def purge_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET asks to confirm; POST (with Django's CSRF token) deletes the letter, as the list's
        action does, and returns to the list. Without the purge permission: 403, nothing done."""
        letter = self._letter(request, object_id, self.has_purge_permission(request))
        if request.method != "POST":
            return self._confirmation(request, letter, "Purge", "Yes, purge it", (
                "The letter is deleted, with its envelope: it cannot be replayed afterwards."))
        self.purge_letters(request, (letter.id,))
        return HttpResponseRedirect(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist",
                                            current_app=self.admin_site.name) + tenant_query(request))

    def _letter(self, request: HttpRequest, object_id: str, permitted: bool) -> DeadLetter:
        if not permitted:
            raise PermissionDenied
        letter = self.get_object(request, unquote(object_id))
        if letter is None:
            raise Http404(f"no dead letter with id {object_id}")
        return letter

    def _confirmation(self, request: HttpRequest, letter: DeadLetter, verb: str, confirm: str,
                      consequence: str) -> TemplateResponse:
        context = {**self.admin_site.each_context(request), "title": f"{verb} dead letter {letter.pk}?",
                   "opts": self.opts, "original": letter, "verb": verb, "confirm": confirm,
                   "consequence": consequence, "tenant_query": tenant_query(request)}
        return TemplateResponse(request, "celery_outbox/deadletter_confirm.html", context)


@admin.register(Status)
class StatusAdmin(ReadOnlyAdmin):
    """The status page, listed in the admin's index beside the tables; seen by the users who may
    view dead letters."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("celery_outbox.view_deadletter")

    def get_urls(self) -> list[Any]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        return [path("", self.admin_site.admin_view(self.status_view), name=name)]

    def status_view(self, request: HttpRequest) -> TemplateResponse:
        """Counts by state, the oldest pending message and the nodes (``celery outbox status``)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        runtime = installed_runtime()
        status = runtime.status()
        context = {**self.admin_site.each_context(request), "title": "celery-outbox status", "status": status,
                   "opts": self.opts, "tenants": tenant_statuses(runtime)}
        return TemplateResponse(request, "celery_outbox/status.html", context)


def tenant_statuses(runtime: Runtime) -> list[dict[str, Any]]:
    """Each tenant's counts and its oldest waiting messages (``status``), or why its store did not
    answer: one tenant's database down does not take the page down."""
    statuses = []
    for tenant in runtime.tenants():
        try:
            with using_tenant(tenant):
                statuses.append({"tenant": tenant, "status": runtime.status(timeout=5.0), "error": None})
        except Exception as exc:  # noqa: BLE001 - shown on the page, the other tenants still are
            statuses.append({"tenant": tenant, "status": None, "error": f"{type(exc).__name__}: {exc}"})
    return statuses


def _filters_of(request: HttpRequest) -> str:
    """The list's filters a page carries (``_changelist_filters``), as its query string, or ''."""
    filters = request.GET.get("_changelist_filters")
    return "" if not filters else "?" + urlencode({"_changelist_filters": filters})


def _prefix(letter: DeadLetter) -> bytes:
    return bytes(getattr(letter, "body_prefix", None) or b"")


def _size(letter: DeadLetter) -> int:
    return getattr(letter, "body_size", None) or 0


@admin.register(OutgoingMessage)
class OutgoingMessageAdmin(ReadOnlyAdmin):
    list_display = ("id", "created_at", "message_id", "task_name", "destination", "sent_at", "redeliveries", "attempts",
                    "deliver_at")
    list_filter = (TenantFilter, "destination", RegisteredTaskFilter)
    search_fields = ("message_id", "task_name")


@admin.register(IncomingMessage)
class IncomingMessageAdmin(ReadOnlyAdmin):
    list_display = ("message_id", "received_at", "task_name", "queue", "status", "duplicates", "recoveries",
                    "handled_at")
    list_filter = (TenantFilter, "status", "queue", RegisteredTaskFilter)
    search_fields = ("message_id", "task_name")
    list_display_links = None  # the key has three columns: a row has no page of its own

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_view_permission(request)

