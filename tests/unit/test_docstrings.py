"""Every module of the package opens with a docstring that states its contract in a few lines: a
one-line summary, then (where it has one) its transaction boundary and guarantee, at most 12 lines
in all; the essays belong in docs/. Each public method of ``Outbox`` has a docstring. Read with
``ast``: no module of the package is imported, so no optional package is needed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "celery_outbox"
MAX_LINES = 12
SKIPPED = (PACKAGE / "django" / "migrations",)


def modules() -> list[Path]:
    """Every module of the package but Django's migrations (generated, not read)."""
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if not any(path.is_relative_to(skipped) for skipped in SKIPPED))


def module_docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def test_the_walk_finds_the_package() -> None:
    assert (PACKAGE / "outbox.py") in modules()
    assert not any("migrations" in path.parts for path in modules())


def test_every_module_has_a_short_docstring_with_a_one_line_summary() -> None:
    offending = []
    for path in modules():
        name = path.relative_to(PACKAGE.parent).as_posix()
        doc = module_docstring(path)
        if doc is None:
            offending.append(f"{name}: no module docstring")
            continue
        lines = doc.strip().splitlines()
        summary = doc.strip().split("\n\n", 1)[0].splitlines()
        if len(summary) != 1 or len(lines) > MAX_LINES:
            offending.append(f"{name}: summary of {len(summary)} line(s), docstring of {len(lines)} line(s)")
    assert not offending, (f"module docstrings must open with a one-line summary and be at most {MAX_LINES} "
                           "lines (move the essay to docs/):\n" + "\n".join(offending))


def outbox_class() -> ast.ClassDef:
    tree = ast.parse((PACKAGE / "outbox.py").read_text(encoding="utf-8"))
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Outbox")


def is_setter(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A property's setter or deleter: the property's getter carries its docstring."""
    return any(isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter")
               for decorator in function.decorator_list)


def test_every_public_method_of_outbox_has_a_docstring() -> None:
    methods = [node for node in outbox_class().body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")]
    assert methods, "no public method found in Outbox"
    missing = [method.name for method in methods if not is_setter(method) and ast.get_docstring(method) is None]
    assert not missing, f"public methods of Outbox without a docstring: {', '.join(missing)}"
