"""Which modules of a Hugging Face MoE checkpoint are quantized, which share a global scale, and how
vLLM's ModelOpt ``exclude_modules`` rule sees them (Qwen3-MoE module names)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatch
from typing import Any

import torch

from megatron_quads.rollout import checkpoint_format as fmt

_EXPERT_MODULE = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")
_ROUTED_EXPERT_LINEAR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")
_ATTENTION_LINEAR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$")


def shared_scale_group(module: str) -> tuple[str, tuple[str, ...]] | None:
    """``(group key, member leaves)`` for a linear engines fuse with siblings (gate/up, w1/w3, q/k/v)."""
    parent, _, leaf = module.rpartition(".")
    for members in fmt.SHARED_GLOBAL_SCALE_GROUPS:
        if leaf in members:
            return f"{parent}.{{{','.join(members)}}}", members
    return None


def routed_expert_scope(bf16_layers: Iterable[int] = ()) -> Callable[[str], bool]:
    """``is_quantized`` for QUADS' default scope: routed-expert linears (Qwen3-MoE names), minus ``bf16_layers``."""
    skip = frozenset(bf16_layers)

    def is_quantized(module: str) -> bool:
        match = _ROUTED_EXPERT_LINEAR.match(module)
        return match is not None and int(match.group(1)) not in skip

    return is_quantized


def is_attention_linear(module: str) -> bool:
    """Whether ``module`` is an attention projection ``model.layers.N.self_attn.{q,k,v,o}_proj`` (Qwen3-MoE names)."""
    return _ATTENTION_LINEAR.match(module) is not None


def experts_and_attention_scope(bf16_layers: Iterable[int] = ()) -> Callable[[str], bool]:
    """``is_quantized`` for routed-expert linears plus attention q/k/v/o projections, minus ``bf16_layers``."""
    skip = frozenset(bf16_layers)
    experts = routed_expert_scope(skip)

    def is_quantized(module: str) -> bool:
        match = _ATTENTION_LINEAR.match(module)
        return experts(module) or (match is not None and int(match.group(1)) not in skip)

    return is_quantized


_FUSED_LINEAR = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "q_proj": "qkv_proj", "k_proj": "qkv_proj"}
_FUSED_LINEAR["v_proj"] = "qkv_proj"


def vllm_prefixes(module: str) -> list[str]:
    """The layer names vLLM asks its exclusion rule about for a checkpoint module."""
    expert = _EXPERT_MODULE.match(module)
    if expert:
        return [expert.group("experts")]  # one FusedMoE layer holds all experts
    parent, _, leaf = module.rpartition(".")
    return [module, f"{parent}.{_FUSED_LINEAR[leaf]}"] if leaf in _FUSED_LINEAR else [module]


def vllm_excludes(module: str, entry: str) -> bool:
    """Whether vLLM's ModelOpt exclusion rule (exact, substring, wildcard) skips ``module`` for ``entry``."""
    return entry == module or entry in module or fnmatch(module, entry)


def excluded_modules(quantized: Iterable[str], unquantized: Mapping[str, torch.Tensor]) -> list[str]:
    """ModelOpt ``exclude_modules``: modules with a 2-D unquantized ``.weight``; expert lists become ``...experts``."""
    skip: set[str] = set()
    for name, t in unquantized.items():
        module, leaf = fmt.split_tensor_name(name)
        if leaf != fmt.WEIGHT or not module or t.ndim < 2:
            continue
        expert = _EXPERT_MODULE.match(module)
        skip.add(expert.group("experts") if expert else module)
    quantized_set = set(quantized)
    return sorted(m for m in skip if m not in quantized_set)


def check_scope_consistency(quantized: Mapping[str, Any], unquantized: Mapping[str, torch.Tensor]) -> None:
    """Fused siblings and one MoE layer's experts must be all quantized or all not (engines fuse them)."""
    groups = {g[0]: m for m in quantized if (g := shared_scale_group(m)) is not None}
    expert_parents = {e.group("experts"): m for m in quantized if (e := _EXPERT_MODULE.match(m))}
    for name in unquantized:
        module, leaf = fmt.split_tensor_name(name)
        if leaf != fmt.WEIGHT or not module:
            continue
        group = shared_scale_group(module)
        if group is not None and group[0] in groups:
            raise ValueError(
                f"'{groups[group[0]]}' is quantized but its fused sibling '{module}' is not; engines fuse "
                f"{'/'.join(group[1])} into one linear with one scheme: make is_quantized agree for both"
            )
        expert = _EXPERT_MODULE.match(module)
        if expert and expert.group("experts") in expert_parents:
            raise ValueError(
                f"'{expert_parents[expert.group('experts')]}' is quantized but '{module}' of the same MoE layer is "
                "not; engines run a layer's experts as one fused MoE with one scheme: make is_quantized agree"
            )
