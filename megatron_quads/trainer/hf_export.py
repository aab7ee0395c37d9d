"""Export a Megatron GPT-MoE's weights as full tensors under Hugging Face (Qwen3-MoE) names.

Every rank of the model-parallel group runs :func:`export_hf_weights` in step (it all-gathers tensor-
and expert-parallel shards) and receives every full tensor; the caller decides which rank sends them
on. Tensors come one at a time, so peak extra memory is one full tensor times the gather width.
Pipeline parallelism is not supported yet.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron local-spec name (inside decoder.layers.N.) -> HF name (inside model.layers.N.)
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLU_FC1 = {
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert",
    "mlp.linear_fc1.weight": "mlp",
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.weight([12])$")


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All shards of ``tensor`` over ``group`` in rank order (just ``[tensor]`` without a group)."""
    if group is None or dist.get_world_size(group) == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _tp_full(param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    return torch.cat(_gather(param.detach(), group), dim=param.partition_dim)


def _split_glu(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column-parallel fc1 shard holds [gate_shard; up_shard]: regroup into full gate and up."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def split_qkv(qkv: torch.Tensor, groups: int, q_per_group: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV ``[groups * (q_per_group + 2) * head_dim, hidden]`` (interleaved per query
    group) -> HF q, k, v."""
    per_group = qkv.reshape(groups, (q_per_group + 2) * head_dim, qkv.shape[-1])
    q, k, v = per_group.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, qkv.shape[-1]).contiguous() for t in (q, k, v))


def _split_qkv(qkv: torch.Tensor, config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = config.num_query_groups or config.num_attention_heads
    return split_qkv(qkv, groups, config.num_attention_heads // groups, config.kv_channels)


def _expert_tensors(
    prefix: str, expert: int, fc: str, weight: torch.Tensor, etp_group: dist.ProcessGroup | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of one expert's fc1 ``[2*ffn/etp, hidden]`` or fc2 ``[hidden, ffn/etp]`` shard."""
    shards = _gather(weight.detach(), etp_group)
    base = f"{prefix}.mlp.experts.{expert}"
    if fc == "1":
        gate, up = _split_glu(shards)
        yield f"{base}.gate_proj.weight", gate
        yield f"{base}.up_proj.weight", up
    else:
        yield f"{base}.down_proj.weight", torch.cat(shards, dim=1)


def _local_expert_shards(name: str, param: torch.Tensor, config: TransformerConfig, num_local: int):
    """(local expert index, fc, per-expert weight in linear layout) of a SequentialMLP or GroupedMLP param."""
    match = _LOCAL_EXPERT.match(name)
    if match:
        yield int(match.group(1)), match.group(2), param
        return
    fc = _GROUPED_EXPERT.match(name).group(1)
    hidden = config.hidden_size
    # GroupedMLP: weight1 viewed [E, hidden, 2*ffn/etp], weight2 viewed [E, ffn/etp, hidden]
    view = param.detach().view(num_local, hidden, -1) if fc == "1" else param.detach().view(num_local, -1, hidden)
    for i in range(num_local):
        yield i, fc, view[i].t()


def export_hf_weights(model: torch.nn.Module | list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight of the model, gathered over TP and EP."""
    gpt = unwrap_model(model[0] if isinstance(model, list) else model)
    config: TransformerConfig = gpt.config
    if config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("export_hf_weights does not support pipeline parallelism yet")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size, num_experts = dist.get_world_size(ep_group), config.num_moe_experts or 0
    num_local = num_experts // ep_size if num_experts else 0

    for name, param in gpt.named_parameters():
        if name in _TOP_NAMES:
            if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
                continue
            yield _TOP_NAMES[name], _tp_full(param, tp_group)
            continue
        match = _LAYER.match(name)
        if not match:
            raise KeyError(f"export_hf_weights: no Hugging Face name for Megatron parameter {name!r}")
        prefix, local = f"model.layers.{match.group(1)}", match.group(2)
        if _LOCAL_EXPERT.match(local) or _GROUPED_EXPERT.match(local):
            for i, fc, weight in _local_expert_shards(local, param, config, num_local):
                # every EP rank holds experts [ep_rank * num_local, ...): gather them over EP
                for ep_rank, shard in enumerate(_gather(weight.contiguous(), ep_group)):
                    yield from _expert_tensors(prefix, ep_rank * num_local + i, fc, shard, etp_group)
        elif local == "self_attention.linear_qkv.weight":
            q, k, v = _split_qkv(_tp_full(param, tp_group), config)
            yield f"{prefix}.self_attn.q_proj.weight", q
            yield f"{prefix}.self_attn.k_proj.weight", k
            yield f"{prefix}.self_attn.v_proj.weight", v
        elif local in _GLU_FC1:
            gate, up = _split_glu(_gather(param.detach(), tp_group))
            yield f"{prefix}.{_GLU_FC1[local]}.gate_proj.weight", gate
            yield f"{prefix}.{_GLU_FC1[local]}.up_proj.weight", up
        elif local in _LAYER_NAMES:
            yield f"{prefix}.{_LAYER_NAMES[local]}", _tp_full(param, tp_group)
        else:
            raise KeyError(f"export_hf_weights: no Hugging Face name for Megatron parameter {name!r}")


def qwen3_moe_config(model_cfg) -> object:
    """The transformers ``Qwen3MoeConfig`` of a :class:`PolicyModelConfig` (what rollout engines build)."""
    from transformers import Qwen3MoeConfig

    from megatron_quads.trainer.hf_config import hf_config_from_policy

    return Qwen3MoeConfig(**hf_config_from_policy(model_cfg))
