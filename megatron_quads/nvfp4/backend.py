"""Triton kernels for NVFP4 on CUDA, bit-identical (quantize) or accumulation-exact (GEMMs) with the
PyTorch reference of :mod:`megatron_quads.nvfp4` and :mod:`megatron_quads.rollout`.

The reference functions dispatch here on their own (:func:`use_kernels`), so callers never import
this package directly. Triton is optional: without it, or on CPU, or with
``MEGATRON_QUADS_KERNELS=0`` in the environment, the reference path runs.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

ENV_DISABLE = "MEGATRON_QUADS_KERNELS"
"""Set to ``0`` to force the PyTorch reference path on CUDA too (debugging, A/B checks)."""


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports (it is an optional dependency: ``pip install .[gpu]``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def reference_path():
    """Within this block the PyTorch reference runs on CUDA too (tests compare kernels against it)."""
    previous = os.environ.get(ENV_DISABLE)
    os.environ[ENV_DISABLE] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ENV_DISABLE]
        else:
            os.environ[ENV_DISABLE] = previous


def use_kernels(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on CUDA, Triton is installed and kernels are not disabled."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return False
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    return triton_available()
