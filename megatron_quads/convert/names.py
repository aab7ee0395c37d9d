"""Megatron dist-checkpoint tensors <-> Hugging Face (Qwen3-MoE) tensors.

A Megatron dist checkpoint stores every tensor as one *global* tensor, whatever the TP/EP layout it
was saved in: per-layer tensors are stacked over layers (``[L, ...]``), routed-expert tensors over
layers and experts (``[L, E, ...]``), tensor-parallel shards are laid out as at TP 1 (fused QKV
interleaved per query group, expert fc1 as ``[gate; up]``). This module maps those global tensors,
indexed by their stacking prefix (``()``, ``(layer,)`` or ``(layer, expert)``), to HF tensors and
back; Megatron itself decides which rank holds which slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_quads.trainer.hf_export import split_qkv
from megatron_quads.trainer.model import PolicyModelConfig

GetTensor = Callable[[str], torch.Tensor]
"""Returns the HF tensor of a name (raises KeyError naming it when absent)."""

_ATTN = "decoder.layers.self_attention"
_MLP = "decoder.layers.mlp"
_EXPERTS = "decoder.layers.mlp.experts.experts"


@dataclass(frozen=True)
class MegatronTensor:
    """One global dist-checkpoint tensor: its key, stacking depth (0 top-level, 1 per layer, 2 per expert)."""

    key: str
    depth: int


_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER = {
    f"{_ATTN}.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    f"{_ATTN}.linear_proj.weight": "self_attn.o_proj.weight",
    f"{_ATTN}.q_layernorm.weight": "self_attn.q_norm.weight",
    f"{_ATTN}.k_layernorm.weight": "self_attn.k_norm.weight",
    f"{_MLP}.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    f"{_MLP}.router.weight": "mlp.gate.weight",
}
QKV = f"{_ATTN}.linear_qkv.weight"
EXPERT_FC1 = f"{_EXPERTS}.linear_fc1.weight"
EXPERT_FC2 = f"{_EXPERTS}.linear_fc2.weight"


def megatron_tensors(model: PolicyModelConfig) -> list[MegatronTensor]:
    """Every global tensor a dist checkpoint of ``model`` holds (model weights; no optimizer state)."""
    top = [MegatronTensor(k, 0) for k in _TOP if k != "output_layer.weight" or model.untie_embeddings]
    layer = [MegatronTensor(k, 1) for k in [*_LAYER, QKV]]
    return top + layer + [MegatronTensor(EXPERT_FC1, 2), MegatronTensor(EXPERT_FC2, 2)]


def _head_layout(model: PolicyModelConfig) -> tuple[int, int, int]:
    groups = model.num_query_groups or model.num_attention_heads
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    return groups, model.num_attention_heads // groups, head_dim


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """HF q, k, v -> Megatron's fused QKV, interleaved per query group."""
    hidden = q.shape[-1]
    per_group = [t.reshape(groups, -1, hidden) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, hidden)


def hf_tensor_shapes(model: PolicyModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of ``model`` and its shape (the names a Qwen3-MoE checkpoint holds)."""
    groups, q_per_group, head_dim = _head_layout(model)
    h, f = model.hidden_size, model.moe_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if model.untie_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (groups * q_per_group * head_dim, h),
            f"{p}.self_attn.k_proj.weight": (groups * head_dim, h),
            f"{p}.self_attn.v_proj.weight": (groups * head_dim, h),
            f"{p}.self_attn.o_proj.weight": (h, groups * q_per_group * head_dim),
            f"{p}.self_attn.q_norm.weight": (head_dim,),
            f"{p}.self_attn.k_norm.weight": (head_dim,),
            f"{p}.mlp.gate.weight": (model.num_experts, h),
        })
        for e in range(model.num_experts):
            shapes.update({
                f"{p}.mlp.experts.{e}.gate_proj.weight": (f, h),
                f"{p}.mlp.experts.{e}.up_proj.weight": (f, h),
                f"{p}.mlp.experts.{e}.down_proj.weight": (h, f),
            })
    return shapes


def hf_from_megatron(
    key: str, index: tuple[int, ...], tensor: torch.Tensor, model: PolicyModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of global tensor ``key`` at stacking ``index`` (``tensor`` is that slice)."""
    if key in _TOP:
        return [(_TOP[key], tensor)]
    prefix = f"model.layers.{index[0]}"
    if key in _LAYER:
        return [(f"{prefix}.{_LAYER[key]}", tensor)]
    if key == QKV:
        groups, q_per_group, head_dim = _head_layout(model)
        q, k, v = split_qkv(tensor, groups, q_per_group, head_dim)
        return [(f"{prefix}.self_attn.q_proj.weight", q), (f"{prefix}.self_attn.k_proj.weight", k),
                (f"{prefix}.self_attn.v_proj.weight", v)]
    expert = f"{prefix}.mlp.experts.{index[1]}"
    if key == EXPERT_FC1:
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{expert}.gate_proj.weight", gate.contiguous()), (f"{expert}.up_proj.weight", up.contiguous())]
    if key == EXPERT_FC2:
        return [(f"{expert}.down_proj.weight", tensor)]
    raise KeyError(f"no Hugging Face name for Megatron tensor {key!r}: the converters map Qwen3-MoE models only")


def megatron_from_hf(key: str, index: tuple[int, ...], get: GetTensor, model: PolicyModelConfig) -> torch.Tensor:
    """Global tensor ``key`` at stacking ``index``, built from HF tensors read with ``get``."""
    if key in _TOP:
        if key == "output_layer.weight" and not model.untie_embeddings:
            return get("model.embed_tokens.weight")
        return get(_TOP[key])
    prefix = f"model.layers.{index[0]}"
    if key in _LAYER:
        return get(f"{prefix}.{_LAYER[key]}")
    if key == QKV:
        groups, _, head_dim = _head_layout(model)
        attn = f"{prefix}.self_attn"
        return merge_qkv(get(f"{attn}.q_proj.weight"), get(f"{attn}.k_proj.weight"), get(f"{attn}.v_proj.weight"),
                         groups, head_dim)
    expert = f"{prefix}.mlp.experts.{index[1]}"
    if key == EXPERT_FC1:
        return torch.cat([get(f"{expert}.gate_proj.weight"), get(f"{expert}.up_proj.weight")])
    if key == EXPERT_FC2:
        return get(f"{expert}.down_proj.weight")
    raise KeyError(f"Megatron tensor {key!r} has no Hugging Face counterpart: the converters map Qwen3-MoE models only")
