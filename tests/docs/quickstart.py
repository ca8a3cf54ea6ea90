"""README's Quickstart shop, as its first steps make it, for the tests of the pages that build on
it (docs/operations.md, docs/monitoring.md use ``celery -A shop`` in their examples)."""

from __future__ import annotations

from ..markdown import blocks, shell, titled

QUICKSTART = blocks("README.md", "Quickstart")
FILES = ("shop.py", "pay.py", "twice.py")
QUEUES = ("payments", "receipts", "celery")  # the worker's -Q


def commands() -> list[list[str]]:
    """The commands of the Quickstart's shell blocks: the role and database, the tables, the worker
    and beat, the copy and the status."""
    return [block.commands() for block in shell(QUICKSTART)]


def make_shop(run, cwd, shop_lines: str = "") -> list[str]:
    """Write the Quickstart's files into ``cwd`` (``shop.py`` with ``shop_lines`` at its end, as a page
    says to add them), create its role, database and tables with ``run``; return the commands that
    start its worker and beat."""
    for name in FILES:
        code = titled(QUICKSTART, name).code
        (cwd / name).write_text(code + shop_lines if name == "shop.py" else code)
    create, tables, processes, _ = commands()
    for command in create + tables:
        run(command)
    return processes
