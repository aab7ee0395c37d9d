"""Weight buckets between trainer and rollout workers: plain tensors of bounded size, versioned.

Ray's tensor serializer cannot carry float8 tensors, so a bucket stores them as their raw bytes
(uint8 views) and records which names to view back. Weights are split into buckets of at most
``bucket_bytes`` (a tensor larger than that travels alone), each tagged with the weight version, its
index and the bucket count; the receiver checks the set is complete and consistent, then rebuilds the
weights, which validates every tensor's name, shape and dtype (``QuantizedModelWeights.from_state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_quads.rollout.weights import QuantizedModelWeights


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def to_buckets(
    weights: QuantizedModelWeights | dict[str, torch.Tensor], version: int, bucket_bytes: int = 256 * 2**20
) -> list[dict[str, Any]]:
    """Split weights (quantized, or BF16 by HF name) into uint8-safe buckets of bounded size."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    quantized = isinstance(weights, QuantizedModelWeights)
    tensors = weights.state_dict() if quantized else dict(weights)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        raw = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).contiguous()
        if groups[-1] and size + _tensor_bytes(raw) > bucket_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = raw
        size += _tensor_bytes(raw)
    fp8 = [name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    meta = {"version": version, "count": len(groups), "quantized": quantized,
            "config": dict(weights.config) if quantized else None}
    return [{**meta, "index": i, "fp8": [n for n in fp8 if n in g], "tensors": g} for i, g in enumerate(groups)]


def from_buckets(buckets: list[dict[str, Any]]) -> tuple[QuantizedModelWeights | dict[str, torch.Tensor], int]:
    """Inverse of :func:`to_buckets`: (weights, version); an incomplete or mixed set raises."""
    if not buckets:
        raise ValueError("received no weight buckets")
    first = buckets[0]
    indices = sorted(b["index"] for b in buckets)
    if indices != list(range(first["count"])) or any(b["count"] != first["count"] for b in buckets):
        raise ValueError(f"incomplete weight sync: got buckets {indices} of {first['count']}")
    versions = {b["version"] for b in buckets}
    if len(versions) != 1:
        raise ValueError(f"weight buckets from different versions {sorted(versions)}")
    tensors: dict[str, torch.Tensor] = {}
    for b in buckets:
        for name, t in b["tensors"].items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} arrived in two buckets")
            tensors[name] = t.view(torch.float8_e4m3fn) if name in b["fp8"] else t
    if first["quantized"]:
        return QuantizedModelWeights.from_state_dict(tensors, first["config"]), first["version"]
    return tensors, first["version"]


def buckets_bytes(buckets: list[dict[str, Any]]) -> int:
    """Bytes of tensor data in a set of buckets."""
    return sum(_tensor_bytes(t) for b in buckets for t in b["tensors"].values())
