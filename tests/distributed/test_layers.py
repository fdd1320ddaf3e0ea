"""The layers of upipe: every import points to the same or a lower layer, and no module
imports one that imports it back. Module-level and function-level imports alike, read from
the sources with `ast` (nothing is imported), so a lazy import cannot hide an upward edge.
Also the bottom's shape: communication in `upipe.comm` only (one head exchange), the head
rules torch-free in `upipe.heads`, and `upipe.jax` loading without torch."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first. A package covers its submodules (unless one is listed itself); the root
# package `upipe` covers only its own __init__ (the public API).
LAYERS = {
    # local attention kernels (and the Gated DeltaNet's conv and scan), communication
    # (layouts, the head exchange, ring send/recv), the head rules and plans (torch-free),
    # document boundaries, mesh, RoPE, GEMMs, the
    # loops that repeat their memory, the spawned-ranks launcher, memory measurement (tracker,
    # closed forms, fake process group), line plots
    "base": (
        "upipe.torch_private", "upipe.kernels", "upipe.kernels_cuda", "upipe.kernels_select",
        "upipe.kernels_deltanet", "upipe.kernels_delta_rule",
        "upipe.comm", "upipe.heads", "upipe.packing", "upipe.mesh",
        "upipe.rope", "upipe.gemm",
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


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def test_nothing_below_attention_imports_it():
    """The base layer (kernels, comm, heads, ...) knows no strategy: no import of
    `upipe.attention` or anything in it, at any depth of the source."""
    below = [m for m in MODULES if _layer(m) < LEVEL["upipe.attention"]]
    bad = {
        m: sorted(
            t for t in _imports(m) if t == "upipe.attention" or t.startswith("upipe.attention.")
        )
        for m in below
    }
    assert not {m: t for m, t in bad.items() if t}, bad


COLLECTIVES = {  # torch.distributed calls that move a strategy's data, and their one home
    "all_to_all_single": "upipe.comm.exchange",
    "all_to_all": "upipe.comm.exchange",
    "batch_isend_irecv": "upipe.comm.ring",
}


def test_communication_lives_in_comm():
    """One head exchange (even and uneven splits alike, `upipe.comm.exchange`) and one ring
    exchange (`upipe.comm.ring`): no other module calls those collectives; `comm_uneven`,
    the uneven exchange's old second home, is gone; nothing reaches into `upipe.comm` for a
    private helper."""
    calls = {
        (node.func.attr, module)
        for module in MODULES
        if module.startswith("upipe.") and not module.startswith("upipe.jax")
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in COLLECTIVES
    }
    assert not [(name, m) for name, m in calls if COLLECTIVES[name] != m], calls
    assert {
        ("all_to_all_single", "upipe.comm.exchange"),
        ("batch_isend_irecv", "upipe.comm.ring"),
    } <= calls
    assert "upipe.comm_uneven" not in MODULES
    assert not (SRC / "upipe" / "comm_uneven.py").exists()
    private = [
        (module, alias.name)
        for module in MODULES
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("upipe.comm")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not private, f"private helpers of upipe.comm imported elsewhere: {private}"


def _closure(start: set[str]) -> set[str]:
    """`start` and every upipe module they import, transitively (function-level imports too)."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += _imports(module)
    return seen


def _imports_torch(module: str) -> bool:
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "torch" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_heads_and_jax_need_no_torch_in_their_sources():
    """`upipe.heads` and everything `upipe.jax` imports (with the packages above them, whose
    `__init__` runs first) import no torch anywhere in their sources."""
    jax = {m for m in MODULES if m == "upipe.jax" or m.startswith("upipe.jax.")}
    needed = _closure(jax | {"upipe.heads", "upipe"})
    assert "upipe.heads" in _closure(jax)  # the port plans its stages with the library's rules
    assert not [m for m in sorted(needed) if _imports_torch(m)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the jax extra")
def test_jax_imports_without_torch():
    """In a fresh interpreter where `import torch` fails, `import upipe.jax` works and loads
    no torch module (a JAX user needs no PyTorch)."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # import torch raises ImportError\n"
        "import upipe.jax, upipe.heads\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.')))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
