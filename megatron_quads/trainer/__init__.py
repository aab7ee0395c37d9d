"""Trainer side of QUADS: Asymmetric QAT layer specs for Megatron-Core MoE, and the policy worker."""

from megatron_quads.trainer.fake_quant import invalidate_fake_quant_caches
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig
from megatron_quads.trainer.specs import apply_quads, quads_block_spec, quads_layer_spec

__all__ = [
    "QuadsScope",
    "QuadsTrainerConfig",
    "apply_quads",
    "invalidate_fake_quant_caches",
    "quads_block_spec",
    "quads_layer_spec",
]
