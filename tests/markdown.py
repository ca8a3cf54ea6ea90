"""The code blocks of the project's Markdown pages, for the tests that run the docs as written."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language and text; ``title`` is the file a block's first line
    names (``# shop.py``), else None."""

    language: str
    code: str

    @property
    def title(self) -> str | None:
        first = self.code.split("\n", 1)[0]
        match = re.fullmatch(r"#\s+(\S+\.py)\b.*", first.strip())
        return match.group(1) if match else None

    def commands(self) -> list[str]:
        """A shell block's commands, one a line, without comments and blank lines."""
        lines = (line.split(" #", 1)[0].strip() for line in self.code.splitlines())
        return [line for line in lines if line and not line.startswith("#")]


def section_text(page: str, section: str) -> str:
    """The text of ``section`` (a ``## `` heading) of ``page`` (a path from the root), to the next one."""
    text = (ROOT / page).read_text()
    heading = re.search(rf"^## {re.escape(section)}\n", text, re.M)
    if heading is None:
        raise LookupError(f"{page} has no section {section!r}")
    rest = text[heading.end():]
    following = re.search(r"^## ", rest, re.M)
    return rest if following is None else rest[: following.start()]


def blocks(page: str, section: str) -> list[Block]:
    """The code blocks of ``section`` of ``page``, in order."""
    return [Block(language, code) for language, code in _FENCE.findall(section_text(page, section))]


def inline_commands(page: str, section: str, prefix: str) -> list[str]:
    """The inline code spans of ``section`` of ``page`` (outside its blocks) that start with ``prefix``;
    a span the page breaks over two lines is joined."""
    prose = _FENCE.sub("", section_text(page, section))
    spans = (" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose))
    return [span for span in spans if span.startswith(prefix)]


def synopsis(line: str, values: dict[str, str], options: bool) -> str:
    """A synopsis line of the docs (``outbox dead-letters list [--task T] [filters]``) as a command:
    its placeholder words replaced by ``values``; each ``[...]`` part dropped, or kept and filled
    when ``options``; a repetition (``[ID ...]``) always dropped."""

    def fill(text: str) -> str:
        return " ".join(values.get(word, word) for word in text.split())

    def optional(match: re.Match) -> str:
        inner = match.group(1)
        return "" if not options or inner.endswith("...") else " " + fill(inner)

    return fill(re.sub(r"\s*\[([^\]]*)\]", optional, line))


def titled(found: list[Block], title: str) -> Block:
    """The block whose first line names ``title``."""
    for block in found:
        if block.title == title:
            return block
    raise LookupError(f"no code block starts with '# {title}'")


def shell(found: list[Block]) -> list[Block]:
    return [block for block in found if block.language == "bash"]
