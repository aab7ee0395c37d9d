"""Weight payloads between trainer and rollout workers: plain tensors that any transport can carry.

Ray's tensor serializer cannot carry float8 tensors, so a payload stores them as their raw bytes
(uint8 views) and records which names to view back. A payload also carries the weight version; the
receiving worker checks names, shapes and dtypes when it rebuilds the weights
(``QuantizedModelWeights.from_state_dict`` validates every tensor).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_quads.rollout.weights import QuantizedModelWeights


def to_payload(weights: QuantizedModelWeights | dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    """Flatten weights (quantized or BF16 by HF name) into uint8-safe tensors plus metadata."""
    quantized = isinstance(weights, QuantizedModelWeights)
    tensors = weights.state_dict() if quantized else dict(weights)
    fp8 = [name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    flat = {name: (t.view(torch.uint8) if name in fp8 else t).contiguous() for name, t in tensors.items()}
    return {
        "version": version,
        "quantized": quantized,
        "config": dict(weights.config) if quantized else None,
        "fp8": fp8,
        "tensors": flat,
    }


def from_payload(payload: dict[str, Any]) -> tuple[QuantizedModelWeights | dict[str, torch.Tensor], int]:
    """Inverse of :func:`to_payload`: (weights, version)."""
    tensors = {name: (t.view(torch.float8_e4m3fn) if name in payload["fp8"] else t) for name, t in payload["tensors"].items()}
    if payload["quantized"]:
        return QuantizedModelWeights.from_state_dict(tensors, payload["config"]), payload["version"]
    return tensors, payload["version"]


def payload_bytes(payload: dict[str, Any]) -> int:
    """Bytes of tensor data in a payload."""
    return sum(t.numel() * t.element_size() for t in payload["tensors"].values())
