"""RAC channel sets (and static activation amaxes) for a model's NVFP4 weights, chosen on calibration prompts.

The rule is the built-in engine's (:meth:`TorchRolloutEngine.calibrate`): a float32 engine in the
quads precision holds the quantized routed experts and computes them W4A16 (``x q(W)^T``, the AQAT
trainer's forward) while their inputs are recorded; channels are then scored with the quantized
weights. Attention projections in scope are held by that engine as dense float32 linears with their
dequantized NVFP4 weights, the same W4A16 product, and recorded by a :class:`RacCalibrator` during
the same forward. q, k and v read the same hidden states and engines fuse them into one GEMM with
one channel set, so they are scored together: pooled statistics and the concatenated weight (what
the fused ``qkv_proj`` holds); an expert's gate and up are scored together by the engine.

The static amax of a linear is the largest ``|x|`` over the calibration tokens it saw; modules that
read the same input (q/k/v, an expert's gate/up) share it. An expert no token was routed to takes
the channels of its layer's pooled statistics (the engine's rule) and the largest amax of its
layer's experts of the same projection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_quads.precision import Precision
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.calibration import ChannelStats, RacCalibrator, pool_stats
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quantized_linear import QuantizedLinearWeight
from megatron_quads.rollout.rac import ChannelStatistic, select_channels
from megatron_quads.rollout.scopes import is_attention_linear, routed_expert_scope, shared_scale_group


@dataclass(frozen=True)
class WeightCalibration:
    """What calibration chose, by checkpoint module name.

    Attributes:
        channels: sorted int32 RAC channel set of every quantized module.
        input_amax: fp32 0-dim largest ``|x|`` of every quantized module's input.
        tokens: prompt tokens the calibration forward ran.
    """

    channels: dict[str, torch.Tensor]
    input_amax: dict[str, torch.Tensor]
    tokens: int

    def apply(self, weights: QuantizedModelWeights, static_input_scales: bool = False,
              weight_version: int | None = None) -> QuantizedModelWeights:
        """``weights`` with these channel sets (``W_S`` rebuilt from ``q(W)``) and, with
        ``static_input_scales``, ``input_scale = amax / 2688`` on every quantized module."""
        out = weights.with_residual_channels(self.channels, weight_version=weight_version)
        return out.with_input_amax(self.input_amax) if static_input_scales else out


def calibrate_weights(weights: QuantizedModelWeights, hf_config, prompts: Sequence[Sequence[int]],
                      statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> WeightCalibration:
    """Channels at ``weights.config["residual_ratio"]`` and input amaxes of every quantized module of
    ``weights`` (routed experts, optionally attention q/k/v/o), chosen on ``prompts`` (token ids) by
    the rule in the module docstring. ``hf_config`` is the model's transformers ``Qwen3MoeConfig``."""
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine, checkpoint_modules

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("calibration needs at least one prompt and no empty prompt")
    experts, attention = _split_scope(weights)
    ratio = weights.config["residual_ratio"]
    engine = TorchRolloutEngine(hf_config, precision=Precision("quads", ratio), dtype=torch.float32)
    engine.load_weights(_engine_weights(weights, experts, attention), version=weights.config["weight_version"])
    recorder = RacCalibrator({m: engine.model.get_submodule(m) for m in attention},
                             {m: lin.in_features for m, lin in attention.items()})
    try:
        expert_stats = engine.calibrate(prompts, statistic)
    finally:
        recorder.detach()
    channels = engine.residual_channels()
    amax = {module: value for name, value in _expert_amax(expert_stats).items() for module in checkpoint_modules(name)}
    for members in _attention_groups(attention):
        stats = pool_stats([recorder.stats[m] for m in members])
        if stats.tokens == 0:
            raise RuntimeError(f"calibration recorded no input of {members[0]}; report this as a bug")
        weight = torch.cat([attention[m].dequantized_weight(torch.float32) for m in members])
        chosen = select_channels(stats.scores(statistic, weight), ratio)
        for module in members:
            channels[module] = chosen
            amax[module] = torch.tensor(stats.amax, dtype=torch.float32)
    return WeightCalibration(channels=channels, input_amax=amax, tokens=sum(len(p) for p in prompts))


def _split_scope(weights: QuantizedModelWeights) -> tuple[dict[str, QuantizedLinearWeight], dict[str, QuantizedLinearWeight]]:
    """The quantized routed experts and attention projections; anything else cannot be calibrated here."""
    is_expert = routed_expert_scope()
    experts = {m: lin for m, lin in weights.quantized.items() if is_expert(m)}
    attention = {m: lin for m, lin in weights.quantized.items() if is_attention_linear(m)}
    other = [m for m in weights.quantized if m not in experts and m not in attention]
    if other:
        raise ValueError(f"'{other[0]}' is quantized; calibration covers routed experts and attention q/k/v/o only")
    dense_experts = [n for n in weights.unquantized if is_expert(fmt.split_tensor_name(n)[0])]
    if dense_experts or not experts:
        example = dense_experts[0] if dense_experts else "every routed expert"
        raise ValueError(f"the built-in engine holds every routed expert in NVFP4, but {example} is not quantized: "
                         "calibrate weights whose scope covers all routed experts")
    return experts, attention


def _engine_weights(weights: QuantizedModelWeights, experts: Mapping[str, QuantizedLinearWeight],
                    attention: Mapping[str, QuantizedLinearWeight]) -> QuantizedModelWeights:
    """What the engine loads: the NVFP4 experts, and attention as dense dequantized ``q(W)``."""
    dense = dict(weights.unquantized)
    dense.update({fmt.tensor_name(m, fmt.WEIGHT): lin.dequantized_weight(torch.float32) for m, lin in attention.items()})
    return QuantizedModelWeights(quantized=dict(experts), unquantized=dense, config=dict(weights.config))


def _attention_groups(attention: Mapping[str, QuantizedLinearWeight]) -> list[list[str]]:
    """Modules scored together: one layer's q/k/v (one input, one fused GEMM), o_proj alone."""
    groups: dict[str, list[str]] = {}
    for module in attention:
        group = shared_scale_group(module)
        groups.setdefault(module if group is None else group[0], []).append(module)
    return list(groups.values())


def _expert_amax(stats: Mapping[str, ChannelStats]) -> dict[str, torch.Tensor]:
    """Input amax per engine expert linear; an expert that saw no token takes its layer's largest
    amax of the same projection."""
    layer_max: dict[str, float] = {}
    for name, s in stats.items():
        pool = name.rpartition(".")[0]  # model.layers.N.mlp.experts.gate_up / .down
        if s.tokens:
            layer_max[pool] = max(layer_max.get(pool, 0.0), s.amax)
    out = {}
    for name, s in stats.items():
        pool = name.rpartition(".")[0]
        if pool not in layer_max:
            raise ValueError(f"calibration routed no token to any expert of {pool}: calibrate on more prompts")
        out[name] = torch.tensor(s.amax if s.tokens else layer_max[pool], dtype=torch.float32)
    return out
