"""Quantization error metrics shared by tests, benchmarks and the analysis tools."""

from __future__ import annotations

import torch


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``||approx - reference||_2 / ||reference||_2`` in fp64 (0 when both are zero)."""
    ref = reference.detach().to(torch.float64)
    diff = approx.detach().to(torch.float64) - ref
    denom = ref.norm()
    if denom == 0:
        return 0.0 if diff.norm() == 0 else float("inf")
    return float(diff.norm() / denom)


def per_channel_mse(reference: torch.Tensor, approx: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
    """Mean squared error per channel along ``channel_dim`` (fp64 ``[C]``), averaged over all other dims."""
    if reference.shape != approx.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs approx {tuple(approx.shape)}")
    sq = (approx.detach().to(torch.float64) - reference.detach().to(torch.float64)) ** 2
    sq = sq.movedim(channel_dim, -1)
    return sq.reshape(-1, sq.shape[-1]).mean(dim=0)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    rel = relative_error(reference, approx)
    return float("inf") if rel == 0 else float(-20.0 * torch.log10(torch.tensor(rel, dtype=torch.float64)))
