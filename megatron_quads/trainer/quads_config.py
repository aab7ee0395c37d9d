"""The trainer-side QUADS (Asymmetric QAT) options."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class QuadsScope(str, Enum):
    """Which linears are fake-quantized. Router, embeddings, output layer and norms never are."""

    ROUTED_EXPERTS = "routed_experts"
    """Routed experts only (the paper's and NeMo-RL's choice; the default)."""
    EXPERTS = "experts"
    """Routed and shared experts."""
    EXPERTS_AND_ATTENTION = "experts_and_attention"
    """Routed and shared experts, and the attention projections (QKV and output)."""
    ALL_LINEARS = "all_linears"
    """Every transformer linear, dense MLPs included."""


class QuadsTrainerConfig(BaseModel):
    """Asymmetric QAT: which weights the trainer fake-quantizes to NVFP4, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    scope: QuadsScope = QuadsScope.ROUTED_EXPERTS
    bf16_first_layers: int = Field(0, ge=0, description="transformer layers at the start kept in high precision")
    bf16_last_layers: int = Field(0, ge=0, description="transformer layers at the end kept in high precision")
    block_2d: bool = Field(
        False,
        description="16x16 weight scales (TE's training default) instead of the 1x16 scales that "
        "vLLM / ModelOpt checkpoints store; keep False so trainer and rollout hold the same weights",
    )

    def covers_shared_experts(self) -> bool:
        """Whether shared experts are in scope."""
        return self.scope != QuadsScope.ROUTED_EXPERTS

    def covers_attention(self) -> bool:
        """Whether attention projections are in scope."""
        return self.scope in (QuadsScope.EXPERTS_AND_ATTENTION, QuadsScope.ALL_LINEARS)

    def covers_dense_mlp(self) -> bool:
        """Whether the MLPs of dense (non-MoE) layers are in scope."""
        return self.scope == QuadsScope.ALL_LINEARS

    def layer_in_scope(self, layer_index: int, num_layers: int) -> bool:
        """Whether 0-based global transformer layer ``layer_index`` is fake-quantized at all."""
        return self.enabled and self.bf16_first_layers <= layer_index < num_layers - self.bf16_last_layers
