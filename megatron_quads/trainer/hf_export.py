"""Export a Megatron GPT-MoE's weights as full tensors under Hugging Face (Qwen3-MoE) names.

Every rank of the model-parallel group runs an export in step (they all-gather shards).
:func:`export_hf_weights` gives every rank every full tensor, routed experts one by one (gathered
over expert parallelism too); :func:`export_rollout_parts` gives each rank the experts its
expert-parallel rank holds, one stack per layer, for the weight sync (each EP rank sends its own).
Tensors come one at a time (or one layer's stack), so peak extra memory is one of them times the
gather width. Pipeline parallelism is not supported yet.
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

# Megatron name (inside decoder.layers.N.) -> HF name (inside model.layers.N.); local and TE specs
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE: norm fused into QKV
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
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")  # TEGroupedMLP: one per expert


def _is_expert_param(local_name: str) -> bool:
    return any(p.match(local_name) for p in (_LOCAL_EXPERT, _GROUPED_EXPERT, _TE_GROUPED_EXPERT))


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
    """(local expert index, fc, per-expert weight in linear layout) of a SequentialMLP, GroupedMLP or
    TEGroupedMLP param."""
    match = _LOCAL_EXPERT.match(name)
    if match:
        yield int(match.group(1)), match.group(2), param
        return
    match = _TE_GROUPED_EXPERT.match(name)
    if match:  # TE's grouped linear holds expert i as weight{i}, [out, in] like a linear
        yield int(match.group(2)), match.group(1), param
        return
    fc = _GROUPED_EXPERT.match(name).group(1)
    hidden = config.hidden_size
    # GroupedMLP: weight1 viewed [E, hidden, 2*ffn/etp], weight2 viewed [E, ffn/etp, hidden]
    view = param.detach().view(num_local, hidden, -1) if fc == "1" else param.detach().view(num_local, -1, hidden)
    for i in range(num_local):
        yield i, fc, view[i].t()


def _export_setup(model: torch.nn.Module | list[torch.nn.Module], caller: str):
    """(GPT model, its config, expert-TP group, EP group, experts per EP rank) of an export."""
    gpt = unwrap_model(model[0] if isinstance(model, list) else model)
    config: TransformerConfig = gpt.config
    if config.pipeline_model_parallel_size > 1:
        raise NotImplementedError(f"{caller} does not support pipeline parallelism yet")
    ep_group = parallel_state.get_expert_model_parallel_group()
    num_local = (config.num_moe_experts or 0) // dist.get_world_size(ep_group)
    return gpt, config, parallel_state.get_expert_tensor_parallel_group(), ep_group, num_local


def export_hf_weights(model: torch.nn.Module | list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight of the model, gathered over TP and EP."""
    gpt, config, etp_group, ep_group, num_local = _export_setup(model, "export_hf_weights")

    for name, param in gpt.named_parameters():
        match = _LAYER.match(name)
        local = match.group(2) if match else ""
        if _is_expert_param(local):
            prefix = f"model.layers.{match.group(1)}"
            for i, fc, weight in _local_expert_shards(local, param, config, num_local):
                # every EP rank holds experts [ep_rank * num_local, ...): gather them over EP
                for ep_rank, shard in enumerate(_gather(weight.contiguous(), ep_group)):
                    yield from _expert_tensors(prefix, ep_rank * num_local + i, fc, shard, etp_group)
        else:
            yield from _hf_tensors(gpt, [(name, param)])


def _hf_tensors(gpt: torch.nn.Module, params) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, full tensor)`` of non-expert Megatron ``(name, param)`` pairs, gathered over TP."""
    config: TransformerConfig = gpt.config
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, param in params:
        if name in _TOP_NAMES:
            if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
                continue
            yield _TOP_NAMES[name], _tp_full(param, tp_group)
            continue
        match = _LAYER.match(name)
        if not match:
            raise KeyError(f"export_hf_weights: no Hugging Face name for Megatron parameter {name!r}")
        prefix, local = f"model.layers.{match.group(1)}", match.group(2)
        if local == "self_attention.linear_qkv.weight":
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


def _stack_over_etp(gate_up: torch.Tensor, down: torch.Tensor, etp_group: dist.ProcessGroup | None):
    """Full ``gate_up [n, 2I, H]`` and ``down [n, H, I]`` from this rank's expert-TP shards (one gather each)."""
    up_shards = _gather(gate_up.contiguous(), etp_group)
    if len(up_shards) > 1:  # each shard holds [gate_shard; up_shard] along the rows
        halves = [shard.chunk(2, dim=1) for shard in up_shards]
        gate_up = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
    down_shards = _gather(down.contiguous(), etp_group)
    return gate_up, torch.cat(down_shards, dim=2) if len(down_shards) > 1 else down


def expert_stack_name(layer: int, first: int, count: int, projection: str) -> str:
    """The name of experts ``[first, first + count)`` of a layer's ``gate_up_proj`` or ``down_proj``
    as one stacked tensor (the weight sync's wire names: docs/format.md)."""
    return f"model.layers.{layer}.mlp.experts.{first}-{first + count - 1}.{projection}.weight"


def export_rollout_parts(model: torch.nn.Module | list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight for the rollout engines as ``(name, full tensor)``: each tensor that is not a
    routed expert under its HF name (gathered over TP), and each MoE layer's experts held by this
    expert-parallel rank as two stacks, ``gate_up [n, 2I, H]`` (every expert's gate rows, then its up
    rows) and ``down [n, H, I]``, named by :func:`expert_stack_name` (gathered over expert TP, not
    over EP). Collective: every rank of the model-parallel world iterates it in step."""
    gpt, config, etp_group, ep_group, num_local = _export_setup(model, "export_rollout_parts")
    first_expert = dist.get_rank(ep_group) * num_local
    pending: dict[int, dict[str, dict[int, torch.Tensor]]] = {}

    dense = {}
    for name, param in gpt.named_parameters():
        match = _LAYER.match(name)
        local = match.group(2) if match else ""
        if not _is_expert_param(local):
            dense[name] = param
            continue
        layer = int(match.group(1))
        experts = pending.setdefault(layer, {"1": {}, "2": {}})
        for i, fc, weight in _local_expert_shards(local, param, config, num_local):
            experts[fc][i] = weight
        if all(len(experts[fc]) == num_local for fc in ("1", "2")):
            del pending[layer]
            yield from _hf_tensors(gpt, dense.items())
            dense = {}
            gate_up = torch.stack([experts["1"][i] for i in range(num_local)])
            down = torch.stack([experts["2"][i] for i in range(num_local)])
            gate_up, down = _stack_over_etp(gate_up, down, etp_group)
            yield expert_stack_name(layer, first_expert, num_local, "gate_up_proj"), gate_up
            yield expert_stack_name(layer, first_expert, num_local, "down_proj"), down
    if pending:
        raise KeyError(f"export_rollout_parts: layers {sorted(pending)} are missing expert weights")
    yield from _hf_tensors(gpt, dense.items())


def weight_sender() -> tuple[int, int] | None:
    """(this rank's sender index, number of senders) when this rank sends rollout weights, else None.

    One sender per expert-parallel rank: the rank with expert-tensor-parallel rank 0 and expert-data-
    parallel rank 0 of that EP rank's group (index = EP rank); sender 0 is global rank 0."""
    if parallel_state.get_expert_tensor_parallel_rank() or parallel_state.get_expert_data_parallel_rank():
        return None
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def qwen3_moe_config(model_cfg) -> object:
    """The transformers ``Qwen3MoeConfig`` of a :class:`PolicyModelConfig` (what rollout engines build)."""
    from transformers import Qwen3MoeConfig

    from megatron_quads.trainer.hf_config import hf_config_from_policy

    return Qwen3MoeConfig(**hf_config_from_policy(model_cfg))
