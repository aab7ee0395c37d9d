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
from megatron_quads.nvfp4.fused import fake_quant_values


class _UseQuantizedWeight(torch.autograd.Function):
    """Forward: the cached fake-quantized weight. Backward: the gradient goes to the real weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


class _UseQuantizedWeights(torch.autograd.Function):
    """:class:`_UseQuantizedWeight` for a group of weights in one autograd node (one per layer, not per expert)."""

    @staticmethod
    def forward(ctx, quantized: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        return tuple(q.view_as(q) for q in quantized.unbind(0))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: D102
        return (None, *grads)


def straight_through_group(weights: list[torch.Tensor], quantized: torch.Tensor) -> list[torch.Tensor]:
    """``quantized[i]`` in the forward pass for each ``weights[i]``, gradients routed to the weights."""
    if not (torch.is_grad_enabled() and weights[0].requires_grad):
        return list(quantized.unbind(0))
    return list(_UseQuantizedWeights.apply(quantized, *weights))


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
    """Fake-quantized copies of a list of weights, rebuilt together when any of them changes.

    A weight counts as changed when its autograd version counter or storage moved (in-place optimizer
    updates, ``load_state_dict``) or when :meth:`invalidate` was called. Megatron's mixed-precision
    optimizers copy master weights into the model through ``param.data``, which does not bump the
    version counter, so the policy worker also invalidates explicitly after every optimizer step
    (:func:`invalidate_fake_quant_caches`).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._values: list[torch.Tensor] | None = None
        self.rebuilds = 0

    def invalidate(self) -> None:
        """Forget the cached copies; the next :meth:`get` rebuilds them."""
        self._key = None
        self._values = None

    def get(
        self, weights: list[torch.Tensor], build: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """The cached ``build(weights)``, rebuilt if any weight changed since the last call."""
        key = tuple((w._version, w.data_ptr(), w.dtype, tuple(w.shape), w.device) for w in weights)
        if self._values is None or key != self._key:
            with torch.no_grad():
                self._values = build([w.detach() for w in weights])
            self._key = key
            self.rebuilds += 1
        return self._values


def fake_quant_weight(weight: torch.Tensor, group: dist.ProcessGroup | None, block_2d: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize of a ``[out, in]`` linear weight with a group-reduced global amax."""
    amax = reduced_amax(weight, group)
    if block_2d:
        return quantize_dequantize(weight, global_amax=amax, block_2d=True)
    return fake_quant_values(weight, amax)


def fake_quant_stacked_experts(
    weight: torch.Tensor, group: dist.ProcessGroup | None, block_2d: bool = False
) -> torch.Tensor:
    """Fake-quantize ``[E, out, in]`` expert weights, one global amax per expert (group-reduced)."""
    amax = reduced_amax(weight, group, dims=(1, 2))
    if block_2d:
        return quantize_dequantize(weight, global_amax=amax[:, None], block_2d=True)
    return fake_quant_values(weight, amax[:, None])


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
