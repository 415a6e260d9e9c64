"""The package's shape: no import cycle in autosplit/, measuring below planning and running
(:data:`LAYERS`), no module over 450 lines, and no public function of more than 8 parameters
(but those listed until their options become records).

All read the source with ``ast`` and import nothing, so they are fast and see every module,
including those that need optional dependencies.

The import graph has an edge A → B for every ``import``/``from … import`` of an autosplit
module that runs when A is imported: statements at module level, including inside ``try`` and
``if`` (but not ``if TYPE_CHECKING:``, which never runs). ``from P import name`` is an edge to
the submodule ``P.name`` when there is one, else to ``P``. The implicit edge from a submodule to
its parent package is left out: Python always runs a package's ``__init__`` before its
submodules, and an ``__init__`` that re-exports its submodules is not a cycle as long as the
submodules import each other directly (which the edges check).

Imports inside functions run later and may go against the grain. Most are there to keep
``import autosplit`` and the CLI's start-up light (torch, PuLP, matplotlib load on first use);
those are fine. One that would close a cycle if it were at module level is a deliberate cycle
breaker and must be listed in ``CYCLE_BREAKERS`` with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autosplit"
MAX_LINES = 450

# Function-level imports that would close a cycle at module level: (importer, imported): why.
CYCLE_BREAKERS: dict[tuple[str, str], str] = {}

# Modules allowed over MAX_LINES, each with its reason (none today).
OVER_LIMIT_FOR_NOW: set[str] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_run_at_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements in ``body`` that run when the module is imported."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                found += _imports_run_at_import(node.body)
            found += _imports_run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody):
                found += _imports_run_at_import(part)
            for handler in node.handlers:
                found += _imports_run_at_import(handler.body)
        elif isinstance(node, ast.With):
            found += _imports_run_at_import(node.body)
    return found


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> set[str]:
    """The autosplit modules an import statement in ``importer`` needs."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    base = node.module or ""
    if node.level:  # relative import
        is_package = MODULES[importer].name == "__init__.py"
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if base not in MODULES:
        return set()
    subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
    others = [a for a in node.names if f"{base}.{a.name}" not in MODULES]
    return subs | ({base} if others else set())


def _graph(level: str) -> dict[str, set[str]]:
    """Import edges per module: ``"module"`` (run on import) or ``"function"`` (the rest)."""
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        eager = _imports_run_at_import(tree.body)
        if level == "module":
            nodes: list[ast.Import | ast.ImportFrom] = eager
        else:
            ids = {id(n) for n in eager}
            nodes = [
                n for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in ids
            ]
        edges[name] = {t for n in nodes for t in _targets(n, name)} - {name}
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path start → … → goal along ``edges``, or ``None``."""
    stack, seen = [(start, [start])], {start}
    while stack:
        node, path = stack.pop()
        if node == goal:
            return path
        for nxt in sorted(edges.get(node, ())):
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_the_graph_sees_the_modules_and_their_imports() -> None:
    # guards the test itself: an ast walk that found nothing would pass vacuously
    edges = _graph("module")
    assert "autosplit.planner.search" in edges and "autosplit.specs.calibration" in edges
    assert "autosplit.planner.settings" in edges["autosplit.planner.search"]
    assert "autosplit.checks" in edges["autosplit.capture.trace"]  # `from autosplit import checks`
    assert "autosplit.specs.device_spec" in edges["autosplit.specs.named_devices"]
    assert "autosplit.pipeline" not in edges["autosplit"]  # lazy: under TYPE_CHECKING only


def test_no_import_cycle_among_module_level_imports() -> None:
    edges = _graph("module")
    cycles = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            back = _reaches(edges, b, a)
            if back is not None:
                cycles.append(" → ".join([a, *back]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_level_imports_that_break_a_cycle_are_listed() -> None:
    eager, lazy = _graph("module"), _graph("function")
    breakers = {
        (a, b): _reaches(eager, b, a)
        for a, targets in lazy.items() for b in targets
        if _reaches(eager, b, a) is not None
    }
    unlisted = {k: v for k, v in breakers.items() if k not in CYCLE_BREAKERS}
    assert not unlisted, (
        "imports inside functions that would close a cycle (list them in CYCLE_BREAKERS with "
        f"the reason, or remove the cycle): {unlisted}"
    )
    stale = set(CYCLE_BREAKERS) - set(breakers)
    assert not stale, f"CYCLE_BREAKERS lists imports that no longer break a cycle: {stale}"


def test_no_module_is_over_450_lines() -> None:
    too_long = {
        str(path.relative_to(PACKAGE)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    over = {name: n for name, n in too_long.items() if name not in OVER_LIMIT_FOR_NOW}
    assert not over, f"modules over {MAX_LINES} lines (split them by what they do): {over}"
    assert OVER_LIMIT_FOR_NOW <= {MODULES[m].relative_to(PACKAGE).as_posix()
                                   for m in MODULES}, "allow-list names a module that is gone"


MAX_PARAMETERS = 8
"""The most parameters a public function takes; past it, options go in a record
(ProfileOptions, PlanOptions, PartitionOptions, TimingOptions, EstimateOptions)."""


def _public_names(tree: ast.Module) -> set[str] | None:
    """The module's ``__all__``, ``None`` where it has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    """Every parameter a caller can pass (``*args`` and ``**kwargs`` one each), less
    ``self``/``cls`` of a method."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    count = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (method and bool(positional) and positional[0].arg in ("self", "cls"))


def _public_functions() -> dict[str, int]:
    """``"module.py:function"`` (or ``Class.method``) → its parameters, for every function of
    the public API: in ``__all__`` where the module has one, public by name otherwise."""
    found: dict[str, int] = {}
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        public = _public_names(tree)
        where = path.relative_to(PACKAGE).as_posix()
        for node in tree.body:
            if node.name.startswith("_") if hasattr(node, "name") else True:
                continue
            if public is not None and node.name not in public:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{where}:{node.name}"] = _parameters(node, False)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                            not item.name.startswith("_")):
                        found[f"{where}:{node.name}.{item.name}"] = _parameters(item, True)
    return found


def test_no_public_function_takes_more_than_8_parameters() -> None:
    functions = _public_functions()
    assert "measure/profiler.py:profile" in functions  # the walk sees the public API
    over = {name: count for name, count in functions.items() if count > MAX_PARAMETERS}
    assert over == {}, "take an options record instead"


def _package_of(module: str) -> str:
    """The package a module belongs to: ``autosplit.solve.exact`` → ``autosplit.solve``."""
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_private_name_is_imported_across_packages() -> None:
    crossing = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module in MODULES):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and _package_of(module) != _package_of(node.module):
                    crossing.append(f"{module} imports {node.module}.{alias.name}")
    assert crossing == [], "make the name public, or keep it inside its package"


LAYERS: dict[str, tuple[str, ...]] = {
    # package: the packages it must not import (at module level or inside a function)
    "autosplit.measure": ("autosplit.planner", "autosplit.solve", "autosplit.distributed",
                          "autosplit.cli", "autosplit.verify", "autosplit.codegen"),
    "autosplit.estimate": ("autosplit.planner", "autosplit.solve", "autosplit.distributed",
                           "autosplit.cli", "autosplit.verify", "autosplit.codegen"),
    "autosplit.verify": ("autosplit.distributed", "autosplit.cli", "autosplit.codegen"),
    "autosplit.schedules": ("autosplit.planner", "autosplit.solve", "autosplit.distributed",
                            "autosplit.cli", "autosplit.measure", "autosplit.verify"),
}
"""The data flow, capture → measure → plan → verify → build, as import rules: what measures
knows nothing of planning or running a plan, what verifies nothing of running one."""


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_measuring_imports_nothing_from_planning_or_running() -> None:
    eager, lazy = _graph("module"), _graph("function")
    edges = {name: eager[name] | lazy[name] for name in MODULES}
    assert any(_inside(m, "autosplit.measure") for m in edges)  # the rule sees the package
    broken = sorted(
        f"{module} imports {target}"
        for package, banned in LAYERS.items()
        for module, targets in edges.items() if _inside(module, package)
        for target in targets if any(_inside(target, b) for b in banned))
    assert broken == [], "layering (tests/test_layout.py LAYERS):\n" + "\n".join(broken)
