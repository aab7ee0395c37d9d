"""An MoE layer's routed experts as grouped NVFP4 GEMMs: tokens sorted by expert, one call per projection.

:class:`~megatron_quads.rollout.hf_experts.PerExpertLinears` loops over experts (one gather, two
linears and a host-synchronising ``torch.where`` each), which is what hooks and calibration need.
For generation in an NVFP4 precision the built-in engine attaches a :class:`GroupedExperts` instead:
the routed copies of the tokens are sorted by expert once, and each projection is one
:func:`~megatron_quads.rollout.grouped.grouped_w4a16_linear` (``w4a16``) or
:func:`~megatron_quads.rollout.grouped.grouped_rac_linear` (``w4a4``, ``quads``) call, which on CUDA
is one Triton launch. The stacks, and the RAC tails in the form the kernel takes on their device,
are built when the weights load or move (:meth:`GroupedProjection.prepare`), never in a forward.
Per expert the arithmetic is the per-expert path's (the same reference functions, which take a
widened tail as the same product), and each token's expert outputs are summed in the same (expert)
order. Where the W4A16 kernel runs on enough rows per expert, the tokens' rows are put in its K
order before the gather (:func:`~megatron_quads.rollout.grouped.kernel_x_order`), which saves the
kernel reordering x, and gate/up writes the down projection's input in it. The routing
(:func:`~megatron_quads.rollout.grouped.route_by_expert`) and the combine
(:func:`~megatron_quads.rollout.grouped.combine_routed_rows`: each token's rows summed in expert
order) are Triton kernels on CUDA too, so a forward has no host sync and captures into a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from megatron_quads.nvfp4.stacked import expert_weights, stack_experts
from megatron_quads.precision import Precision
from megatron_quads.rollout.grouped import (
    combine_routed_rows,
    grouped_rac_linear,
    grouped_w4a16_linear,
    kernel_x_order,
    prepare_grouped_rac_tail,
    route_by_expert,
)
from megatron_quads.rollout.precision import LinearState


@dataclass
class GroupedProjection:
    """One projection (gate_up or down) of every expert of a layer, under one precision: the stacked
    weight and, for ``quads``, the stacked RAC tail (``channels [E, S]``, ``residual [E, N, S]``).

    Built from the experts' states by :meth:`from_states`, which stacks them and runs :meth:`prepare`:
    the tail is put in the form the grouped GEMM takes on the stacks' device (it may come out wider
    than the S channels chosen, which adds zeros to the product) and each expert's state is pointed
    at its slice of the stacks, so weights are held once (``num_channels``: the channels chosen per
    expert, a prepared tail's first ones). :meth:`to` moves the stacks and prepares them again;
    calling the projection only computes."""

    precision: Precision
    weight: NVFP4Tensor
    channels: torch.Tensor | None = None
    residual: NVFP4Tensor | None = None
    states: Sequence[LinearState] = ()

    def __post_init__(self) -> None:
        # the channels chosen per expert: a prepared tail's first num_channels columns
        self.num_channels = 0 if self.channels is None else self.channels.shape[1]

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor, x_mma_order: bool = False,
                 y_mma_order: bool = False) -> torch.Tensor:
        """The projection of ``x [T, K]``, rows sorted by expert as ``offsets [E + 1]`` says
        (``x_mma_order``: rows in the W4A16 kernel's K order, from :meth:`input_order`;
        ``y_mma_order``: the output's rows written in it)."""
        if not self.precision.quantized_activations:
            return grouped_w4a16_linear(x, self.weight, offsets, x_mma_order, y_mma_order)
        if x_mma_order or y_mma_order:
            raise ValueError(f"only the w4a16 projection works in the kernel's K order, not {self.precision.kind!r}")
        return grouped_rac_linear(x, self.weight, offsets, self.channels, self.residual)

    def input_order(self, x: torch.Tensor, rows_per_expert: float) -> int | None:
        """The K-order block this projection wants its input in (:func:`kernel_x_order`; ``x`` gives
        the device and dtype, the weight K), ``None`` for natural."""
        if self.precision.quantized_activations:
            return None
        return kernel_x_order(x, rows_per_expert, in_features=self.weight.shape[-1])

    def prepare(self) -> None:
        """The tail as the grouped GEMM takes it on the stacks' device
        (:func:`prepare_grouped_rac_tail` of the chosen channels), and the states viewing the stacks."""
        if self.residual is not None:
            channels, residual = self._chosen_tail()
            self.channels, self.residual = prepare_grouped_rac_tail(channels, residual, self.weight.shape[-1])
        self.view_states()

    def _chosen_tail(self) -> tuple[torch.Tensor, NVFP4Tensor]:
        """The tail's first :attr:`num_channels` columns (itself where it has no more)."""
        assert self.channels is not None and self.residual is not None
        if self.channels.shape[1] == self.num_channels:
            return self.channels, self.residual
        return self.channels[:, : self.num_channels].contiguous(), _leading_columns(self.residual, self.num_channels, copy=True)

    def view_states(self) -> None:
        """Point each expert's state at its slice of the stacks (of the tail: its chosen columns); a
        projection without states (the vLLM plugin's) has nothing to point."""
        if not self.states:
            return
        ratio = self.precision.ratio
        for state, expert in zip(self.states, expert_weights(self.weight), strict=True):
            state.quantized = expert
        if self.residual is not None:
            tails = zip(self.channels[:, : self.num_channels].unbind(0),
                        expert_weights(_leading_columns(self.residual, self.num_channels)), strict=True)
            for state, (channels, residual) in zip(self.states, tails, strict=True):
                state.channels[ratio], state.residual[ratio] = channels, residual
        elif self.precision.uses_rac:  # no tail: no channels, on the stacks' device
            no_channels = torch.zeros(0, dtype=torch.int32, device=self.weight.codes.device)
            for state in self.states:
                state.channels[ratio], state.residual[ratio] = no_channels, None

    def to(self, device: torch.device) -> None:
        """Move the stacks (one copy each, not one per expert) and prepare them for ``device``."""
        self.weight = self.weight.to(device)
        if self.residual is not None:
            channels, residual = self._chosen_tail()
            self.channels, self.residual = channels.to(device), residual.to(device)
        self.prepare()

    @classmethod
    def from_states(cls, states: Sequence[LinearState], precision: Precision) -> GroupedProjection | None:
        """The prepared projection of the experts' states (which then view its stacks); ``None``
        where the experts' RAC channel counts differ."""
        channels = residual = None
        if precision.uses_rac:
            chosen = [s.channels.get(precision.ratio) for s in states]
            counts = {0 if c is None else c.numel() for c in chosen}
            if len(counts) != 1:
                return None
            if counts.pop():
                channels = torch.stack([c.to(torch.int32) for c in chosen]).to(states[0].quantized.codes.device)
                residual = stack_experts([s.residual[precision.ratio] for s in states])
        projection = cls(precision, stack_experts([s.quantized for s in states]), channels, residual, list(states))
        projection.prepare()
        return projection


def _leading_columns(t: NVFP4Tensor, count: int, copy: bool = False) -> NVFP4Tensor:
    """The first ``count`` columns (a multiple of 16) of an NVFP4 tensor: a view, or with ``copy`` contiguous."""
    if t.shape[-1] == count:
        return t
    codes, scales = t.codes[..., : count // 2], t.scales[..., : count // BLOCK_SIZE]
    if copy:
        codes, scales = codes.contiguous(), scales.contiguous()
    return replace(t, codes=codes, scales=scales, shape=torch.Size((*t.shape[:-1], count)))


class GroupedExperts:
    """Forward of a :class:`PerExpertLinears` layer with grouped projections (see module docstring)."""

    def __init__(self, gate_up: GroupedProjection, down: GroupedProjection) -> None:
        self.gate_up = gate_up
        self.down = down
        self.num_experts = gate_up.weight.shape[0]

    @property
    def states(self) -> list[LinearState]:
        """The experts' states of both projections (they view this layer's stacks)."""
        return [*self.gate_up.states, *self.down.states]

    def to(self, device: torch.device) -> None:
        """Move both projections' stacks to ``device``."""
        self.gate_up.to(device)
        self.down.to(device)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Weighted sum over each token's selected experts of ``down(act(gate) * up)``."""
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order, offsets = route_by_expert(flat, self.num_experts)  # by expert, then token: the per-expert loop's order
        token_idx = order // top_k
        rows_per_expert = flat.numel() / self.num_experts
        block_k = self.gate_up.input_order(hidden_states, rows_per_expert)
        source = hidden_states
        if block_k is not None:  # the tokens' rows in the kernel's K order once, before the gather copies them top-k times
            from megatron_quads.kernels.w4a16 import mma_k_order_rows

            source = mma_k_order_rows(hidden_states, block_k)
        down_order = self._down_input_in_kernel_order(hidden_states, rows_per_expert)
        gate, up = self.gate_up(source[token_idx], offsets, block_k is not None, down_order).chunk(2, dim=-1)
        y = self.down(act_fn(gate) * up, offsets, down_order)
        return combine_routed_rows(y, order, top_k_weights.reshape(-1, top_k), hidden_states.dtype)

    def _down_input_in_kernel_order(self, hidden_states: torch.Tensor, rows_per_expert: float) -> bool:
        """Whether gate/up writes its output in the down kernel's K order: ``act(gate) * up`` is
        elementwise, so with gate and up each in whole K-order blocks it comes out in that order."""
        block_k = self.down.input_order(hidden_states, rows_per_expert)
        return (block_k is not None and not self.gate_up.precision.quantized_activations
                and self.gate_up.weight.shape[1] % (2 * block_k) == 0)

    @classmethod
    def from_states(cls, gate_up: Sequence[LinearState], down: Sequence[LinearState],
                    precision: Precision) -> GroupedExperts | None:
        """Grouped projections of one layer, or ``None`` if either cannot be grouped."""
        grouped_gate_up = GroupedProjection.from_states(gate_up, precision)
        grouped_down = GroupedProjection.from_states(down, precision)
        if grouped_gate_up is None or grouped_down is None:
            return None
        return cls(grouped_gate_up, grouped_down)
