"""Tensors derived once from a weight tensor and kept while it lives (kernel-side layouts of a weight).

A derived tensor is rebuilt when its source was written in place (its version counter moved, e.g. a
weight sync) or its storage changed, and dropped when the source is freed. Building one inside a
CUDA graph capture is refused: the copy would be captured and never rerun.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

_CACHE: dict[tuple[int, str], tuple[weakref.ref, int, int, torch.Tensor]] = {}


def derived_tensor(source: torch.Tensor, kind: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``'s tensor for ``(source, kind)``, built on first use and again whenever ``source``
    changed since (``kind`` names the derivation, with any parameter it takes)."""
    key = (id(source), kind)
    cached = _CACHE.get(key)
    if cached is not None and cached[0]() is source and cached[1] == source._version and cached[2] == source.data_ptr():
        return cached[3]
    if source.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the {kind} copy of a weight must be built before CUDA graph capture: run the layer once "
                           "eagerly first")
    value = build()
    _CACHE[key] = (weakref.ref(source, lambda _, key=key: _CACHE.pop(key, None)), source._version, source.data_ptr(),
                   value)
    return value
