"""Dense linears in scope in vLLM (e.g. attention q/k/v/o) as NVFP4 (+RAC), computed by the project's
:func:`~megatron_quads.rollout.precision.linear_output`.

vLLM's split: :meth:`QuadsLinearMethod.create_weights` makes parameters shaped as the checkpoint
stores them (ModelOpt's names, plus the residual fields), each with a loader that copies one
checkpoint tensor into its shard's slice; :meth:`~QuadsLinearMethod.process_weights_after_loading`
checks what was loaded; :meth:`~QuadsLinearMethod.apply` builds a
:class:`~megatron_quads.rollout.precision.LinearState` of views of the parameters and computes
``linear_output`` under ``serving.precision``, so vLLM and the built-in engine run the same
arithmetic (the reference on CPU, the Triton kernels on CUDA sm_90; on sm_100 W4A4 and quads run
through vLLM's FP4 GEMM over the augmented K, :mod:`.fp4_gemm`). The plugin has no numerics of its own.

vLLM fuses sibling linears into one layer: q/k/v into a ``QKVParallelLinear`` (shard ids ``'q'``,
``'k'``, ``'v'``), gate/up into a ``MergedColumnParallelLinear`` (shard ids 0, 1); other linears
have one shard (shard id ``None``). Parameters of a layer with K inputs, P output shards of
N_1..N_P rows (N = their sum) and C residual channels (``ServingConfig.residual_channels(K)``;
none unless quads):

| parameter | dtype | shape |
|---|---|---|
| ``weight`` | uint8 | ``[N, K/2]`` |
| ``weight_scale`` | float8_e4m3fn | ``[N, K/16]`` |
| ``weight_scale_2`` | float32 | ``[P]`` (one slot per shard) |
| ``input_scale`` | float32 | ``[P]`` (only if the checkpoint has them) |
| ``residual_channels`` | int32 | ``[P, C]`` (one set per shard) |
| ``residual_weight`` | uint8 | ``[N, C/2]`` |
| ``residual_weight_scale`` | float8_e4m3fn | ``[N, C/16]`` |

Rules:

- Each shard writes its own rows and its own slot of the per-shard parameters, so vLLM's layer-wise
  reload (which counts the elements copied into a layer) counts every loaded element once;
  processing then requires the shards to agree on ``weight_scale_2`` (vLLM runs them as one GEMM
  with one scale) and on ``residual_channels`` (they read the same input).
- In quads, a checkpoint module with no residual channels (saved before calibration) loads as a zero
  tail: ``W_S = 0`` on placeholder channels ``arange(C)``, the plain W4A4 product, until calibration
  writes real ones; any other channel count than C is an error. In w4a4 / w4a16 the checkpoint's
  residual tensors are accepted and dropped (empty parameters: vLLM refuses a checkpoint tensor
  that has no parameter).
- Static input scales are stored and not used: activations are quantized with per-token scales.
- Only ``tensor_parallel_size=1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.precision import Precision
from megatron_quads.rollout.calibration import ChannelStats, select_from_stats
from megatron_quads.rollout.precision import LinearState, linear_output
from megatron_quads.rollout.rac import ChannelStatistic, validate_channels
from megatron_quads.vllm_plugin.fp4_gemm import AugmentedWeight, fp4_gemm_supported, fp4_linear
from megatron_quads.vllm_plugin.scale_checks import ScaleChecks
from megatron_quads.vllm_plugin.serving import ServingConfig

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
"""QKVParallelLinear's shard ids -> shard index."""
_FUSED_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused layer names -> the checkpoint modules of their shards (for error messages)."""
_PER_SHARD = ("weight_scale_2", "input_scale", "residual_channels")
"""Parameters with one slot per shard (the others are row-sharded)."""
_RESIDUAL = ("residual_channels", "residual_weight", "residual_weight_scale")
_W4A16 = Precision("w4a16")
"""What the layer computes while calibration records its inputs (the AQAT trainer's forward)."""


class QuadsLinearMethod(LinearMethodBase):
    """NVFP4 (+RAC) dense linear under ``serving.precision`` (see the module docstring)."""

    def __init__(self, serving: ServingConfig) -> None:
        super().__init__()
        self.serving = serving
        self.precision = serving.precision

    # ------------------------------------------------------------------ weights
    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """Parameters as the checkpoint stores them (the table in the module docstring)."""
        if getattr(layer, "tp_size", 1) > 1:
            raise NotImplementedError(f"{layer.prefix}: the QUADS linear method serves tensor_parallel_size=1 only "
                                      f"(this layer is split over {layer.tp_size} ranks)")
        K, sizes = input_size_per_partition, [int(n) for n in output_partition_sizes]
        if K % BLOCK_SIZE:
            raise ValueError(f"{layer.prefix}: NVFP4 linears need in_features to be a multiple of {BLOCK_SIZE}, got {K}")
        N, P, C = sum(sizes), len(sizes), self.serving.residual_channels(K)
        quads = self.precision.uses_rac
        layer.quads_dtype = params_dtype
        layer.quads_in_features = K
        layer.quads_shards = sizes
        layer.quads_loaded = set()
        layer.quads_empty_tails = set()
        layer.quads_calibration = None
        attrs = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
        shapes = {
            "weight": ((N, K // 2), torch.uint8),
            "weight_scale": ((N, K // BLOCK_SIZE), torch.float8_e4m3fn),
            "weight_scale_2": ((P,), torch.float32),
        }
        if self.serving.input_scales:
            shapes["input_scale"] = ((P,), torch.float32)
        if quads:
            shapes |= {
                "residual_channels": ((P, C), torch.int32),
                "residual_weight": ((N, C // 2), torch.uint8),
                "residual_weight_scale": ((N, C // BLOCK_SIZE), torch.float8_e4m3fn),
            }
        elif self.serving.residual_tensors:  # the checkpoint's residual tensors are read and dropped
            shapes |= {"residual_channels": ((0,), torch.int32), "residual_weight": ((0,), torch.uint8),
                       "residual_weight_scale": ((0,), torch.float8_e4m3fn)}
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)
            param.weight_loader = self._loader(layer, name, sink=name in _RESIDUAL and not quads)
        if quads:
            _placeholder_channels(layer)

    def _loader(self, layer: torch.nn.Module, name: str, sink: bool) -> Callable:
        """The weight loader of parameter ``name``: one checkpoint tensor into its shard's slice of
        the ``param`` it is given (vLLM's reload passes a fresh parameter, so never a captured one)."""

        def weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                          loaded_shard_id: str | int | None = None) -> None:
            shard = _shard_index(layer, loaded_shard_id, name)
            if sink:
                return
            where = _checkpoint_name(layer, shard, name)
            if _load_shard(layer, name, param, loaded_weight, shard, where):
                layer.quads_empty_tails.add((name, shard))
            if param.numel():  # a tail of no channels is not waited for (_required)
                layer.quads_loaded.add((name, shard))

        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check what the checkpoint filled (every tensor of every shard, all shards sharing one
        ``weight_scale_2`` and one valid channel set). A layer nothing was loaded into (vLLM's dummy
        load format) is set to zero weights. Safe to call again on a processed layer; parameters
        keep their storage (vLLM's reload copies the results into the original tensors)."""
        loaded, layer.quads_loaded = layer.quads_loaded, set()
        empty, layer.quads_empty_tails = layer.quads_empty_tails, set()
        quads = self.precision.uses_rac
        if loaded:
            _check_loaded(layer, loaded, quads)
            if quads:
                _check_empty_tails(layer, empty)
        elif not getattr(layer, "quads_prepared", False):
            _zero_weights(layer, quads)
        scale_2 = layer.weight_scale_2
        if not torch.equal(scale_2, scale_2[:1].expand_as(scale_2)):
            shards = ", ".join(f"{_checkpoint_name(layer, s, 'weight_scale_2')} = {float(v):.6g}" for s, v in enumerate(scale_2))
            raise ValueError(f"{layer.prefix}: the fused shards have different weight_scale_2 ({shards}); vLLM runs them "
                             "as one GEMM with one scale (quantize fused siblings with one shared amax)")
        if quads:
            _check_channels(layer)
        layer.quads_fp4_weight = None
        if self.precision.quantized_activations and fp4_gemm_supported(layer.weight.device):
            state = self._state(layer)
            channels = state.channels.get(self.precision.ratio)
            layer.quads_fp4_weight = AugmentedWeight.prepare(state.quantized, channels, state.residual.get(self.precision.ratio))
        layer.quads_prepared = True

    # ------------------------------------------------------------------ compute
    def _weight(self, layer: torch.nn.Module) -> NVFP4Tensor:
        """``q(W)`` ``[N, K]`` viewing the parameters (the shards' shared ``weight_scale_2``)."""
        return NVFP4Tensor(codes=layer.weight, scales=layer.weight_scale, weight_scale_2=layer.weight_scale_2[0],
                           shape=torch.Size((layer.weight.shape[0], layer.quads_in_features)), dtype=layer.quads_dtype)

    def _state(self, layer: torch.nn.Module) -> LinearState:
        """The layer as the project computes it: ``q(W)`` and, in quads, its channels and ``W_S``."""
        weight = self._weight(layer)
        if not self.precision.uses_rac:
            return LinearState(weight)
        channels = layer.residual_channels[0]
        residual = None
        if channels.numel():
            residual = NVFP4Tensor(codes=layer.residual_weight, scales=layer.residual_weight_scale,
                                   weight_scale_2=weight.weight_scale_2, shape=torch.Size((weight.shape[0], channels.numel())),
                                   dtype=layer.quads_dtype)
        ratio = self.precision.ratio
        return LinearState(weight, channels={ratio: channels}, residual={ratio: residual})

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``linear_output(x, state, serving.precision)`` (+ bias); while calibrating, W4A16
        with ``x`` recorded."""
        if layer.quads_calibration is not None:
            layer.quads_calibration.update(x)
            y = linear_output(x, LinearState(self._weight(layer)), _W4A16)
        elif getattr(layer, "quads_fp4_weight", None) is not None:  # sm_100: vLLM's FP4 GEMM over the augmented K
            y = fp4_linear(x, layer.quads_fp4_weight)
        else:
            y = linear_output(x, self._state(layer), self.precision)
        return y if bias is None else y + bias

    # ------------------------------------------------------------------ RAC calibration
    def begin_calibration(self, layer: torch.nn.Module) -> None:
        """Record the layer's inputs from now on (forwards compute W4A16)."""
        if not self.precision.uses_rac:
            raise ValueError(f"{layer.prefix}: RAC calibration is for the quads precision, this layer serves {self.serving.precision!r}")
        layer.quads_calibration = ChannelStats(layer.quads_in_features)

    def finish_calibration(self, layer: torch.nn.Module, statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> int:
        """Choose the layer's channels from the recorded inputs, write them (every shard's slot) and
        ``W_S`` into the parameters in place, and process the layer again; returns the tokens seen.
        Stops recording."""
        stats, layer.quads_calibration = layer.quads_calibration, None
        if stats is None:
            raise RuntimeError(f"{layer.prefix}: finish_calibration without begin_calibration")
        if stats.tokens == 0:
            raise RuntimeError(f"{layer.prefix}: calibration saw no token for this layer: calibrate on more prompts")
        weight = self._weight(layer)
        channels = select_from_stats({layer.prefix: stats}, self.precision.ratio, statistic, {layer.prefix: weight})[layer.prefix]
        residual = reblock_columns(weight, channels)
        target = layer.residual_channels.data
        target.copy_(channels.to(device=target.device, dtype=torch.int32).expand_as(target))
        layer.residual_weight.data.copy_(residual.codes)
        layer.residual_weight_scale.data.copy_(residual.scales)
        self.process_weights_after_loading(layer)
        return stats.tokens


# ---------------------------------------------------------------------- helpers
def _shard_index(layer: torch.nn.Module, shard_id: str | int | None, name: str) -> int:
    """The shard index of vLLM's shard id (``'q'``/``'k'``/``'v'``, an int, or ``None`` for an unfused layer)."""
    shards = len(layer.quads_shards)
    if shard_id is None:
        if shards != 1:
            raise ValueError(f"{layer.prefix}.{name}: the checkpoint stores this fused layer as one tensor; the QUADS "
                             f"format stores each of its {shards} shards separately (e.g. q_proj, k_proj, v_proj)")
        return 0
    index = _QKV_SHARDS.get(shard_id) if isinstance(shard_id, str) else shard_id
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < shards:
        raise ValueError(f"{layer.prefix}.{name}: unexpected shard id {shard_id!r} for a layer of {shards} shard(s)")
    return index


def _checkpoint_name(layer: torch.nn.Module, shard: int, leaf: str) -> str:
    """The checkpoint tensor of shard ``shard``'s ``leaf`` (``...q_proj.weight`` for a qkv_proj)."""
    shards = len(layer.quads_shards)
    if shards == 1:
        return f"{layer.prefix}.{leaf}"
    parent, _, name = layer.prefix.rpartition(".")
    members = _FUSED_MEMBERS.get(name)
    module = f"{parent}.{members[shard]}" if members and len(members) == shards else f"{layer.prefix}[shard {shard}]"
    return f"{module}.{leaf}"


def _rows(layer: torch.nn.Module, shard: int) -> slice:
    """The output rows of shard ``shard`` in the fused weight."""
    start = sum(layer.quads_shards[:shard])
    return slice(start, start + layer.quads_shards[shard])


def _load_shard(layer: torch.nn.Module, name: str, param: torch.nn.Parameter, loaded: torch.Tensor, shard: int,
                where: str) -> bool:
    """Copy one checkpoint tensor into shard ``shard``'s slice of ``param``, checking its shape and
    dtype; returns whether it was an empty residual tensor (a module saved before calibration).
    Every element of the slice is written with ``copy_`` (what vLLM's reload counts)."""
    if name in ("weight_scale_2", "input_scale"):
        if loaded.numel() != 1:
            raise ValueError(f"{where}: expected a scalar, got shape {tuple(loaded.shape)}")
        param.data[shard].copy_(loaded.reshape(()))
        return False
    target = param.data[shard] if name in _PER_SHARD else param.data[_rows(layer, shard)]
    empty = name in _RESIDUAL and loaded.numel() == 0 and target.numel() > 0
    if name == "residual_channels":
        if empty:  # saved before calibration: a zero tail on placeholder channels (see module docstring)
            target.copy_(torch.arange(target.numel(), dtype=torch.int32, device=target.device))
            return True
        if loaded.shape != target.shape:
            raise ValueError(f"{where}: {loaded.numel()} residual channels, but this engine holds {target.numel()} per "
                             f"linear with {layer.quads_in_features} inputs (num_residual_channels(K, ratio) for the served "
                             "RAC ratio); re-calibrate at that ratio or serve the checkpoint's ratio")
    elif empty:
        target.copy_(torch.zeros_like(target))
        return True
    if loaded.shape != target.shape:
        raise ValueError(f"{where}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    if loaded.dtype != target.dtype:
        raise ValueError(f"{where}: expected dtype {target.dtype}, got {loaded.dtype}")
    target.copy_(loaded)
    return False


def _required(layer: torch.nn.Module, quads: bool) -> list[str]:
    """The parameters every shard must load (the residual ones only in quads, and only where the
    ratio gives the layer channels: vLLM's layer-wise reload drops a tensor of no elements that
    arrives after the layer's last element, so an empty tail may never reach its loader)."""
    return [n for n, p in layer.named_parameters(recurse=False)
            if n != "bias" and (n not in _RESIDUAL or (quads and p.numel()))]


def _check_loaded(layer: torch.nn.Module, loaded: set[tuple[str, int]], quads: bool) -> None:
    """Every tensor of every shard was loaded, and every scale is valid (:func:`_check_scales`, before
    any check that compares the shards' scales)."""
    missing = [_checkpoint_name(layer, s, n) for n in _required(layer, quads)
               for s in range(len(layer.quads_shards)) if (n, s) not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors of {layer.prefix}, e.g. {missing[:4]}; a quantized "
                         "linear needs weight, weight_scale, weight_scale_2 (input_scale where the checkpoint has them, "
                         "residual_* for quads)")
    _check_scales(layer, quads)


def _check_scales(layer: torch.nn.Module, quads: bool) -> None:
    """Every stored scale of every shard follows :mod:`megatron_quads.rollout.stored_scales` (block
    scales finite and >= 0; ``weight_scale_2`` finite, >= 0 and 0 only for an all-zero weight; static
    input scales finite and > 0; in quads the residual block scales too): else ValueError naming the
    first checkpoint tensor that does not."""
    checks = ScaleChecks(layer.quads_shards, lambda index, leaf: _checkpoint_name(layer, index[0], leaf))
    checks.weight(layer.weight_scale, layer.weight_scale_2)
    if getattr(layer, "input_scale", None) is not None:
        checks.input_scale(layer.input_scale)
    if quads:
        checks.residual(layer.residual_weight_scale)
    checks.raise_first()


def _check_empty_tails(layer: torch.nn.Module, empty: set[tuple[str, int]]) -> None:
    """A shard's three residual tensors are all empty (saved before calibration) or none is."""
    for s in range(len(layer.quads_shards)):
        found = [n for n in _RESIDUAL if (n, s) in empty]
        if found and len(found) != len(_RESIDUAL):
            full = [_checkpoint_name(layer, s, n) for n in _RESIDUAL if n not in found]
            raise ValueError(f"{_checkpoint_name(layer, s, found[0])} is empty but {full} are not; a module's residual "
                             "tensors are empty together (no channels) or not at all: re-export the checkpoint")


def _check_channels(layer: torch.nn.Module) -> None:
    """Every shard's channel set is valid, and all shards hold the same one."""
    channels = layer.residual_channels
    for s, shard_channels in enumerate(channels):
        try:
            validate_channels(shard_channels, layer.quads_in_features)
        except ValueError as err:
            raise ValueError(f"{_checkpoint_name(layer, s, 'residual_channels')}: {err}") from None
    for s in range(1, channels.shape[0]):
        if not torch.equal(channels[0], channels[s]):
            raise ValueError(f"{_checkpoint_name(layer, s, 'residual_channels')} differs from "
                             f"{_checkpoint_name(layer, 0, 'residual_channels')}: the shards of {layer.prefix} read the same "
                             "input, so they need the same residual channels")


def _placeholder_channels(layer: torch.nn.Module) -> None:
    """Valid channels (the first C) for a tail with zero ``W_S``."""
    channels = layer.residual_channels.data
    channels.copy_(torch.arange(channels.shape[-1], dtype=torch.int32, device=channels.device).expand_as(channels))


def _zero_weights(layer: torch.nn.Module, quads: bool) -> None:
    """All-zero weights (what a layer holds before its weights arrive)."""
    for name in _required(layer, quads):
        getattr(layer, name).data.zero_()
    if quads:
        _placeholder_channels(layer)
