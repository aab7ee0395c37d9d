"""Asymmetric QAT building blocks: NVFP4 fake-quantized weights, computed once per optimizer step.

The trainer's forward uses ``dequantize(quantize(W))`` for the weights in scope (routed experts by
default) while activations and gradients stay in high precision; the gradient reaches ``W``
unchanged (straight-through). The quantized copy is cached per weight and rebuilt only when the
weight changes, so micro-batches and the backward pass reuse it.

Memory cost: one extra tensor of the weight's dtype and shape per fake-quantized weight (the cached
dequantized copy), i.e. +1x the parameter memory of the layers in scope (e.g. +1x routed-expert
weights in bf16); nothing extra per micro-batch, because every forward shares the cached copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_quads.nvfp4 import BLOCK_SIZE, quantize_dequantize


class _UseQuantizedWeight(torch.autograd.Function):
    """Forward: the cached fake-quantized weight. Backward: the gradient goes to the real weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def straight_through(weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``quantized`` in the forward pass, with the gradient routed to ``weight`` unchanged."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return quantized
    return _UseQuantizedWeight.apply(weight, quantized)


def reduced_amax(weight: torch.Tensor, group: dist.ProcessGroup | None, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """fp32 amax of ``weight`` (over ``dims``, default all), max-reduced over ``group`` if it spans ranks.

    Every shard of a tensor-parallel weight must quantize with the amax of the full tensor, which is
    the scale the exported, gathered weight gets.
    """
    w = weight.detach()
    amax = (w.abs().amax() if dims is None else w.abs().amax(dim=dims)).to(torch.float32)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


class QuantizedWeightCache:
    """The fake-quantized copy of one weight, rebuilt when the weight changes.

    A weight counts as changed when its autograd version counter or storage moved (in-place optimizer
    updates, ``load_state_dict``) or when :meth:`invalidate` was called. Megatron's mixed-precision
    optimizers copy master weights into the model through ``param.data``, which does not bump the
    version counter, so the policy worker also invalidates explicitly after every optimizer step
    (:func:`invalidate_fake_quant_caches`).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None
        self.rebuilds = 0

    def invalidate(self) -> None:
        """Forget the cached copy; the next :meth:`get` rebuilds it."""
        self._key = None
        self._value = None

    def get(self, weight: torch.Tensor, build: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The cached ``build(weight)``, rebuilt if ``weight`` changed since the last call."""
        key = (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.device)
        if self._value is None or key != self._key:
            with torch.no_grad():
                self._value = build(weight.detach())
            self._key = key
            self.rebuilds += 1
        return self._value


def fake_quant_weight(weight: torch.Tensor, group: dist.ProcessGroup | None, block_2d: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize of a ``[out, in]`` linear weight with a group-reduced global amax."""
    return quantize_dequantize(weight, global_amax=reduced_amax(weight, group), block_2d=block_2d)


def fake_quant_stacked_experts(
    weight: torch.Tensor, group: dist.ProcessGroup | None, block_2d: bool = False
) -> torch.Tensor:
    """Fake-quantize ``[E, out, in]`` expert weights, one global amax per expert (group-reduced)."""
    amax = reduced_amax(weight, group, dims=(1, 2))
    return quantize_dequantize(weight, global_amax=amax[:, None], block_2d=block_2d)


def check_reduction_dim(size: int, what: str) -> None:
    """Raise a clear error unless a weight's reduction dimension splits into NVFP4 blocks."""
    if size % BLOCK_SIZE:
        raise ValueError(
            f"{what}: the reduction dimension of a fake-quantized weight must be a multiple of "
            f"{BLOCK_SIZE} (NVFP4 block size), got {size}; change the model size or the parallel "
            "layout (the per-rank shard of a row-parallel weight must be a multiple too), or keep this "
            "layer out of the QUADS scope"
        )


@contextlib.contextmanager
def swapped_parameters(module: torch.nn.Module, replacements: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily make ``module.<name>`` return another tensor; the Parameters are restored after.

    Used for modules whose forward reads its weights as attributes and offers no weight argument
    (Megatron's GroupedMLP), so the stock forward runs unchanged on fake-quantized weights.
    """
    saved = {name: module._parameters[name] for name in replacements}
    try:
        for name, tensor in replacements.items():
            module._parameters[name] = tensor  # bypasses nn.Module's Parameter type check on purpose
        yield
    finally:
        module._parameters.update(saved)


def invalidate_fake_quant_caches(model: torch.nn.Module | list[torch.nn.Module]) -> int:
    """Invalidate every fake-quant cache in ``model`` (call after each optimizer step); returns the count."""
    models = model if isinstance(model, list) else [model]
    count = 0
    for m in models:
        for module in m.modules():
            for cache in getattr(module, "fake_quant_caches", lambda: [])():
                cache.invalidate()
                count += 1
    return count
