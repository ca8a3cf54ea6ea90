"""A dead letter's contents as a person reads them: its arguments decoded, its traceback trimmed.

Pure functions of stored values, for the admin (``celery_outbox.django.admin``): they read no
table and run in no transaction. A body is decoded only from the serialisers that cannot run code
(JSON, msgpack, YAML's safe loader): a pickled body is never unpickled here, and a compressed one
is not inflated. Every text they return is bounded, whatever the message carried.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kombu.serialization import loads

__all__ = ["LIBRARY_PACKAGES", "SHOWN_ARGUMENTS", "SHOWN_VALUE", "Arguments", "Traceback", "bounded",
           "decoded_arguments", "trimmed_traceback"]

#: the characters of one argument's ``repr`` (or of a keyword's name) shown; the rest is counted
SHOWN_VALUE = 300
#: the positional arguments, and the named ones, shown; the rest are counted
SHOWN_ARGUMENTS = 50
#: the content types decoded: their decoders build plain values and run no code of the sender's
SAFE_CONTENT_TYPES = frozenset({"application/json", "application/x-msgpack", "application/x-yaml"})
#: the packages whose frames, at the top of a traceback, are the worker's machinery, not the user's code
LIBRARY_PACKAGES = frozenset({"celery_outbox", "celery", "kombu", "billiard"})


def bounded(text: str, size: int = SHOWN_VALUE) -> str:
    """``text`` if it has at most ``size`` characters; else its first ``size`` and how many more it has."""
    if len(text) <= size:
        return text
    return f"{text[:size]}… ({len(text) - size:,} more characters)"


@dataclass(frozen=True)
class Arguments:
    """A task message's arguments, each as its bounded ``repr``, and how many were left out."""

    positional: tuple[str, ...]
    named: tuple[tuple[str, str], ...]
    more_positional: int = 0
    more_named: int = 0


def decoded_arguments(body: bytes, content_type: str | None, content_encoding: str | None,
                      headers: dict[str, Any] | None = None) -> Arguments | str:
    """The arguments of a Celery task message (protocol 2's body ``[args, kwargs, embed]``, or
    protocol 1's mapping with ``args`` and ``kwargs``), or the reason they cannot be shown."""
    if (headers or {}).get("compression"):
        return f"the body is compressed ({headers['compression']}): it is not inflated here"
    if content_type not in SAFE_CONTENT_TYPES:
        return f"the body is {content_type or 'raw bytes'}: only JSON, msgpack and YAML bodies are decoded here"
    try:
        decoded = loads(body, content_type, content_encoding, accept=SAFE_CONTENT_TYPES)
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the letter's, shown as its reason
        return f"the body cannot be decoded ({content_type}): {bounded(str(exc))}"
    if isinstance(decoded, (list, tuple)) and len(decoded) == 3:
        args, kwargs = decoded[0], decoded[1]
    elif isinstance(decoded, dict) and "args" in decoded:
        args, kwargs = decoded.get("args"), decoded.get("kwargs") or {}
    else:
        return "the body is not a Celery task message's"
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        return "the body is not a Celery task message's"
    named = list(kwargs.items())
    return Arguments(
        positional=tuple(bounded(_repr(value)) for value in args[:SHOWN_ARGUMENTS]),
        named=tuple((bounded(str(name)), bounded(_repr(value))) for name, value in named[:SHOWN_ARGUMENTS]),
        more_positional=max(len(args) - SHOWN_ARGUMENTS, 0), more_named=max(len(named) - SHOWN_ARGUMENTS, 0))


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named by its type
        return f"<{type(value).__name__}>"


@dataclass(frozen=True)
class Traceback:
    """A traceback trimmed to the user's frames (``shown``), how many frames it hides, and in full."""

    shown: str
    hidden: int
    full: str


_FRAME = re.compile(r'  File "(?P<path>[^"]*)", line \d+')
_INSTALLED = frozenset({"site-packages", "dist-packages"})
_HEADER = "Traceback (most recent call last):"


def trimmed_traceback(text: str) -> Traceback:
    """``text`` without the frames of ``LIBRARY_PACKAGES`` that come before the first frame of other
    code, in each traceback of its chain; a line says how many were hidden, and of which packages.
    A traceback with no frame of other code is shown whole: it has nothing else to show."""
    lines = text.splitlines()
    shown: list[str] = []
    hidden = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        shown.append(line)
        index += 1
        if line.strip() != _HEADER:
            continue
        frames, index = _frames(lines, index)
        dropped = 0
        while dropped < len(frames) and _package(frames[dropped][0]) is not None:
            dropped += 1
        if dropped == len(frames):
            dropped = 0
        if dropped:
            packages = sorted({_package(frame[0]) for frame in frames[:dropped]})
            noun = "frame" if dropped == 1 else "frames"
            shown.append(f"  [{dropped} {noun} of {', '.join(packages)} hidden]")
        hidden += dropped
        for frame in frames[dropped:]:
            shown.extend(frame)
    return Traceback(shown="\n".join(shown), hidden=hidden, full=text)


def _frames(lines: list[str], index: int) -> tuple[list[list[str]], int]:
    """The frames that start at ``lines[index]`` (each its ``File`` line and the lines indented
    under it), and the index of the first line after them."""
    frames: list[list[str]] = []
    while index < len(lines) and lines[index].startswith("  "):
        if _FRAME.match(lines[index]) or not frames:
            frames.append([lines[index]])
        else:
            frames[-1].append(lines[index])
        index += 1
    return frames, index


def _package(file_line: str) -> str | None:
    """The library package a frame's file is in, or None for other code: the folder an installed
    package's files are in (``site-packages/celery/...``), else any folder of its path so named
    (a package run from its source tree)."""
    match = _FRAME.match(file_line)
    if match is None:
        return None
    folders = re.split(r"[\\/]", match["path"])[:-1]
    marks = [n for n, folder in enumerate(folders) if folder in _INSTALLED]
    candidates = folders[marks[-1] + 1:marks[-1] + 2] if marks else folders
    return next((folder for folder in candidates if folder in LIBRARY_PACKAGES), None)
