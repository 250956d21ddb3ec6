"""The import layering of the project's packages, read off the source with ``ast``.

* no import cycles among a package's modules, imports inside functions
  and under ``if TYPE_CHECKING:`` included (a lazy import or a type-only
  import is still an arrow between the layers a reader sees);
* no module imports another module's private (``_underscore``) names;
* ``memplan`` and ``solvers`` import only downward through their layers
  (`MEMPLAN_LAYERS`, `SOLVERS_LAYERS`), and ``solvers`` never imports torch;
* no library module is longer than `MAX_MODULE_LINES` (model definitions aside).

Nothing is imported: the test parses files, so it runs in milliseconds and
does not depend on the packages importing cleanly.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["memplan", "solvers"]

# solvers' subpackages, lowest first: a module may import from its own layer and the ones before it.
SOLVERS_LAYERS = [
    "solvers.core",
    "solvers.methods",
    "solvers.transforms",
    "solvers.strategies",
    "solvers.registry",
    "solvers.api",
]

# memplan's subpackages, lowest first: the stages of the pipeline in the order they run, with
# the building blocks below them and what users call above. `memplan` itself (its __init__,
# the exported names) sits on top of them all.
MEMPLAN_LAYERS = [
    "memplan.models",  # model definitions, importing nothing of memplan
    "memplan.core",  # storages, byte units, host-memory marks
    "memplan.ops",  # how one node runs: kernels, memplan's own ops, transfers
    "memplan.measure",  # the memory tracker and op timings
    "memplan.passes",  # graph passes over a captured graph
    "memplan.capture",  # stage 1: the joint graph
    "memplan.costs",  # stage 2: bytes and seconds per node
    "memplan.updates",  # the optimizer's update as part of the step
    "memplan.planning",  # stage 3: lowering to a solver Problem, analysis, the saved format
    "memplan.runtime",  # stage 5: running a plan, eagerly or compiled
    "memplan.pipeline",  # the stages called in order, the options, saved plans
    "memplan.frontend",  # optimize, the module, the torch.compile backend
    "memplan.tools",  # the CLI, plots, the demo
]
LAYERS = {"memplan": MEMPLAN_LAYERS, "solvers": SOLVERS_LAYERS}

# No library module is longer: past it a module has usually taken a second job.
MAX_MODULE_LINES = 800
MODEL_DEFINITIONS = ("memplan.models",)


# --------------------------------------------------------------------------- #
# Reading the imports
# --------------------------------------------------------------------------- #


def package_modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the file: at the top, inside functions, under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` lives in: itself, or the closest enclosing package module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def parsed_imports(package: str) -> dict[str, list[tuple[str, str | None]]]:
    """Per module: (absolute imported module, name taken from it or None for ``import x``),
    for every runtime import, inside and outside the project."""
    modules = package_modules(package)
    out: dict[str, list[tuple[str, str | None]]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        entries: list[tuple[str, str | None]] = []
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                entries.extend((alias.name, None) for alias in node.names)
            else:
                base = _base_of(node, module, path.name == "__init__.py")
                entries.extend((base, alias.name) for alias in node.names)
        out[module] = entries
    return out


def project_imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at run time (lazy imports included).

    ``from pkg import sub`` counts as importing the submodule ``pkg.sub`` when there is one,
    else the package ``pkg``; a module's import of itself is left out.
    """
    modules = package_modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, entries in parsed_imports(package).items():
        for base, name in entries:
            target = None
            if name is not None and f"{base}.{name}" in modules:
                target = f"{base}.{name}"
            elif base == package or base.startswith(package + "."):
                target = _owner(base, modules)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each one holds a cycle), sorted."""
    g = nx.DiGraph([(a, b) for a, targets in imports.items() for b in targets])
    g.add_nodes_from(imports)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def private_imports(package: str) -> list[str]:
    """``importer: from X import _name`` for every private name a module takes from another
    module of ``package`` (dunder names such as ``__version__`` are public)."""
    modules = package_modules(package)
    bad = []
    for module, entries in parsed_imports(package).items():
        for base, name in entries:
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            owner = _owner(base, modules) if base.split(".")[0] == package else None
            if owner is not None and owner != module:
                bad.append(f"{module}: from {base} import {name}")
    return bad


def layer_of(module: str, layers: list[str]) -> int | None:
    """Index of the layer (a module-name prefix) ``module`` belongs to; None if in none."""
    for i, prefix in enumerate(layers):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def layer_violations(imports: dict[str, set[str]], layers: list[str]) -> list[tuple[str, str]]:
    """(importer, imported) for every import from a lower layer into a higher one.

    ``layers``: module-name prefixes, lowest first. Modules in no layer (the package's
    ``__init__``) are not checked; importing within a layer or downward is fine.
    """
    bad = []
    for importer, targets in sorted(imports.items()):
        low = layer_of(importer, layers)
        if low is None:
            continue
        for target in sorted(targets):
            high = layer_of(target, layers)
            if high is not None and high > low:
                bad.append((importer, target))
    return bad


# --------------------------------------------------------------------------- #
# The rules
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    cycles = import_cycles(project_imports(package))
    assert not cycles, f"import cycles in {package} (lazy imports included): {cycles}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_names_across_modules(package):
    bad = private_imports(package)
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_import_only_downward(package):
    imports = project_imports(package)
    layers = LAYERS[package]
    placed = {layer: [m for m in imports if layer_of(m, [layer]) == 0] for layer in layers}
    assert all(placed.values()), f"layers with no module: {[k for k, v in placed.items() if not v]}"
    unplaced = sorted(m for m in imports if m != package and layer_of(m, layers) is None)
    assert not unplaced, f"modules of {package} in no layer: {unplaced}"
    bad = layer_violations(imports, layers)
    assert not bad, f"upward imports in {package}:\n" + "\n".join(f"{a} -> {b}" for a, b in bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_the_line_limit(package):
    long = sorted(
        f"{module}: {len(path.read_text().splitlines())} lines"
        for module, path in package_modules(package).items()
        if not module.startswith(MODEL_DEFINITIONS) and len(path.read_text().splitlines()) > MAX_MODULE_LINES
    )
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_solvers_never_imports_torch():
    bad = sorted(
        module
        for module, entries in parsed_imports("solvers").items()
        for base, _ in entries
        if base.split(".")[0] in ("torch", "memplan")
    )
    assert not bad, f"solvers modules that import torch (or memplan): {bad}"


# --------------------------------------------------------------------------- #
# The readers themselves, on made-up graphs
# --------------------------------------------------------------------------- #


def test_import_cycles_finds_lazy_and_long_cycles():
    assert import_cycles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}) == [["p.a", "p.b", "p.c"]]
    assert import_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_layer_violations_reports_upward_imports_only():
    layers = ["s.core", "s.methods", "s.api"]
    imports = {
        "s.core.x": {"s.core.y", "s.methods.m"},  # the second is upward
        "s.methods.m": {"s.core.x"},
        "s.api": {"s.methods.m", "s.core.y"},
        "s": {"s.api"},  # in no layer: not checked
    }
    assert layer_violations(imports, layers) == [("s.core.x", "s.methods.m")]


def test_project_imports_resolves_relative_and_submodule_forms(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from pkg.sub import c\n"
        "def f():\n    from .sub.c import _g\n"
    )
    (pkg / "b.py").write_text("import pkg.sub\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..b import x\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert project_imports("pkg") == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.sub.c"},
        "pkg.b": {"pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.b"},
    }
    assert private_imports("pkg") == ["pkg.a: from pkg.sub.c import _g"]
    assert import_cycles(project_imports("pkg")) == [["pkg.a", "pkg.sub.c"]]


def test_every_warning_class_of_memplan_is_exported():
    """A user filters memplan's warnings by the names ``memplan`` exports."""
    import importlib
    import pkgutil

    import memplan

    missing = []
    for info in pkgutil.walk_packages(memplan.__path__, "memplan."):
        if info.name.startswith("memplan.models"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and obj.__module__ == info.name and issubclass(obj, Warning)
                    and getattr(memplan, name, None) is not obj):
                missing.append(f"{info.name}.{name}")
    assert not missing, f"warning classes not exported by memplan: {missing}"


# The stages every planning caller reaches through `memplan.pipeline.stages` only.
PIPELINE_STAGES = {"capture", "learn_updates", "analyze_capture"}
PIPELINE_MODULE = "memplan.pipeline.stages"


def stage_callers(package: str) -> dict[str, set[str]]:
    """Stage function name -> the modules of ``package`` that call it (by name or as an attribute)."""
    callers: dict[str, set[str]] = {name: set() for name in PIPELINE_STAGES}
    for module, path in package_modules(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in callers:
                    callers[name].add(module)
    return callers


def test_the_pipeline_is_the_only_caller_of_its_stages():
    """``optimize``, the backend, saved plans, ``analyze`` and the CLI all plan through one
    pipeline: none of them captures, probes the optimizer or analyses by itself."""
    callers = stage_callers("memplan")
    assert all(callers.values()), f"a stage nobody calls: {callers}"
    others = {name: sorted(mods - {PIPELINE_MODULE}) for name, mods in callers.items() if mods - {PIPELINE_MODULE}}
    assert not others, f"stages called outside {PIPELINE_MODULE}: {others}"
