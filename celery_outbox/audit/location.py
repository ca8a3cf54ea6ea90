"""Where the archive and the audit's outputs live: a local path or a URI, told apart in one place.

No transaction. pyarrow (cleanup's archiver, the audit's checks), Spark and the printed lines
agree on the place: a path without a scheme and a ``file:`` URI are local, the text after
``file://`` taken as written, with no percent-decoding, as Hadoop reads it; any other scheme
(``s3a://``, ``hdfs://``...) names a filesystem only Spark's Hadoop layer or pyarrow reaches
(docs/audit.md, Where: paths and URIs).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["Location"]

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+")  # two characters at least: C:\ is a drive, not a scheme
_USER_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+://[^/@:]*:)[^/@]*@")


@dataclass(frozen=True)
class Location:
    """A place given as a local path or a URI. ``local`` is its absolute local path, or None when
    it is on a filesystem of its own; ``text`` is the URI as given (without a trailing slash)."""

    text: str
    local: str | None

    @classmethod
    def of(cls, text: str) -> Location:
        """Read a path or a URI; a ``file:`` URI that names a host other than ``localhost`` is a
        ``ValueError``."""
        scheme, colon, rest = text.partition(":")
        if not colon or not _SCHEME.fullmatch(scheme):
            return cls(text.rstrip("/") or "/", os.path.abspath(text))
        if scheme.lower() != "file":
            return cls(text.rstrip("/"), None)
        if rest.startswith("//"):
            host, _, path = rest[2:].partition("/")
            if host not in ("", "localhost"):
                raise ValueError(f"{text} names the host {host!r}: a file: URI is a path on this machine")
            rest = "/" + path
        if not rest.startswith("/"):
            raise ValueError(f"{text} is not an absolute path: write file:///absolute/path")
        return cls(text.rstrip("/"), os.path.normpath(rest))

    @property
    def uri(self) -> str:
        """The location as Spark is given it: ``file:`` and the absolute path for a local one (so a
        cluster's default filesystem never reinterprets it), else the URI as given."""
        return f"file:{self.local}" if self.local is not None else self.text

    def child(self, *names: str) -> Location:
        """The location of ``names`` inside this one."""
        if self.local is not None:
            return Location(f"{self.text}/{'/'.join(names)}", os.path.join(self.local, *names))
        return Location(f"{self.text}/{'/'.join(names)}", None)

    def __str__(self) -> str:
        """The real place, for people: the absolute path of a local location, else its URI with
        any password in it masked (``s3a://key:***@bucket/...``)."""
        return self.local if self.local is not None else _USER_PASSWORD.sub(r"\1***@", self.text)
