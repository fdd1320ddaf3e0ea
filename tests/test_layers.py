"""The layers of upipe: every import points to the same or a lower layer, and no module
imports one that imports it back. Module-level and function-level imports alike, read from
the sources with `ast` (nothing is imported), so a lazy import cannot hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A package covers its submodules (unless one is listed itself); the root
# package `upipe` covers only its own __init__ (the public API).
LAYERS = {
    # local attention kernels (and the Gated DeltaNet's conv and scan), communication,
    # document boundaries, mesh, RoPE, GEMMs, the loops that repeat their memory, the
    # spawned-ranks launcher, memory measurement (tracker, closed forms, fake process group),
    # line plots
    "base": (
        "upipe.torch_private", "upipe.kernels", "upipe.kernels_cuda", "upipe.kernels_select",
        "upipe.kernels_deltanet",
        "upipe.comm", "upipe.packing", "upipe.mesh",
        "upipe.rope", "upipe.gemm", "upipe.comm_uneven",
        "upipe.loops", "upipe.launch", "upipe.memory", "upipe.plot",
    ),
    # the strategies, and the public API that re-exports them
    "attention": ("upipe.attention", "upipe", "upipe.jax"),
    # the decoder (no parallelism in it) and the loss
    "model": ("upipe.model", "upipe.loss"),
    # the training stack; the same attention swap for Hugging Face models
    "train": ("upipe.train", "upipe.integrations"),
    # what the commands run: the planner (it runs the Trainer), the benchmark (and demo)
    "tools": ("upipe.planner", "upipe.bench"),
    # the command line and the `python -m` entry points
    "cli": ("upipe.cli", "upipe.__main__", "upipe.train.__main__"),
}  # fmt: skip
LEVEL = {name: level for level, names in enumerate(LAYERS.values()) for name in names}


def _modules() -> dict[str, Path]:
    """Every module under src/upipe by dotted name (a package by its __init__)."""
    modules = {}
    for path in sorted((SRC / "upipe").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _entry(module: str) -> str:
    """The entry of LAYERS that covers `module`: its longest listed prefix (the root package
    only itself)."""
    name = module
    while name not in LEVEL:
        name = name.rpartition(".")[0]
        if name == "upipe":
            pytest.fail(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return name


def _layer(module: str) -> int:
    return LEVEL[_entry(module)]


def _resolve(name: str) -> str:
    """The module an imported name lives in: `upipe.model.CausalLM` -> `upipe.model`."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set[str]:
    """The upipe modules `module` imports, anywhere in its source."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {_resolve(n) for n in names if n.split(".")[0] == "upipe"}
    return found - {module}


def test_the_table_names_existing_modules():
    stale = [n for n in LEVEL if not any(m == n or m.startswith(n + ".") for m in MODULES)]
    assert not stale, f"LAYERS lists modules that do not exist: {stale}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    names = list(LAYERS)
    level = _layer(module)
    upward = [
        f"{target} ({names[_layer(target)]})"
        for target in sorted(_imports(module))
        if _layer(target) > level
    ]
    assert not upward, f"{module} ({names[level]}) imports a higher layer: {upward}"


@pytest.mark.parametrize("unit", ["module", "entry of LAYERS"])
def test_no_import_cycle(unit):
    """Neither between modules nor between the packages and modules that LAYERS lists (two
    modules of one package each importing the other's package is a cycle too)."""
    key = (lambda m: m) if unit == "module" else _entry
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        graph.setdefault(key(module), set()).update(key(t) for t in _imports(module))
    state: dict[str, str] = {}  # "open" while on the current path, then "done"

    def visit(path: list[str]) -> None:
        state[path[-1]] = "open"
        for target in sorted(graph[path[-1]] - {path[-1]}):
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(path + [target])
        state[path[-1]] = "done"

    for node in sorted(graph):
        if node not in state:
            visit([node])


def test_loops_are_called_through_the_module():
    """The planner substitutes `upipe.loops`' functions for a simulated step
    (`upipe.planner.sampled`); a name imported from the module would escape it."""
    early = [
        name
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "upipe.loops"
    ]
    assert not early, f"`from upipe.loops import ...` in {early}; use `from upipe import loops`"
