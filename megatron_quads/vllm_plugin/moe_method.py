"""Routed experts in vLLM as NVFP4 (+RAC) grouped GEMMs computed by the project's functions.

vLLM's split: :meth:`QuadsFusedMoEMethod.create_weights` makes parameters shaped as the checkpoint
stores them, stacked over experts (ModelOpt's names, plus the residual fields), each with a loader
that copies one checkpoint tensor into its expert's slice; :meth:`~QuadsFusedMoEMethod.process_weights_after_loading`
checks what was loaded and prepares the kernels' forms of the weights once (CUDA);
:meth:`~QuadsFusedMoEMethod.apply` computes through
:class:`~megatron_quads.rollout.grouped_experts.GroupedExperts` (the reference on CPU, the Triton
kernels on CUDA sm_90; on sm_100 W4A4 and quads run through vLLM's FP4 GEMM over the augmented K,
:mod:`.fp4_gemm`), so vLLM and the built-in engine run the same arithmetic.

Parameters of a layer with E local experts, hidden size H, expert intermediate size I and C13 / C2
residual channels (``ServingConfig.residual_channels`` of H and I; none unless quads):

| parameter | dtype | shape |
|---|---|---|
| ``w13_weight`` / ``w2_weight`` | uint8 | ``[E, 2I, H/2]`` / ``[E, H, I/2]`` |
| ``w13_weight_scale`` / ``w2_weight_scale`` | float8_e4m3fn | ``[E, 2I, H/16]`` / ``[E, H, I/16]`` |
| ``w13_weight_scale_2`` / ``w2_weight_scale_2`` | float32 | ``[E, 2]`` (gate, up) / ``[E]`` |
| ``w13_input_scale`` / ``w2_input_scale`` | float32 | ``[E, 2]`` / ``[E]`` (only if the checkpoint has them) |
| ``w13_residual_channels`` / ``w2_residual_channels`` | int32 | ``[E, 2, C13]`` / ``[E, C2]`` |
| ``w13_residual_weight`` / ``w2_residual_weight`` | uint8 | ``[E, 2I, C13/2]`` / ``[E, H, C2/2]`` |
| ``w13_residual_weight_scale`` / ``w2_residual_weight_scale`` | float8_e4m3fn | ``[E, 2I, C13/16]`` / ``[E, H, C2/16]`` |

Gate and up each write their own slot of the ``[E, 2]`` / ``[E, 2, C13]`` parameters, so vLLM's
layer-wise reload counts every loaded element once; processing then requires the two to agree.
A checkpoint module with no residual channels (saved before calibration) loads as a zero tail:
``W_S = 0`` on placeholder channels, the plain W4A4 product, until calibration writes real ones.
Static input scales are stored and not used: activations are quantized with per-token scales.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.utils import set_weight_attrs

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from megatron_quads.nvfp4.backend import use_kernels
from megatron_quads.nvfp4.reblock import check_channel_rows, reblock_columns_deferred
from megatron_quads.nvfp4.stacked import expert_weight
from megatron_quads.rollout.calibration import StackChannelStats, select_stack_channels
from megatron_quads.rollout.grouped import combine_routed_rows, grouped_w4a16_linear, route_by_expert
from megatron_quads.rollout.grouped_experts import GroupedExperts, GroupedProjection
from megatron_quads.rollout.rac import ChannelStatistic
from megatron_quads.vllm_plugin.fp4_gemm import AugmentedWeight, fp4_gemm_supported, fp4_linear
from megatron_quads.vllm_plugin.serving import ServingConfig

_SHARD = {"w1": 0, "w3": 1}
"""Gate (w1) and up (w3): their half of w13 and their slot of the per-shard parameters."""


def _parameter(layer: torch.nn.Module, name: str, data: torch.Tensor, attrs: dict, loader: Callable) -> None:
    param = torch.nn.Parameter(data, requires_grad=False)
    layer.register_parameter(name, param)
    set_weight_attrs(param, attrs)
    param.weight_loader = loader


class QuadsFusedMoEMethod(FusedMoEMethodBase):
    """NVFP4 (+RAC) routed experts under ``serving.precision`` (see the module docstring)."""

    def __init__(self, serving: ServingConfig, moe) -> None:
        super().__init__(moe)
        self.serving = serving
        self.precision = serving.precision

    # ------------------------------------------------------------------ weights
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """Parameters as the checkpoint stores them, stacked over the local experts."""
        if layer.moe_config.tp_size > 1:
            raise NotImplementedError("the QUADS MoE method shards experts by expert parallelism only; "
                                      "serve with tensor_parallel_size=1 or enable_expert_parallel=True")
        if not layer.moe_config.is_act_and_mul or layer.moe_config.activation != MoEActivation.SILU:
            raise NotImplementedError(f"the QUADS MoE method computes SiLU-gated experts, not {layer.moe_config.activation}")
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        for name, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % BLOCK_SIZE:
                raise ValueError(f"NVFP4 experts need {name} to be a multiple of {BLOCK_SIZE}, got {k}")
        layer.quads_dtype = params_dtype
        layer.quads_sizes = {"w13": (2 * I, H), "w2": (H, I)}
        layer.quads_loaded = set()
        layer.quads_calibration = None
        layer.quads_kernel_forms = layer.quads_fp4_experts = None
        attrs = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
        c13, c2 = self.serving.residual_channels(H), self.serving.residual_channels(I)
        shapes = {
            "w13_weight": ((E, 2 * I, H // 2), torch.uint8), "w2_weight": ((E, H, I // 2), torch.uint8),
            "w13_weight_scale": ((E, 2 * I, H // BLOCK_SIZE), torch.float8_e4m3fn),
            "w2_weight_scale": ((E, H, I // BLOCK_SIZE), torch.float8_e4m3fn),
            "w13_weight_scale_2": ((E, 2), torch.float32), "w2_weight_scale_2": ((E,), torch.float32),
        }
        if self.serving.input_scales:
            shapes |= {"w13_input_scale": ((E, 2), torch.float32), "w2_input_scale": ((E,), torch.float32)}
        if self.precision.uses_rac:
            shapes |= {
                "w13_residual_channels": ((E, 2, c13), torch.int32), "w2_residual_channels": ((E, c2), torch.int32),
                "w13_residual_weight": ((E, 2 * I, c13 // 2), torch.uint8), "w2_residual_weight": ((E, H, c2 // 2), torch.uint8),
                "w13_residual_weight_scale": ((E, 2 * I, c13 // BLOCK_SIZE), torch.float8_e4m3fn),
                "w2_residual_weight_scale": ((E, H, c2 // BLOCK_SIZE), torch.float8_e4m3fn),
            }
        elif self.serving.residual_tensors:  # the checkpoint's residual tensors are read and dropped
            shapes |= {f"{p}_residual_{leaf}": ((0,), dtype) for p in ("w13", "w2") for leaf, dtype in
                       (("channels", torch.int32), ("weight", torch.uint8), ("weight_scale", torch.float8_e4m3fn))}
        for name, (shape, dtype) in shapes.items():
            _parameter(layer, name, torch.zeros(shape, dtype=dtype), attrs, self._loader(layer, name))
        if self.precision.uses_rac:
            _placeholder_channels(layer)

    def _loader(self, layer: torch.nn.Module, name: str) -> Callable:
        """The weight loader of parameter ``name``: one checkpoint tensor into its expert's slice."""
        projection, _, leaf = name.partition("_")
        sink = name.startswith(("w13_residual", "w2_residual")) and not self.precision.uses_rac

        def weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                          shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local < 0:  # another rank's expert
                return False if return_success else None
            if not sink:
                _load_expert_tensor(layer, projection, leaf, param, loaded_weight, shard_id, local,
                                    _checkpoint_name(layer, expert_id, shard_id, leaf))
                if param.numel():  # a tail of no channels is not waited for (_required)
                    layer.quads_loaded.add((name, shard_id, local))
            return True if return_success else None

        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check what the checkpoint filled (every tensor of every local expert, gate and up sharing
        one decode scale and one channel set, valid channels) and prepare the RAC tails for the device. A layer nothing was
        loaded into (vLLM's dummy load format) is set to zero weights."""
        loaded, layer.quads_loaded = layer.quads_loaded, set()
        if loaded:
            _check_loaded(layer, loaded, self.precision.uses_rac)
        elif not getattr(layer, "quads_prepared", False):
            _zero_weights(layer, self.precision.uses_rac)
        scale_2 = layer.w13_weight_scale_2
        if loaded and not torch.equal(scale_2[:, 0], scale_2[:, 1]):
            bad = torch.nonzero(scale_2[:, 0] != scale_2[:, 1]).flatten().tolist()
            raise ValueError(f"{layer.layer_name}: experts {bad[:8]} have gate_proj and up_proj weight_scale_2 that differ; "
                             "vLLM fuses them into one w13 GEMM with one scale (quantize gate and up with one amax)")
        self.prepare(layer)
        layer.quads_prepared = True

    def prepare(self, layer: torch.nn.Module) -> None:
        """The kernels' forms of the parameters, built once on CUDA: each projection a prepared
        :class:`GroupedProjection` (contiguous decode scales, the RAC tail as the grouped GEMM takes
        it); elsewhere none (:meth:`apply` views the parameters). Run again after vLLM's layer-wise
        reload, which processes a temporary copy of the layer, and after calibration: forms already
        held keep their storage (new values are copied into them), so CUDA graphs captured over them
        replay the new weights."""
        held, layer.quads_kernel_forms, layer.quads_fp4_experts = getattr(layer, "quads_kernel_forms", None), None, None
        if self.precision.quantized_activations and fp4_gemm_supported(layer.w13_weight.device):
            layer.quads_fp4_experts = {projection: self._fp4_weights(layer, projection) for projection in ("w13", "w2")}
            return
        if not use_kernels(layer.w13_weight):
            return
        forms = {}
        for projection in ("w13", "w2"):
            weight = self._stack(layer, projection)
            weight = replace(weight, weight_scale_2=weight.weight_scale_2.contiguous())
            channels = residual = None
            if self.precision.uses_rac and _channels(layer, projection).shape[1]:
                channels = _channels(layer, projection).contiguous()
                residual = replace(self._stack(layer, projection, residual=True), weight_scale_2=weight.weight_scale_2)
            forms[projection] = GroupedProjection(self.precision, weight, channels, residual)
            forms[projection].prepare()
        layer.quads_kernel_forms = _into_held_storage(held, forms)

    def _fp4_weights(self, layer: torch.nn.Module, projection: str) -> list[AugmentedWeight]:
        """Each expert's ``[q(W), W_S]`` as vLLM's FP4 GEMM takes it (sm_100)."""
        weight = self._stack(layer, projection)
        quads = self.precision.uses_rac and _channels(layer, projection).shape[1]
        residual = self._stack(layer, projection, residual=True) if quads else None
        channels = _channels(layer, projection) if quads else None
        return [AugmentedWeight.prepare(expert_weight(weight, e), None if channels is None else channels[e].contiguous(),
                                        None if residual is None else expert_weight(residual, e))
                for e in range(weight.shape[0])]

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        """None: the method computes itself (vLLM's modular kernels are not used)."""
        return None

    def maybe_make_prepare_finalize(self, routing_tables=None):
        """None: no all-to-all prepare / finalize kernels (vLLM 0.26 asks for them under data and expert
        parallelism and fails on a method that has none; 0.32 no longer asks)."""
        return None

    # ------------------------------------------------------------------ compute
    def _stack(self, layer: torch.nn.Module, projection: str, residual: bool = False) -> NVFP4Tensor:
        """The stacked NVFP4 weight (or residual weight ``W_S``) of a projection, viewing the
        parameters (w13's decode scale: gate's slot, which processing requires equal to up's)."""
        n, k = layer.quads_sizes[projection]
        prefix = f"{projection}_residual_weight" if residual else f"{projection}_weight"
        codes, scales = getattr(layer, prefix), getattr(layer, f"{prefix}_scale")
        scale_2 = getattr(layer, f"{projection}_weight_scale_2")
        scale_2 = scale_2[:, 0] if projection == "w13" else scale_2
        columns = codes.shape[-1] * 2
        return NVFP4Tensor(codes=codes, scales=scales, weight_scale_2=scale_2,
                           shape=torch.Size((codes.shape[0], n, columns if residual else k)), dtype=layer.quads_dtype)

    def _projection(self, layer: torch.nn.Module, projection: str) -> GroupedProjection:
        """The projection as the grouped GEMM computes it: the kernel forms where prepared, else
        views of the parameters."""
        if layer.quads_kernel_forms is not None:
            return layer.quads_kernel_forms[projection]
        weight, channels, residual = self._stack(layer, projection), None, None
        if self.precision.uses_rac and _channels(layer, projection).shape[1]:
            channels, residual = _channels(layer, projection), self._stack(layer, projection, residual=True)
        return GroupedProjection(self.precision, weight, channels, residual)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        """The routed experts' weighted sum for ``x [T, H]`` (vLLM runs shared experts itself)."""
        ids, weights = _local_routing(layer, topk_ids, topk_weights)
        if layer.quads_calibration is not None:
            return self._calibration_forward(layer, x, ids, weights, topk_ids)
        if layer.quads_fp4_experts is not None:
            return _fp4_experts_forward(layer.quads_fp4_experts, x, ids, weights)
        experts = GroupedExperts(self._projection(layer, "w13"), self._projection(layer, "w2"))
        return experts(x, ids, weights, F.silu)

    # ------------------------------------------------------------------ RAC calibration
    def begin_calibration(self, layer: torch.nn.Module) -> None:
        """Record every local expert's inputs from now on (forwards compute W4A16, the AQAT trainer's forward)."""
        if not self.precision.uses_rac:
            raise ValueError(f"{layer.layer_name}: RAC calibration is for the quads precision, this layer serves {self.serving.precision!r}")
        experts, device = layer.w13_weight.shape[0], layer.w13_weight.device
        layer.quads_calibration = {p: StackChannelStats(experts, layer.quads_sizes[p][1], device) for p in ("w13", "w2")}

    def residual_channel_sets(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every local expert's RAC channel set (CPU int32) by checkpoint module name, under its global
        expert id (gate_proj and up_proj: w13's set; down_proj: w2's)."""
        sets = {}
        for projection, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            for e, channels in enumerate(_channels(layer, projection).cpu()):
                for shard in shards:
                    sets[_checkpoint_name(layer, _global_expert(layer, e), shard, "")[:-1]] = channels.clone()
        return sets

    def routed_token_counts(self, layer: torch.nn.Module) -> list[int]:
        """Tokens each local expert has recorded since :meth:`begin_calibration`."""
        if layer.quads_calibration is None:
            raise RuntimeError(f"{layer.layer_name}: no calibration in progress (begin_calibration)")
        return layer.quads_calibration["w13"].token_counts()

    def finish_calibration(self, layer: torch.nn.Module, statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> int:
        """Choose each expert's channels from the recorded inputs (an expert no token reached takes
        its layer's pooled statistics), write them and their ``W_S`` into the parameters, and
        prepare the tails again; returns the tokens seen. Stops recording."""
        stats, layer.quads_calibration = layer.quads_calibration, None
        if stats is None:
            raise RuntimeError(f"{layer.layer_name}: finish_calibration without begin_calibration")
        for projection, recorded in stats.items():
            stack = self._stack(layer, projection)
            channels = select_stack_channels(recorded.per_expert(), stack, self.precision.ratio, statistic)
            if channels is None:
                raise RuntimeError(f"{layer.layer_name}: calibration saw no token for this layer: calibrate on more prompts")
            channels = channels.to(stack.codes.device)  # valid sets by construction: no per-row host check
            residual, no_amax = reblock_columns_deferred(stack, channels)
            if bool(no_amax.any()):
                raise ValueError(f"{layer.layer_name}: a {projection} weight_scale_2 is not amax / 2688 for any fp32 "
                                 "amax (a damaged scale): load the weights again")
            _write_tails(layer, projection, channels, residual)
        self.process_weights_after_loading(layer)
        return sum(stats["w13"].token_counts())

    def _calibration_forward(self, layer: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
                             weights: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
        """W4A16 for all experts at once (rows sorted by expert, one grouped GEMM per projection),
        recording each local expert's inputs of both projections (another rank's experts: not)."""
        stats = layer.quads_calibration
        w13, w2 = self._stack(layer, "w13"), self._stack(layer, "w2")
        experts, top_k = w13.shape[0], ids.shape[-1]
        flat = ids.reshape(-1)
        order, offsets = route_by_expert(flat, experts)
        recorded = _recorded_experts(layer.expert_map, global_ids.reshape(-1)[order], flat[order], experts)
        rows = x[order // top_k]
        stats["w13"].update(rows, recorded)
        gate, up = grouped_w4a16_linear(rows, w13, offsets).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        stats["w2"].update(hidden, recorded)
        y = grouped_w4a16_linear(hidden, w2, offsets)
        return combine_routed_rows(y, order, weights.reshape(-1, top_k), x.dtype)


# ---------------------------------------------------------------------- helpers
def _checkpoint_name(layer: torch.nn.Module, expert: int, shard_id: str, leaf: str) -> str:
    proj = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}[shard_id]
    return f"{layer.layer_name}.{expert}.{proj}.{leaf}"


def _load_expert_tensor(layer: torch.nn.Module, projection: str, leaf: str, param: torch.nn.Parameter,
                        loaded: torch.Tensor, shard_id: str, expert: int, where: str) -> None:
    """Copy one checkpoint tensor into expert ``expert``'s slice of ``param`` (gate: the first half
    of w13, up: the second), checking its shape."""
    if (projection == "w2") != (shard_id == "w2"):
        raise ValueError(f"{where}: shard {shard_id!r} does not belong to {projection}")
    target = param.data[expert]
    if leaf in ("weight_scale_2", "input_scale"):
        if loaded.numel() != 1:
            raise ValueError(f"{where}: expected a scalar, got shape {tuple(loaded.shape)}")
        target = target[_SHARD[shard_id]] if projection == "w13" else target
        target.copy_(loaded.reshape(()))
        return
    if leaf == "residual_channels":
        target = target[_SHARD[shard_id]] if projection == "w13" else target
        if loaded.numel() == 0:  # saved before calibration: a zero tail (see module docstring)
            target.copy_(torch.arange(target.numel(), dtype=torch.int32, device=target.device))
            return
        if loaded.shape != target.shape:
            raise ValueError(f"{where}: {loaded.numel()} residual channels, but this engine holds {target.numel()} per linear "
                             f"(num_residual_channels(K, ratio) for the served RAC ratio); re-calibrate at that ratio or "
                             f"serve the checkpoint's ratio")
        target.copy_(loaded)
        return
    if projection == "w13":
        half = target.shape[0] // 2
        target = target[_SHARD[shard_id] * half:(_SHARD[shard_id] + 1) * half]
    if leaf.startswith("residual") and loaded.numel() == 0:
        target.copy_(torch.zeros_like(target))  # copy_: what vLLM's layer-wise reload counts as loaded
        return
    if loaded.shape != target.shape:
        raise ValueError(f"{where}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    if loaded.dtype != target.dtype:
        raise ValueError(f"{where}: expected dtype {target.dtype}, got {loaded.dtype}")
    target.copy_(loaded)


def _required(layer: torch.nn.Module, quads: bool) -> list[str]:
    """The parameters every expert must load: the residual ones only in quads and where the ratio
    gives the projection channels (vLLM's layer-wise reload drops a tensor of no elements that
    arrives after the layer's last element, so an empty tail may never reach its loader)."""
    params = [(n, p) for n, p in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]
    return [n for n, p in params if "residual" not in n or (quads and p.numel())]


def _check_loaded(layer: torch.nn.Module, loaded: set, quads: bool) -> None:
    """Every tensor of every local expert was loaded, every scale is valid (:func:`_check_scales`,
    before any check that compares scales), residual channels are valid."""
    experts = layer.w13_weight.shape[0]
    missing = [_checkpoint_name(layer, e, shard, name.partition("_")[2])
               for name in _required(layer, quads) for shard in (("w2",) if name.startswith("w2") else ("w1", "w3"))
               for e in range(experts) if (name, shard, e) not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors of {layer.layer_name}, e.g. {missing[:4]}; "
                         "every routed expert needs weight, weight_scale, weight_scale_2 (and residual_* for quads)")
    _check_scales(layer, quads)
    if not quads:
        return
    channels13 = layer.w13_residual_channels
    if not torch.equal(channels13[:, 0], channels13[:, 1]):
        raise ValueError(f"{layer.layer_name}: gate_proj and up_proj read the same input, so they need the same residual_channels")
    for projection in ("w13", "w2"):  # one host read a projection, not one per expert
        shard = "w2" if projection == "w2" else "w1"
        check_channel_rows(_channels(layer, projection), layer.quads_sizes[projection][1],
                           lambda e, shard=shard: f"{_checkpoint_name(layer, _global_expert(layer, e), shard, 'residual_channels')}: "
                                                     "residual channels")


def _channels(layer: torch.nn.Module, projection: str) -> torch.Tensor:
    """``[E, C]`` residual channels of a projection (gate's copy for w13, which processing requires
    equal to up's)."""
    channels = getattr(layer, f"{projection}_residual_channels")
    return channels[:, 0] if projection == "w13" else channels


def _placeholder_channels(layer: torch.nn.Module) -> None:
    """Valid channels (the first C) for a tail with zero ``W_S``."""
    for projection in ("w13", "w2"):
        channels = getattr(layer, f"{projection}_residual_channels").data
        channels.copy_(torch.arange(channels.shape[-1], dtype=torch.int32, device=channels.device).expand_as(channels))


def _zero_weights(layer: torch.nn.Module, quads: bool) -> None:
    """All-zero expert weights (what a layer holds before its weights arrive)."""
    for name in _required(layer, quads):
        getattr(layer, name).data.zero_()
    if quads:
        _placeholder_channels(layer)


def _write_tails(layer: torch.nn.Module, projection: str, channels: torch.Tensor, residual: NVFP4Tensor) -> None:
    """Every expert's residual channels ``[E, |S|]`` and ``W_S`` ``[E, N, |S|]`` into the parameters, in place."""
    target = getattr(layer, f"{projection}_residual_channels").data
    per_expert = channels.to(torch.int32).reshape(channels.shape[0], *[1] * (target.ndim - 2), channels.shape[1])
    target.copy_(per_expert.expand_as(target))
    getattr(layer, f"{projection}_residual_weight").data.copy_(residual.codes)
    getattr(layer, f"{projection}_residual_weight_scale").data.copy_(residual.scales)


def _fp4_experts_forward(experts: dict[str, list[AugmentedWeight]], x: torch.Tensor, ids: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """The routed experts through vLLM's FP4 GEMM (sm_100): rows sorted by expert, two GEMMs per
    expert (the host reads the expert offsets), the project's combine."""
    top_k = ids.shape[-1]
    order, offsets = route_by_expert(ids.reshape(-1), len(experts["w13"]))
    rows = x[order // top_k]
    out = torch.empty((rows.shape[0], x.shape[-1]), dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        if stop > start:
            gate, up = fp4_linear(rows[start:stop], experts["w13"][e]).chunk(2, dim=-1)
            out[start:stop] = fp4_linear(F.silu(gate) * up, experts["w2"][e])
    return combine_routed_rows(out, order, weights.reshape(-1, top_k), x.dtype)


def _form_tensors(projection: GroupedProjection) -> list[torch.Tensor]:
    """The tensors a prepared projection computes with (weight, decode scales, RAC tail)."""
    parts = [projection.weight.codes, projection.weight.scales, projection.weight.weight_scale_2]
    if projection.residual is not None:
        parts += [projection.channels, projection.residual.codes, projection.residual.scales, projection.residual.weight_scale_2]
    return parts


def _into_held_storage(held: dict[str, GroupedProjection] | None,
                       new: dict[str, GroupedProjection]) -> dict[str, GroupedProjection]:
    """``new``'s values in ``held``'s tensors where both have the same layout (copied where they are
    not already the same storage), else ``new``: a CUDA graph keeps the addresses it captured."""
    if held is None:
        return new
    pairs = [(old, fresh) for p in new for old, fresh in zip(_form_tensors(held[p]), _form_tensors(new[p]))]
    if (any(len(_form_tensors(held[p])) != len(_form_tensors(new[p])) for p in new)
            or any((old.shape, old.dtype, old.stride()) != (fresh.shape, fresh.dtype, fresh.stride()) for old, fresh in pairs)):
        return new
    for old, fresh in pairs:
        if old.data_ptr() != fresh.data_ptr():
            old.copy_(fresh)
    return held


def _local_routing(layer: torch.nn.Module, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in local expert ids (int64); under expert parallelism another rank's experts get
    weight 0 (and expert 0's rows, which they then do not change)."""
    ids = topk_ids.to(torch.int64)
    expert_map = layer.expert_map
    if expert_map is None:
        return ids, topk_weights
    local = expert_map.to(ids.device)[ids].to(torch.int64)
    return local.clamp(min=0), torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))


def _recorded_experts(expert_map: torch.Tensor | None, global_ids: torch.Tensor, local_ids: torch.Tensor,
                      experts: int) -> torch.Tensor:
    """The expert each routed row's inputs are recorded under in calibration: its local id, or
    ``experts`` (not recorded) for another rank's expert, which :func:`_local_routing` sent to expert 0."""
    if expert_map is None:
        return local_ids
    is_local = expert_map.to(global_ids.device)[global_ids.to(torch.int64)] >= 0
    return torch.where(is_local, local_ids, experts)


def _global_expert(layer: torch.nn.Module, local: int) -> int:
    """The checkpoint's (global) id of local expert ``local`` (they differ under expert parallelism)."""
    expert_map = getattr(layer, "expert_map", None)
    if expert_map is None:
        return local
    return int(torch.nonzero(expert_map.cpu() == local)[0])


def _check_scales(layer: torch.nn.Module, quads: bool) -> None:
    """Every stored scale of every local expert follows :mod:`megatron_quads.rollout.stored_scales`
    (block scales finite and >= 0; ``weight_scale_2`` finite, >= 0 and 0 only for an all-zero
    weight; static input scales finite and > 0; in quads the residual block scales too): else
    ValueError naming the first checkpoint tensor that does not."""
    from megatron_quads.vllm_plugin.scale_checks import ScaleChecks

    for projection, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
        rows = layer.quads_sizes[projection][0] // len(shards)

        def name(index: tuple[int, ...], leaf: str, shards: tuple[str, ...] = shards) -> str:
            return _checkpoint_name(layer, _global_expert(layer, index[0]), shards[index[1]], leaf)

        checks = ScaleChecks([rows] * len(shards), name)
        scale_2 = getattr(layer, f"{projection}_weight_scale_2")
        checks.weight(getattr(layer, f"{projection}_weight_scale"), scale_2.reshape(scale_2.shape[0], len(shards)))
        input_scale = getattr(layer, f"{projection}_input_scale", None)
        if input_scale is not None:
            checks.input_scale(input_scale.reshape(input_scale.shape[0], len(shards)))
        if quads:
            checks.residual(getattr(layer, f"{projection}_residual_weight_scale"))
        checks.raise_first()
