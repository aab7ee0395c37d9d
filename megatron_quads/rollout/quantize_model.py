"""Quantize a Hugging Face model's named tensors into :class:`QuantizedModelWeights`: the linears in
scope to NVFP4 (fused siblings sharing one global amax) with their RAC residual columns, every other
tensor kept in high precision."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, compute_global_amax
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quant_config import make_quant_config
from megatron_quads.rollout.quantized_linear import (
    ChannelsLike,
    QuantizedLinearWeight,
    ScaleLike,
    input_scale_from_amax,
)
from megatron_quads.rollout.scopes import check_scope_consistency, excluded_modules, shared_scale_group

logger = logging.getLogger(__name__)


def _check_linear_weight(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != 2 or not t.is_floating_point():
        shape = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"is_quantized selected '{name}', which is not a 2-D floating-point linear weight (got {shape}); "
            "narrow is_quantized to linear modules"
        )
    if t.shape[1] % BLOCK_SIZE:
        raise ValueError(
            f"'{name}' has in_features {t.shape[1]}, not a multiple of {BLOCK_SIZE}: NVFP4 cannot quantize it; "
            "exclude the module from the scope"
        )


def quantize_hf_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    is_quantized: Callable[[str], bool],
    residual_channels: Mapping[str, ChannelsLike | None] | None = None,
    ratio: float = 0.0,
    *,
    input_amax: Mapping[str, ScaleLike] | None = None,
    weight_version: int = 0,
    unquantized_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedModelWeights:
    """Quantize the in-scope linear weights of HF ``(name, tensor)`` pairs; keep the rest in ``unquantized_dtype``.

    ``is_quantized(module)`` gets module names (``name`` without ``.weight``). Gate/up (w1/w3) of one
    expert or MLP, and q/k/v of one attention layer, are quantized with one shared global amax.
    ``residual_channels`` maps every quantized module to its channel set (None: none for all);
    ``ratio`` is the RAC ratio recorded in the config; ``input_amax`` gives static activation amaxes.
    Every tensor is copied: the result is a snapshot that later in-place updates of the inputs do not touch.
    """
    if unquantized_dtype not in fmt.UNQUANTIZED_DTYPES:
        raise ValueError(f"unquantized_dtype must be one of {fmt.UNQUANTIZED_DTYPES}, got {unquantized_dtype}")
    quantized: dict[str, QuantizedLinearWeight] = {}
    unquantized: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()

    def build(module: str, w: torch.Tensor, amax: torch.Tensor | None) -> None:
        if residual_channels is not None and module not in residual_channels:
            raise ValueError(
                f"residual_channels has no entry for quantized module '{module}'; give every quantized module a "
                "channel set (an empty tensor for none), or pass residual_channels=None"
            )
        if input_amax is not None and module not in input_amax:
            raise ValueError(f"input_amax has no entry for quantized module '{module}'; give one for every quantized module")
        channels = None if residual_channels is None else residual_channels[module]
        scale = None if input_amax is None else input_scale_from_amax(input_amax[module])
        try:
            quantized[module] = QuantizedLinearWeight.from_weight(w, channels, global_amax=amax, input_scale=scale)
        except ValueError as err:
            raise ValueError(f"{module}: {err}") from err

    def flush(group: str) -> None:
        members = pending.pop(group)
        amax = torch.stack([compute_global_amax(w).cpu() for w in members.values()]).amax()
        for module, w in members.items():
            build(module, w, amax)

    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor '{name}' appears twice in named_tensors")
        seen.add(name)
        module, leaf = fmt.split_tensor_name(name)
        if leaf == fmt.WEIGHT and module and is_quantized(module):
            _check_linear_weight(name, tensor)
            group = shared_scale_group(module)
            if group is None:
                build(module, tensor, None)
                continue
            pending.setdefault(group[0], {})[module] = tensor
            if len(pending[group[0]]) == len(group[1]):
                flush(group[0])
        else:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"unquantized tensor '{name}' has dtype {dtype}; only floating-point tensors are stored")
            unquantized[name] = tensor.detach().to(unquantized_dtype, copy=True)  # a snapshot, not a view of live params
    for group in list(pending):
        logger.debug("shared-scale group %s is incomplete (%s); quantizing what is there", group, list(pending[group]))
        flush(group)

    if residual_channels is not None:
        unknown = [m for m in residual_channels if m not in quantized]
        if unknown:
            raise ValueError(f"residual_channels names {len(unknown)} module(s) that were not quantized, e.g. '{unknown[0]}'")
    check_scope_consistency(quantized, unquantized)
    if residual_channels is None and ratio > 0:
        logger.info("no residual channels given: W_S is empty until with_residual_channels sets the RAC channels")
    config = make_quant_config(ratio, excluded_modules(quantized, unquantized), weight_version)
    weights = QuantizedModelWeights(quantized=quantized, unquantized=unquantized, config=config)
    logger.info(
        "quantized %d linears (residual fraction %.3f), kept %d tensors unquantized",
        len(quantized),
        weights.residual_fraction,
        len(unquantized),
    )
    return weights
