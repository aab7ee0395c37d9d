"""A random Qwen3-MoE checkpoint whose routing spreads tokens over the experts, for the GPU tests and
the GPU benchmark (no Megatron, no download).

vLLM's dummy load format fills every weight from ``U(-1e-3, 1e-3)`` and zero weights give every
router the same logits: either sends a batch's tokens to few experts and flatters 4-bit weights
(fewer experts read per step). Here matrices are ``N(0, std)`` with the scale of a trained model's
(``std`` 0.02: a linear's outputs have about unit scale after RMSNorm), the routers a little wider
(logits of std about 1.4 over the experts), norms one, all drawn from one seeded generator on the
given device, tensor by tensor, so the same seed gives the same checkpoint on any run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MATRIX_STD = 0.02
ROUTER_STD = 0.03


@dataclass(frozen=True)
class MoeShape:
    """The shape of a Qwen3-MoE decoder (every layer an MoE layer, no shared expert)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    max_positions: int = 4096

    def config_json(self) -> dict[str, Any]:
        """The model's ``config.json`` (the keys the project's exporter writes)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": 4 * self.hidden, "moe_intermediate_size": self.expert_ffn,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "num_experts": self.experts, "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False, "max_position_embeddings": self.max_positions, "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1,
        }

    def transformers_config(self):
        """The model's transformers ``Qwen3MoeConfig`` (what the built-in engine builds)."""
        from transformers import Qwen3MoeConfig

        fields = {k: v for k, v in self.config_json().items() if k not in ("architectures", "model_type", "dtype")}
        return Qwen3MoeConfig(**fields)


QWEN3_30B_A3B = MoeShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                         expert_ffn=768, vocab=151936, max_positions=40960)
"""Qwen3-30B-A3B's shapes."""


def random_weights(shape: MoeShape, seed: int = 0, device: str | torch.device = "cuda",
                   dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by Hugging Face name, layer by layer (see module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int, std: float = MATRIX_STD) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(*size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    h, d = shape.hidden, shape.head_dim
    yield "model.embed_tokens.weight", normal(shape.vocab, h, std=1.0)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", ones(h)
        yield f"{p}.post_attention_layernorm.weight", ones(h)
        yield f"{p}.self_attn.q_proj.weight", normal(shape.heads * d, h)
        yield f"{p}.self_attn.k_proj.weight", normal(shape.kv_heads * d, h)
        yield f"{p}.self_attn.v_proj.weight", normal(shape.kv_heads * d, h)
        yield f"{p}.self_attn.o_proj.weight", normal(h, shape.heads * d)
        yield f"{p}.self_attn.q_norm.weight", ones(d)
        yield f"{p}.self_attn.k_norm.weight", ones(d)
        yield f"{p}.mlp.gate.weight", normal(shape.experts, h, std=ROUTER_STD)
        for e in range(shape.experts):
            yield f"{p}.mlp.experts.{e}.gate_proj.weight", normal(shape.expert_ffn, h)
            yield f"{p}.mlp.experts.{e}.up_proj.weight", normal(shape.expert_ffn, h)
            yield f"{p}.mlp.experts.{e}.down_proj.weight", normal(h, shape.expert_ffn)
    yield "model.norm.weight", ones(h)
    yield "lm_head.weight", normal(shape.vocab, h)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly (ids 0 and 1, bos and eos, left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=gen).tolist()
