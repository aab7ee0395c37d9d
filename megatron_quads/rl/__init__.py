"""The math of one GRPO step: advantages, clipped policy loss, IS corrections, mismatch metrics (torch).

Their settings live in the torch-free :mod:`megatron_quads.rl.settings`; the names below are imported
on first use, so importing that module does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_quads.rl.advantages import group_advantages, token_advantages
    from megatron_quads.rl.correction import Correction, compute_correction
    from megatron_quads.rl.loss import (
        LossOutput,
        PolicyLoss,
        PolicyLossResult,
        TokenLoss,
        aggregate,
        clipped_token_loss,
        k3_kl,
        policy_loss,
    )
    from megatron_quads.rl.metrics import MISMATCH_KEYS, entropy_metrics, mismatch_metrics
    from megatron_quads.rl.settings import (
        AdvantageConfig,
        BatchKeys,
        CorrectionConfig,
        CorrectionMode,
        LossAggregation,
        PolicyLossConfig,
    )

_WHERE = {
    "MISMATCH_KEYS": "metrics",
    "AdvantageConfig": "settings",
    "BatchKeys": "settings",
    "Correction": "correction",
    "CorrectionConfig": "settings",
    "CorrectionMode": "settings",
    "LossAggregation": "settings",
    "LossOutput": "loss",
    "PolicyLoss": "loss",
    "PolicyLossConfig": "settings",
    "PolicyLossResult": "loss",
    "TokenLoss": "loss",
    "aggregate": "loss",
    "clipped_token_loss": "loss",
    "compute_correction": "correction",
    "entropy_metrics": "metrics",
    "group_advantages": "advantages",
    "k3_kl": "loss",
    "mismatch_metrics": "metrics",
    "policy_loss": "loss",
    "token_advantages": "advantages",
}
"""Exported name -> the submodule that defines it."""

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
