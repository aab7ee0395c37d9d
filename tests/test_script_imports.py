"""The benchmarks' and tools' imports from megatron_quads resolve (scripts no suite runs whole: a
renamed function must not break them unnoticed)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*REPO.glob("benchmarks/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("megatron_lm/*.py")])

# modules whose import needs what a CPU test run does not have or should not start
NEEDS_GPU_OR_HEAVY = ("megatron_quads.kernels.w4a16_ws", "megatron_quads.kernels.w4a16_ws_dense")


def _project_imports(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` of every ``from megatron_quads... import name`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module, alias.name, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_quads")
            for alias in node.names]


def test_there_are_scripts_to_check() -> None:
    assert any(_project_imports(p) for p in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_a_script_imports_from_the_project_exists(path: Path) -> None:
    missing = []
    for module, name, line in _project_imports(path):
        if module.startswith(NEEDS_GPU_OR_HEAVY):
            continue
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {name} from {module}")
    assert not missing, "imports that no longer resolve:\n" + "\n".join(missing)
