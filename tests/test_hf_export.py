"""Weights exported under Hugging Face names reproduce the Megatron model in transformers' Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.trainer.hf_export import export_hf_weights
from megatron_quads.trainer.model import (
    ParallelConfig,
    PolicyModelConfig,
    build_gpt_model,
)
from megatron_quads.trainer.quads_config import QuadsTrainerConfig

transformers = pytest.importorskip("transformers")

CFG = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, num_experts=4,
    moe_ffn_hidden_size=32, moe_router_topk=2, vocab_size=96, dtype="fp32", init_method_std=0.1,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    from megatron_quads.trainer.cpu_compat import init_distributed_cpu

    init_distributed_cpu(world_size=1, rank=0)


def to_transformers_layout(weights: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint names (one tensor per expert projection) -> transformers 5's fused expert tensors."""
    if not hasattr(transformers.models.qwen3_moe.modeling_qwen3_moe, "Qwen3MoeExperts"):
        return weights  # transformers 4 keeps per-expert modules
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]]) for e in range(num_experts)]
        )
        out[f"{p}.down_proj"] = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(num_experts)])
    return out


def qwen3_moe(cfg: PolicyModelConfig) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.hidden_size // cfg.num_attention_heads, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=True, rms_norm_eps=1e-5,
        rope_theta=cfg.rotary_base, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=cfg.max_sequence_length,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("quads", [None, QuadsTrainerConfig()])
def test_exported_weights_reproduce_megatron_logits_in_transformers(quads: QuadsTrainerConfig | None) -> None:
    cfg = PolicyModelConfig(**CFG)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, ParallelConfig(), quads)
    weights = dict(export_hf_weights(model))
    assert len(weights) == 3 + cfg.num_layers * (9 + 3 * cfg.num_experts)
    reference = qwen3_moe(cfg)
    reference.load_state_dict(to_transformers_layout(weights, cfg.num_layers, cfg.num_experts), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        megatron_logits = model(ids, torch.arange(10).expand(2, 10), attention_mask=None)
        hf_logits = reference(ids).logits
    # export is of the BF16 master weights: with QUADS the HF model runs unquantized weights
    tolerance = 1e-5 if quads is None else 0.5
    assert (megatron_logits - hf_logits).abs().max() < tolerance
    if quads is not None:
        assert (megatron_logits - hf_logits).abs().max() > 1e-4


def test_unknown_parameter_name_is_an_error() -> None:
    model = build_gpt_model(PolicyModelConfig(**CFG), ParallelConfig())
    model.decoder.layers[0].register_parameter("mystery", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(KeyError, match=r"decoder\.layers\.0\.mystery"):
        list(export_hf_weights(model))
