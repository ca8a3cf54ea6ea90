"""A dead letter's fields as the admin's HTML, every text escaped and bounded.

No transaction: nothing here reads the database. Its arguments decoded and bounded, its traceback
trimmed to the user's frames (the whole one a click away), its raw body's first bytes, and moments
in the current time zone.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from ..message.dead_letter_contents import Arguments, decoded_arguments, trimmed_traceback

__all__ = ["DECODED_BODY", "SHOWN_BODY", "SHOWN_ID", "arguments_html", "body_html", "id_html", "moment_html",
           "name_html", "pretty_json", "replayed_html", "traceback_html"]

#: the bytes of a dead letter's body its page shows raw
SHOWN_BODY = 4000
#: the bytes of a dead letter's body its page reads: a body up to this size is decoded into arguments
DECODED_BODY = 64 * 1024
#: the characters of a task id a list shows; a longer one is cut, in full in its title
SHOWN_ID = 9
#: where a name may break in a narrow column: after a dot, underscore, colon, slash or dash, and
#: between the words of a CamelCase name
_BREAKS = re.compile(r"(?<=[._:/-])|(?<=[a-z])(?=[A-Z])")


def arguments_html(body: bytes, size: int, content_type: str | None, content_encoding: str | None,
                   headers: str | None) -> SafeString:
    """The positional and named arguments of a task message's body (``body`` is its first bytes,
    ``size`` its length), one row each, each value's ``repr`` bounded; or why they are not shown."""
    if size > DECODED_BODY:
        return format_html('<p class="outbox-undecoded">The body has {} bytes: only bodies up to {} bytes are '
                           'decoded here. Its first bytes are in <i>Envelope</i>, below.</p>',
                           f"{size:,}", f"{DECODED_BODY:,}")
    arguments = decoded_arguments(body, content_type, content_encoding, _mapping(headers))
    if isinstance(arguments, str):
        return format_html('<p class="outbox-undecoded">{}; the raw body is in <i>Envelope</i>, below.</p>',
                           arguments)
    return _arguments_table(arguments)


def _arguments_table(arguments: Arguments) -> SafeString:
    if not arguments.positional and not arguments.named:
        return format_html('<p class="outbox-arguments">{}</p>', "no arguments")
    rows = [(str(n), value) for n, value in enumerate(arguments.positional)]
    if arguments.more_positional:
        rows.append(("…", f"{arguments.more_positional:,} more positional arguments"))
    rows.extend((f"{name}=", value) for name, value in arguments.named)
    if arguments.more_named:
        rows.append(("…", f"{arguments.more_named:,} more named arguments"))
    body = format_html_join("", "<tr><th>{}</th><td><code>{}</code></td></tr>", rows)
    return format_html('<table class="outbox-arguments"><tbody>{}</tbody></table>', body)


def traceback_html(text: str | None) -> SafeString:
    """The traceback without the library frames at its top (a line says how many), and the whole
    traceback in a ``<details>`` element when any frame was hidden."""
    if not text:
        return format_html("<p>{}</p>", "no traceback")
    trimmed = trimmed_traceback(text)
    shown = format_html('<pre class="outbox-traceback">{}</pre>', trimmed.shown)
    if not trimmed.hidden:
        return shown
    noun = "frame" if trimmed.hidden == 1 else "frames"
    return format_html('{}<details class="outbox-full-traceback"><summary>The whole traceback (with the {} hidden '
                       '{})</summary><pre class="outbox-traceback">{}</pre></details>',
                       shown, trimmed.hidden, noun, trimmed.full)


def body_html(prefix: bytes, size: int) -> SafeString:
    """The body's first ``SHOWN_BODY`` bytes as text (bytes that are not UTF-8 escaped), and its size."""
    shown = prefix[:SHOWN_BODY].decode("utf-8", "backslashreplace")
    more = f"\n… {size - SHOWN_BODY:,} more bytes ({size:,} in all)" if size > SHOWN_BODY else ""
    return format_html('<pre class="outbox-raw">{}{}</pre>', shown, more)


def id_html(value: str) -> SafeString:
    """A task id, cut to ``SHOWN_ID`` characters when longer; the whole id in its title."""
    shown = value if len(value) <= SHOWN_ID else f"{value[:SHOWN_ID - 1]}…"
    return format_html('<span title="{}">{}</span>', value, shown)


def name_html(value: str) -> SafeString:
    """A dotted, underscored or CamelCase name that may break between its parts (``<wbr>``)."""
    return format_html_join(mark_safe("<wbr>"), "{}", ((part,) for part in _BREAKS.split(value) if part))


def replayed_html(value: datetime | None, count: int, empty: str) -> SafeString:
    """When a letter was last replayed, and how many times (``empty`` if never)."""
    if value is None and not count:
        return format_html("{}", empty)
    return format_html("{} ({}×)", moment_html(value, empty), count)


def moment_html(value: datetime | None, empty: str) -> SafeString:
    """A moment in the current time zone, to the second, that may break between its date and its
    time only (``empty`` when there is none)."""
    if value is None:
        return format_html("{}", empty)
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html('<time datetime="{}"><span class="nowrap">{}</span> <span class="nowrap">{}</span></time>',
                       value.isoformat(), local.strftime("%Y-%m-%d"), local.strftime("%H:%M:%S"))


def pretty_json(text: str | None) -> str:
    """Stored JSON text indented, keys sorted; text that is not JSON as it is."""
    try:
        return json.dumps(json.loads(text), indent=2, sort_keys=True) if text else ""
    except ValueError:
        return text or ""


def _mapping(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
