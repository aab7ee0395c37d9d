"""Shared pieces of the vLLM tests: the embedded model's weights and a QUADS checkpoint of them."""

from __future__ import annotations

import torch

from megatron_quads import embedded
from megatron_quads.rollout.engine import Generation
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.scopes import routed_expert_scope
from megatron_quads.rollout.weight_calibration import calibrate_weights
from megatron_quads.tasks import encode_prompt

RATIO = 0.25


def embedded_hf_weights() -> tuple[dict[str, torch.Tensor], dict, object]:
    """The embedded model's tensors by Hugging Face name (fp32), its config.json dict and its
    transformers config."""
    from megatron.core import dist_checkpointing

    from megatron_quads.trainer.hf_config import hf_config_from_policy
    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.hf_export import export_hf_weights, qwen3_moe_config
    from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig, build_gpt_model

    init_trainer_distributed(1, 0, ParallelConfig())
    cfg = PolicyModelConfig(**embedded.model_config_fields())
    model = build_gpt_model(cfg, ParallelConfig())
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(embedded.ASSET_DIR / "checkpoint"))
    model.load_state_dict(state["model"])
    weights = {name: t.detach().clone().contiguous() for name, t in export_hf_weights(model)}
    return weights, hf_config_from_policy(cfg), qwen3_moe_config(cfg)


def task_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` held-out arithmetic prompts as token ids."""
    tok = embedded.tokenizer()
    return [encode_prompt(tok, p.text) for p in embedded.task(split="eval").sample_prompts(n, seed=seed)]


def calibrated_weights(weights: dict[str, torch.Tensor], hf_config, prompts: list[list[int]],
                       version: int = 1) -> QuantizedModelWeights:
    """NVFP4 routed experts with the RAC channels the built-in engine chooses on ``prompts``."""
    quantized = quantize_hf_weights(weights.items(), routed_expert_scope(), ratio=RATIO, weight_version=version,
                                    unquantized_dtype=torch.float32)
    return calibrate_weights(quantized, hf_config, prompts).apply(quantized, weight_version=version)


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The matrices moved by ``scale`` of their std in a seeded random direction (a training step's worth)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: t + scale * t.std() * torch.randn(t.shape, generator=gen) if t.ndim == 2 else t.clone()
            for name, t in weights.items()}


def max_logprob_gap(a: list[Generation], b: list[Generation]) -> float:
    """Largest |log-prob difference| over all tokens of two equal-token generation lists."""
    return max(abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga.logprobs, gb.logprobs, strict=True))
