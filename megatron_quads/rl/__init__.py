"""The math of one GRPO step: advantages, clipped policy loss, IS corrections, mismatch metrics (pure torch)."""

from megatron_quads.rl.advantages import (
    AdvantageConfig,
    group_advantages,
    token_advantages,
)
from megatron_quads.rl.correction import (
    Correction,
    CorrectionConfig,
    CorrectionMode,
    compute_correction,
)
from megatron_quads.rl.loss import (
    BatchKeys,
    LossAggregation,
    LossOutput,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossResult,
    TokenLoss,
    aggregate,
    clipped_token_loss,
    k3_kl,
    policy_loss,
)
from megatron_quads.rl.metrics import MISMATCH_KEYS, mismatch_metrics

__all__ = [
    "MISMATCH_KEYS",
    "AdvantageConfig",
    "BatchKeys",
    "Correction",
    "CorrectionConfig",
    "CorrectionMode",
    "LossAggregation",
    "LossOutput",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossResult",
    "TokenLoss",
    "aggregate",
    "clipped_token_loss",
    "compute_correction",
    "group_advantages",
    "k3_kl",
    "mismatch_metrics",
    "policy_loss",
    "token_advantages",
]
