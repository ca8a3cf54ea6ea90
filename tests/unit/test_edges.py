"""The edges use the library as its users do: the benchmarks and the example project import no
private name of ``celery_outbox`` (a name that starts with ``_``) and reach no private attribute
of its objects, so a change inside the library cannot break them unseen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EDGES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("example_project/**/*.py")])


def private_uses(path: Path) -> list[str]:
    """The private names ``path`` imports from ``celery_outbox``, and the private attributes it
    reads of the names it imported from there."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, ours = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_outbox"):
            for alias in node.names:
                ours.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in ours):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", EDGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_benchmarks_and_the_example_use_no_private_name_of_the_library(path):
    assert private_uses(path) == []


def test_the_check_finds_a_private_import_and_a_private_attribute(tmp_path):
    source = tmp_path / "edge.py"
    source.write_text("from celery_outbox.store.outgoing import _insert_one\nfrom celery_outbox import Outbox\n"
                      "Outbox._install()\n")
    assert private_uses(source) == ["line 1: from celery_outbox.store.outgoing import _insert_one",
                                    "line 3: Outbox._install"]
