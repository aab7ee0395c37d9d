"""The converters' rule for weights: a NaN or Inf in a source tensor stops the conversion, naming it."""

from __future__ import annotations

import torch

ALLOW_FLAG = "--allow-nonfinite"
"""The option of hf-to-megatron, megatron-to-hf and reshard that copies non-finite values as they are."""


class NonFiniteTensorError(ValueError):
    """A source tensor holds NaN or Inf values."""


def require_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteTensorError` naming tensor ``name`` (read from ``where``) if it is
    floating point and holds a NaN or Inf."""
    if not tensor.is_floating_point():
        return
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    count = int(finite.numel() - finite.sum())
    raise NonFiniteTensorError(
        f"tensor '{name}' in {where} holds {count} NaN or Inf values: the checkpoint is damaged or holds diverged "
        f"weights; convert an earlier checkpoint (hf-to-megatron, megatron-to-hf and reshard copy such values with "
        f"{ALLOW_FLAG})"
    )
