"""The package's layer rule (docs/architecture.md), read from the source: every ``import`` of every
module, those inside functions included, is checked against the layers it may reach, and the modules'
imports form no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_quads"

ALLOWED: dict[str, set[str]] = {
    "nvfp4": set(),
    "kernels": {"nvfp4"},
    "rl": set(),
    "tasks": set(),
    "atomic_io": set(),
    "manifest": {"atomic_io"},
    "demo": {"nvfp4"},
    "rollout": {"nvfp4", "kernels", "atomic_io"},
    "trainer": {"nvfp4", "kernels", "atomic_io"},
    "megatron_lm": {"nvfp4", "kernels", "trainer", "atomic_io"},
    "vllm_plugin": {"nvfp4", "kernels", "rollout", "atomic_io"},
    "convert": {"nvfp4", "kernels", "rollout", "trainer", "megatron_lm", "tasks", "embedded", "manifest", "atomic_io"},
    "embedded": {"nvfp4", "rollout", "tasks", "manifest", "atomic_io"},
    "analyze": {"nvfp4", "kernels", "rollout", "trainer", "atomic_io"},
    "controller": {"nvfp4", "kernels", "rollout", "trainer", "megatron_lm", "rl", "tasks", "embedded", "vllm_plugin",
                   "convert", "manifest", "atomic_io"},
    "cli": {"nvfp4", "kernels", "rollout", "trainer", "megatron_lm", "rl", "tasks", "embedded", "vllm_plugin",
            "convert", "controller", "analyze", "demo", "manifest", "atomic_io"},
}
"""Layer -> the layers it may import (modules of its own layer always)."""

THIRD_PARTY: dict[str, set[str]] = {
    "ray": {"controller"},
    "vllm": {"vllm_plugin"},
    "triton": {"nvfp4", "kernels"},
    "megatron": {"trainer", "megatron_lm", "controller", "convert", "analyze"},
}
"""A third-party package -> the only layers that import it."""


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<package>"


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (never run, so no import there can close a cycle)."""
    inside = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(path: Path, module: str, runtime_only: bool = False) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every import in ``path`` (with
    ``runtime_only``, those under ``if TYPE_CHECKING:`` left out)."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    skipped = _type_checking_nodes(tree) if runtime_only else set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule when there is one
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found.extend((name, node.lineno, id(node) in top_level) for name in names)
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to (a module, or the module holding the imported name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_layer_is_known() -> None:
    unknown = {_layer(m) for m in _modules()} - set(ALLOWED) - {"<package>"}
    assert not unknown, f"add {sorted(unknown)} to ALLOWED (and to docs/architecture.md)"


def test_no_module_imports_a_layer_above_it() -> None:
    modules = _modules()
    broken = []
    for module, path in modules.items():
        layer = _layer(module)
        for name, line, _ in _imports(path, module):
            root = name.split(".")[0]
            if root == "megatron_quads":
                target = _resolve(name, modules)
                target_layer = _layer(target) if target else None
                if target_layer not in (None, layer, "<package>") and target_layer not in ALLOWED[layer]:
                    broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({layer}) imports {name} ({target_layer})")
            elif root in THIRD_PARTY and layer not in THIRD_PARTY[root]:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({layer}) imports {root}")
    assert not broken, "layer rule broken:\n" + "\n".join(broken)


def _import_graph(modules: dict[str, Path], module_level_only: bool) -> dict[str, dict[str, int]]:
    """Module -> {package module it imports: the line of the first such import}; function-level
    imports included unless ``module_level_only``, those under ``if TYPE_CHECKING:`` never."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for name, line, top in _imports(path, module, runtime_only=True):
            target = _resolve(name, modules)
            if target and target != module and (top or not module_level_only):
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]``, or None (depth-first, in sorted order)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def _describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_module_level_imports_have_no_cycle() -> None:
    graph = _import_graph(_modules(), module_level_only=True)
    if cycle := _find_cycle(graph):
        pytest.fail("import cycle: " + _describe_cycle(cycle, graph))


def test_imports_have_no_cycle_counting_those_inside_functions() -> None:
    """A lazy import (kept for start-up cost: torch, Triton, vLLM, Megatron) must not close a cycle
    either: the piece two modules share belongs in a module both import."""
    graph = _import_graph(_modules(), module_level_only=False)
    if cycle := _find_cycle(graph):
        pytest.fail("import cycle (function-level imports included): " + _describe_cycle(cycle, graph))


def test_the_checker_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    """A cycle closed by a function-level import is found; one closed under TYPE_CHECKING is not."""
    layer = tmp_path / "megatron_quads" / "nvfp4"
    layer.mkdir(parents=True)
    (layer / "a.py").write_text("from megatron_quads.nvfp4.b import g\n")
    (layer / "b.py").write_text("def g():\n    from megatron_quads.nvfp4 import a\n")
    (layer / "c.py").write_text("from megatron_quads.nvfp4.d import h\n")
    (layer / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from megatron_quads.nvfp4.c import k\n")
    modules = {f"megatron_quads.nvfp4.{p.stem}": p for p in layer.glob("*.py")}
    graph = _import_graph(modules, module_level_only=False)
    assert _find_cycle(graph) == ["megatron_quads.nvfp4.a", "megatron_quads.nvfp4.b", "megatron_quads.nvfp4.a"]
    assert _find_cycle(_import_graph(modules, module_level_only=True)) is None
    del modules["megatron_quads.nvfp4.b"], modules["megatron_quads.nvfp4.a"]
    assert _find_cycle(_import_graph(modules, module_level_only=False)) is None


def test_the_checker_sees_a_broken_rule(tmp_path: Path) -> None:
    """The walk finds an upward import written inside a function, and a relative one."""
    bad = tmp_path / "megatron_quads" / "nvfp4" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from megatron_quads.rollout import grouped\n    from ..controller import run\n")
    names = [n for n, _, _ in _imports(bad, "megatron_quads.nvfp4.bad")]
    assert "megatron_quads.rollout.grouped" in names and "megatron_quads.controller.run" in names


def test_importing_the_numerics_and_kernels_packages_loads_no_triton() -> None:
    code = ("import sys, megatron_quads.nvfp4, megatron_quads.kernels, megatron_quads.rollout.grouped_experts;"
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
