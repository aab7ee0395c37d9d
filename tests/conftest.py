"""Shared pytest configuration: markers and deterministic seeds."""

from __future__ import annotations

import os

import pytest
import torch

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""The Triton kernel tests also run on CPU under Triton's interpreter (``TRITON_INTERPRET=1 pytest -m gpu
tests/test_kernels_*.py``, which ``make test`` runs): the kernels' arithmetic, bit for bit against the
reference, on small shapes. Timing, Gluon kernels and CUDA-only paths still need ``pytest -m gpu`` on a GPU."""


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalars into ``int(1-element array)``, an error on NumPy >= 2.4,
    so every ``range(runtime_int)`` in a kernel fails. Read the element instead (test-only shim)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


if TRITON_INTERPRET:
    _fix_interpreter_scalar_index()


def _share_cpu_threads_among_xdist_workers() -> None:
    """Under ``pytest -n N`` (the GPU machine's runs) each worker's PyTorch would start one thread per
    core for the CPU references: N times oversubscribed. Give each worker its share of the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_cpu_threads_among_xdist_workers()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; run on the GPU machine (`pytest -m gpu`)")


_XDIST_GROUPS = {
    "ray": ("test_collapse_run.py", "test_controller.py", "test_controller_multinode.py", "test_interrupted_runs.py",
            "test_readme.py"),
    "vllm": ("test_convert_to_quads.py", "test_vllm_engine.py", "test_vllm_fp4_gemm.py", "test_vllm_linear_method.py",
             "test_vllm_serving.py"),
}
"""Test modules that run on one worker under ``pytest -n N --dist loadgroup`` (``make test``): one Ray
cluster at a time, and the vLLM engines' module-scoped fixtures built once."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup`` by :data:`_XDIST_GROUPS`: each group's tests go to one worker, every other
    test to whichever worker is free (xdist's own loadgroup reads a node-id suffix that pytest 9 no
    longer lets it set)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    group_of = {module: group for group, modules in _XDIST_GROUPS.items() for module in modules}

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)

    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" not in item.keywords:
            continue
        if TRITON_INTERPRET and item.path.name.startswith("test_kernels_"):
            continue  # Triton kernel tests run on CPU tensors under the interpreter
        item.add_marker(needs_gpu)


@pytest.fixture
def kernel_device() -> str:
    """Where Triton kernel tests put their tensors: CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _reference_numerics_in_kernel_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel tests call the kernels directly and compare them with the PyTorch reference, which
    would otherwise dispatch to the same kernels on CUDA."""
    if request.path.name.startswith("test_kernels_"):
        monkeypatch.setenv("MEGATRON_QUADS_KERNELS", "0")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
