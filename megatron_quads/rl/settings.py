"""The GRPO math's typed settings: advantages, IS correction, policy loss (torch-free).

These are the pydantic classes the run config composes, kept apart from the tensor code so that
validating a config does not import torch.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class AdvantageConfig(BaseModel):
    """How rewards become advantages within a group of responses to one prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    normalize_std: bool = Field(True, description="divide by the group's std (GRPO); False: Dr. GRPO")
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing")
    unbiased_std: bool = Field(True, description="sample std (n - 1, as torch.std, TRL and veRL); False: population std")


class CorrectionMode(str, Enum):
    """Which importance-sampling correction the loss applies."""

    NONE = "none"
    TOKEN_TIS = "token_tis"
    TOKEN_MIS = "token_mis"
    SEQ_MIS = "seq_mis"


class CorrectionConfig(BaseModel):
    """The correction mode and its bounds on the trainer/rollout ratio ``w``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: CorrectionMode = CorrectionMode.NONE
    c_high: float = Field(2.0, gt=1, description="TIS truncation C; upper bound of the MIS interval")
    c_low: float | None = Field(None, gt=0, le=1, description="lower bound of the MIS interval; None: 1 / c_high")

    @property
    def bounds(self) -> tuple[float, float]:
        """``(c_low, c_high)`` with the default ``c_low = 1 / c_high`` filled in."""
        return (1.0 / self.c_high if self.c_low is None else self.c_low), self.c_high


class LossAggregation(str, Enum):
    """How token losses are reduced to one number (see :mod:`megatron_quads.rl.loss` for ``(sum, count)``)."""

    TOKEN_MEAN = "token_mean"
    """Mean over all tokens of the global batch (DAPO, Dr. GRPO's choice of normaliser aside)."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Mean over sequences of each sequence's token sum."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences of each sequence's token mean (the original GRPO)."""


class PolicyLossConfig(BaseModel):
    """Clipping, dual clip, aggregation, KL penalty and IS correction of the policy loss."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eps_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped below at 1 - eps_low")
    eps_high: float = Field(0.2, ge=0, description="ratio clipped above at 1 + eps_high (clip-higher: e.g. 0.28)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip c (Ye et al.) for A < 0, e.g. 3; None: off")
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    kl_beta: float = Field(0.0, ge=0, description="coefficient of the k3 KL penalty to the reference policy")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)


class BatchKeys(BaseModel):
    """Names of the micro-batch tensors :class:`~megatron_quads.rl.loss.PolicyLoss` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mask: str = Field("mask", description="response-token mask")
    advantages: str = Field("advantages", description="[b] per response or per token")
    logp_old: str | None = Field("logp_old", description="behaviour log-probs; None: the current log-probs, detached")
    logp_rollout: str = Field("logp_rollout", description="rollout log-probs (needed by a correction; optional otherwise)")
    logp_ref: str = Field("logp_ref", description="reference-policy log-probs (needed when kl_beta > 0)")


class GapMonitorConfig(BaseModel):
    """The collapse early warning: when the rollout-vs-trainer gap's trend rises past a threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="log monitor/gap_trend each step and warn when it stays past the threshold")
    metric: str = Field("mismatch/k3_kl", description="the per-step record whose trend is watched")
    window: int = Field(50, ge=3, description="steps the trend is fitted over")
    threshold: float = Field(1.0, gt=0, description="warn when the fitted rise over one window exceeds this fraction "
                             "(1.0: the metric doubled)")
    patience: int = Field(3, ge=1, description="consecutive steps past the threshold before the warning")
    floor: float = Field(1e-9, gt=0, description="added to the metric before its logarithm (a metric of 0 stays finite)")
