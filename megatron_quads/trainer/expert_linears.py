"""Megatron-Core linear and expert modules whose weights are NVFP4 fake-quantized in the forward pass.

They subclass Megatron's own classes and change only which weight tensor the stock forward
multiplies with, so parameter names, shapes, sharding and checkpoint keys stay those of the stock
modules: a checkpoint saved with QUADS loads without it, and the other way round.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

from megatron_quads.trainer.fake_quant import (
    QuantizedWeightCache,
    check_reduction_dim,
    fake_quant_stacked_experts,
    fake_quant_weight,
    straight_through,
    straight_through_group,
    swapped_parameters,
)

BLOCK_2D_ATTR = "quads_block_2d"
"""Class attribute a spec can set (``ModuleSpec(params=...)`` cannot reach linears) for 16x16 scales."""


class _FakeQuantLinearMixin:
    """Shared logic of the column- and row-parallel fake-quant linears."""

    quads_block_2d: bool = False

    @classmethod
    def _reject_gradient_accumulation_fusion(cls, config) -> None:
        if config.gradient_accumulation_fusion:
            raise ValueError(
                f"{cls.__name__}: gradient_accumulation_fusion writes weight gradients straight into "
                "param.main_grad, which a fake-quantized weight does not have; set "
                "gradient_accumulation_fusion=False in the TransformerConfig for QUADS local specs"
            )

    def _init_fake_quant(self, reduction_size: int) -> None:
        check_reduction_dim(reduction_size, f"{type(self).__name__}(in={self.input_size}, out={self.output_size})")
        self._fake_quant_cache = QuantizedWeightCache()
        self._expert_group: tuple[ExpertGroupFakeQuant, int] | None = None

    def fake_quant_caches(self) -> list[QuantizedWeightCache]:
        """The caches :func:`invalidate_fake_quant_caches` clears after an optimizer step."""
        return [] if self._expert_group else [self._fake_quant_cache]

    def quantized_weight(self) -> torch.Tensor:
        """The cached NVFP4 fake-quantized weight (no autograd edge), rebuilt if the weight changed."""
        if self._expert_group is not None:
            group, index = self._expert_group
            return group.refresh()[index]
        (quantized,) = self._fake_quant_cache.get(
            [self.weight], lambda ws: [fake_quant_weight(ws[0], self.tp_group, block_2d=self.quads_block_2d)]
        )
        return quantized

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: D102 (Megatron's hook)
        if weight is self.weight:
            if self._expert_group is not None and self._expert_group[0].forward_weights is not None:
                # prepared by the enclosing FakeQuantSequentialMLP.forward, already straight-through
                group, index = self._expert_group
                weight = group.forward_weights[index]
            else:
                weight = straight_through(weight, self.quantized_weight())
        return super()._forward_impl(input, weight, *args, **kwargs)


class FakeQuantColumnParallelLinear(_FakeQuantLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear computing with ``dequantize(quantize(W))`` (straight-through gradient)."""

    def __init__(self, *args, config, **kwargs) -> None:
        self._reject_gradient_accumulation_fusion(config)
        super().__init__(*args, config=config, **kwargs)
        self._init_fake_quant(self.input_size)


class FakeQuantRowParallelLinear(_FakeQuantLinearMixin, RowParallelLinear):
    """RowParallelLinear computing with ``dequantize(quantize(W))`` (straight-through gradient)."""

    def __init__(self, *args, config, **kwargs) -> None:
        self._reject_gradient_accumulation_fusion(config)
        super().__init__(*args, config=config, **kwargs)
        # each rank quantizes its own shard along K: the shard itself must split into blocks
        self._init_fake_quant(self.input_size_per_partition)


class ExpertGroupFakeQuant:
    """Fake-quantizes one projection (fc1 or fc2) of all local experts of a layer in one batched call.

    The experts' weights are stacked, their per-expert amaxes reduced over the expert-TP group in one
    collective, and quantized in one fused kernel: per-weight calls would cost a kernel launch chain
    and a collective per expert.
    """

    def __init__(self, linears: list[_FakeQuantLinearMixin]) -> None:
        shapes = {tuple(linear.weight.shape) for linear in linears}
        if len(shapes) != 1:
            raise ValueError(f"experts of one layer must share a weight shape, got {sorted(shapes)}")
        self.linears = linears
        self.cache = QuantizedWeightCache()
        self.forward_weights: list[torch.Tensor] | None = None
        for index, linear in enumerate(linears):
            linear._expert_group = (self, index)

    def invalidate(self) -> None:
        """Drop the cached weights (after an optimizer step)."""
        self.cache.invalidate()
        self.forward_weights = None

    def _build(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        first = self.linears[0]
        return [fake_quant_stacked_experts(torch.stack(weights), first.tp_group, block_2d=first.quads_block_2d)]

    def refresh(self) -> torch.Tensor:
        """All experts' fake-quantized weights ``[E, out, in]``, rebuilt if any weight changed."""
        (stacked,) = self.cache.get([linear.weight for linear in self.linears], self._build)
        return stacked

    def prepare_forward(self) -> None:
        """Refresh, and make the per-expert straight-through weights of this forward pass."""
        self.forward_weights = straight_through_group([linear.weight for linear in self.linears], self.refresh())


class FakeQuantSequentialMLP(SequentialMLP):
    """SequentialMLP whose fake-quant expert linears are quantized per layer in batched calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._groups = []
        for name in ("linear_fc1", "linear_fc2"):
            linears = [getattr(expert, name) for expert in self.local_experts]
            if linears and all(isinstance(linear, _FakeQuantLinearMixin) for linear in linears):
                self._groups.append(ExpertGroupFakeQuant(linears))

    def fake_quant_caches(self) -> list[ExpertGroupFakeQuant]:
        """The caches :func:`invalidate_fake_quant_caches` clears after an optimizer step."""
        return list(self._groups)

    def forward(self, *args, **kwargs):  # noqa: D102 (the stock forward; one check and one autograd node per group)
        for group in self._groups:
            group.prepare_forward()
        try:
            return super().forward(*args, **kwargs)
        finally:
            for group in self._groups:
                group.forward_weights = None


class FakeQuantGroupedMLP(GroupedMLP):
    """Megatron's (legacy) GroupedMLP with each local expert's weights fake-quantized to NVFP4.

    ``weight1`` is stored as ``[E, hidden, 2*ffn]`` and ``weight2`` as ``[E, ffn, hidden]`` (per
    rank, viewed the way GroupedMLP views them); NVFP4 blocks run along each GEMM's reduction
    dimension (hidden for fc1, ffn for fc2), with one global amax per expert.
    """

    quads_block_2d: bool = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_reduction_dim(self.config.hidden_size, "FakeQuantGroupedMLP fc1 (hidden size)")
        ffn_per_rank = self.config.moe_ffn_hidden_size // self.tp_group.size()
        check_reduction_dim(ffn_per_rank, "FakeQuantGroupedMLP fc2 (moe_ffn_hidden_size per expert-TP rank)")
        self._cache_fc1 = QuantizedWeightCache()
        self._cache_fc2 = QuantizedWeightCache()

    def fake_quant_caches(self) -> list[QuantizedWeightCache]:
        """The caches :func:`invalidate_fake_quant_caches` clears after an optimizer step."""
        return [self._cache_fc1, self._cache_fc2]

    def _fake_quant_along_dim1(self, w: torch.Tensor, experts_view: tuple[int, int, int]) -> torch.Tensor:
        # GroupedMLP views weight1 as [E, hidden, 2*ffn] and weight2 as [E, ffn, hidden]: in both the
        # reduction dimension is dim 1, so quantize the [E, b, a] transpose along a and transpose back
        per_expert = w.view(experts_view).transpose(1, 2)
        quantized = fake_quant_stacked_experts(per_expert, self.tp_group, block_2d=self.quads_block_2d)
        return quantized.transpose(1, 2).contiguous().view(w.shape)

    def quantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached fake-quantized (weight1, weight2)."""
        experts, hidden = self.num_local_experts, self.config.hidden_size
        (q1,) = self._cache_fc1.get([self.weight1], lambda ws: [self._fake_quant_along_dim1(ws[0], (experts, hidden, -1))])
        (q2,) = self._cache_fc2.get([self.weight2], lambda ws: [self._fake_quant_along_dim1(ws[0], (experts, -1, hidden))])
        return q1, q2

    def forward(self, *args, **kwargs):  # noqa: D102 (the stock forward on fake-quantized weights)
        q1, q2 = self.quantized_weights()
        replacements = {
            "weight1": straight_through(self.weight1, q1),
            "weight2": straight_through(self.weight2, q2),
        }
        with swapped_parameters(self, replacements):
            return super().forward(*args, **kwargs)
