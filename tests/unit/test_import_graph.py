"""The package's import graph has no cycle: every module can be read, imported and tested with
only the modules below it. Every import counts: at the top of a module, inside a function, and
under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_outbox

PACKAGE = Path(celery_outbox.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
                elif target in modules:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def package_graph() -> dict[str, set[str]]:
    modules = module_names()
    # a package imports its own modules to re-export them: that edge is not a layer going up
    return {name: {target for target in imports_of(name, path, modules) if not target.startswith(f"{name}.")}
            for name, path in modules.items()}


def test_the_import_graph_has_no_cycle():
    graph = package_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " / ".join(f"{module} -> {sorted(graph[module] & set(cycle))}" for module in cycle) for cycle in found)


def unresolved_imports(modules: dict[str, Path]) -> list[str]:
    """Each import, anywhere in a module (inside a function too), of a module of the package that
    does not exist: a path a move left behind."""
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                if target and target.split(".")[0] == "celery_outbox" and target not in modules:
                    found.append(f"{name}:{node.lineno} imports {target}")
            elif isinstance(node, ast.Import):
                found += [f"{name}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] == "celery_outbox" and alias.name not in modules]
    return sorted(found)


def test_every_import_of_the_package_names_a_module_that_exists():
    """Imports inside functions run only when called: one that names a module a move left behind
    would fail only then, in front of a user."""
    missing = unresolved_imports(module_names())
    assert missing == [], "imports of modules that do not exist: " + "; ".join(missing)


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_parts_never_import_the_composition_root():
    """Only the CLI's modules (and the package, which re-exports it) import ``Outbox``: the parts it composes
    are handed what they use."""
    importers = sorted(name for name, targets in package_graph().items() if "celery_outbox.outbox" in targets)
    assert importers and all(name.startswith("celery_outbox.cli.") for name in importers), importers


#: the integrations, which the core never imports: the composition root hands them in
INTEGRATIONS = ("celery_outbox.django", "celery_outbox.audit")
#: what may import them: the composition root (``Outbox(app)``), the CLI's modules, the package's
#: face (it re-exports the root), and the integrations themselves
ABOVE_THE_CORE = ("celery_outbox", "celery_outbox.outbox", "celery_outbox.cli")


def above_the_core(name: str) -> bool:
    return name in ABOVE_THE_CORE or name.startswith("celery_outbox.cli.")


def test_the_core_never_imports_an_integration():
    """No module of the core imports Django's integration or the audit: ``Outbox(app)`` hands the
    runtime what they give (``celery_outbox.core.integration.Integration``, the archiver)."""
    def integration(name: str) -> bool:
        return any(name == each or name.startswith(f"{each}.") for each in INTEGRATIONS)

    upward = sorted(f"{name} -> {target}" for name, targets in package_graph().items()
                    if not integration(name) and not above_the_core(name)
                    for target in targets if integration(target))
    assert upward == [], "the core imports an integration: " + "; ".join(upward)


#: the package's folders and face modules, bottom up: a module imports only modules of its own
#: unit or of a unit on a lower layer. The consumer side and maintenance share a layer: neither
#: imports the other; nor does Django's integration import the audit, or the other way round.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("celery_outbox.errors", "celery_outbox.vocabulary"),  # the public words
    ("celery_outbox.signals",),
    ("celery_outbox.store",),  # the only SQL
    ("celery_outbox.core",),
    ("celery_outbox.message",),
    ("celery_outbox.monitoring",),
    ("celery_outbox.producer",),
    ("celery_outbox.consumer", "celery_outbox.maintenance"),
    ("celery_outbox.django", "celery_outbox.audit"),  # the integrations
    ("celery_outbox.outbox",),  # the composition root
    ("celery_outbox.cli", "celery_outbox.metrics"),  # what users run or import beside Outbox
    ("celery_outbox",),  # the package's face
)


def unit_of(module: str) -> str:
    """The unit of ``LAYERS`` a module belongs to: the longest that names it or a package above it."""
    units = [unit for layer in LAYERS for unit in layer if module == unit or module.startswith(f"{unit}.")]
    assert units, f"{module} is in no unit of LAYERS: place it in a side's folder, or add it to LAYERS"
    return max(units, key=len)


def layer_of(unit: str) -> int:
    return next(number for number, layer in enumerate(LAYERS) if unit in layer)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module of a unit on the same or a higher layer, but its own unit's."""
    found = []
    for name, targets in graph.items():
        for target in targets:
            source, imported = unit_of(name), unit_of(target)
            if source != imported and layer_of(imported) >= layer_of(source):
                found.append(f"{name} -> {target}")
    return sorted(found)


def test_each_side_imports_only_the_layers_below_it():
    upward = upward_imports(package_graph())
    assert upward == [], "imports that run back up the layers: " + "; ".join(upward)


def test_the_layer_check_finds_an_import_that_runs_up_or_sideways():
    graph = {"celery_outbox.store.base": {"celery_outbox.core.runtime"},
             "celery_outbox.consumer.inbox": {"celery_outbox.maintenance.relay", "celery_outbox.producer.broker"},
             "celery_outbox.core.runtime": set(), "celery_outbox.maintenance.relay": set(),
             "celery_outbox.producer.broker": set()}
    assert upward_imports(graph) == ["celery_outbox.consumer.inbox -> celery_outbox.maintenance.relay",
                                     "celery_outbox.store.base -> celery_outbox.core.runtime"]


def test_architecture_md_gives_the_graphs_numbers():
    """docs/architecture.md states the graph's size as it is: modules, imports, layers, and none
    running back up."""
    graph = package_graph()
    modules = len(graph)
    imports = sum(len(targets) for targets in graph.values())
    page = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    stated = (f"{modules} modules, {imports} imports between them, on {len(LAYERS)} layers, "
              f"{len(upward_imports(graph))} of them running back up")
    assert stated in page, f"docs/architecture.md should say: {stated!r}"
