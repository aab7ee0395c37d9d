"""A MoE layer's routed experts as stacks, quantized once per projection on their own device.

A stack holds experts ``[first, first + n)`` of one layer's projection in high precision:
``gate_up [n, 2I, H]`` (each expert's gate rows, then its up rows) or ``down [n, H, I]``.
:func:`quantize_stack` turns one into a :class:`StackedLinearWeight`: the fields
of :class:`~megatron_quads.rollout.quantized_linear.QuantizedLinearWeight` with a leading expert dimension.
It is byte for byte what :func:`~megatron_quads.rollout.quantize_model.quantize_hf_weights` makes expert by
expert (one global amax per expert, gate and up sharing it; ``W_S`` re-blocked from ``q(W)``), but
every step is a batched tensor operation on the device: no host synchronisation per expert.
Problems that need a value look (non-finite weights) are gathered in a :class:`DeferredChecks` and
raised once for the whole export.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from megatron_quads.nvfp4.reblock import reblock_columns_deferred
from megatron_quads.nvfp4.stacked import quantize_experts
from megatron_quads.rollout.quantized_linear import QuantizedLinearWeight

_FP8 = torch.float8_e4m3fn
_PACKED_BLOCK = BLOCK_SIZE // 2
_SMALL_FLAGS = 4096  # flags up to this many elements are kept whole until the one read-back


@dataclass
class DeferredChecks:
    """Device-side failure flags, read back once (:meth:`raise_if_failed`); ``hint`` says how to fix."""

    hint: str = ("NVFP4 has no encoding for NaN or Inf: find where they come from upstream (the optimizer step, a "
                 "loaded checkpoint)")
    flags: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    finite: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def add(self, what: str, failed: torch.Tensor) -> None:
        """Record a boolean tensor that is True where ``what`` failed (small ones are kept as they are,
        so recording launches nothing)."""
        flat = failed.reshape(-1)
        self.flags.append((what, flat if flat.numel() <= _SMALL_FLAGS else flat.any().reshape(1)))

    def add_finite(self, what: str, values: torch.Tensor) -> None:
        """Record a small float tensor that ``what`` needs finite (checked with the others of its kind
        in one launch by :meth:`raise_if_failed`)."""
        self.finite.append((what, values.reshape(-1).to(torch.float32)))

    def raise_if_failed(self) -> None:
        """Raise ValueError naming every recorded failure (one host synchronisation)."""
        if self.finite:
            finite, self.finite = self.finite, []
            bad = ~torch.isfinite(torch.cat([v for _, v in finite]))
            for (what, v), part in zip(finite, bad.split([v.numel() for _, v in finite]), strict=True):
                self.flags.append((what, part))
        if not self.flags:
            return
        flags, self.flags = self.flags, []
        failed = torch.cat([f for _, f in flags]).cpu()
        bad, start = [], 0
        for what, f in flags:
            if bool(failed[start : start + f.numel()].any()):
                bad.append(what)
            start += f.numel()
        if bad:
            raise ValueError(f"{len(bad)} check(s) failed: {', '.join(bad[:3])}; {self.hint}")


@dataclass(frozen=True, eq=False)
class StackedLinearWeight:
    """NVFP4-plus-residual weights of ``n`` experts' same projection ``[N, K]``.

    Fields as :class:`QuantizedLinearWeight` with a leading expert dimension: ``weight`` uint8
    ``[n, N, K/2]``, ``weight_scale`` e4m3 ``[n, N, K/16]``, ``weight_scale_2`` fp32 ``[n]``,
    ``residual_channels`` int32 ``[n, |S|]``, ``residual_weight`` uint8 ``[n, N, |S|/2]``,
    ``residual_weight_scale`` e4m3 ``[n, N, |S|/16]``.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    residual_channels: torch.Tensor
    residual_weight: torch.Tensor
    residual_weight_scale: torch.Tensor

    FIELDS = ("weight", "weight_scale", "weight_scale_2", "residual_channels", "residual_weight", "residual_weight_scale")

    def __post_init__(self) -> None:
        """Check dtypes and shapes (no value is read: no host synchronisation)."""
        check_stack_fields({f: getattr(self, f) for f in self.FIELDS}, "")

    @property
    def num_experts(self) -> int:
        """n."""
        return self.weight.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name."""
        return {f: getattr(self, f) for f in self.FIELDS}

    def expert_linears(self, row_parts: int = 1) -> list[list[QuantizedLinearWeight]]:
        """Per expert, its rows cut into ``row_parts`` equal parts (gate_up: 2, gate then up), each a
        :class:`QuantizedLinearWeight` of views (one ``unbind`` per field, not an index per expert)."""
        by_field = {}
        for name in ("weight", "weight_scale", "residual_weight", "residual_weight_scale"):
            by_field[name] = [part.unbind(0) for part in getattr(self, name).chunk(row_parts, dim=1)]
        decodes, channels = self.weight_scale_2.unbind(0), self.residual_channels.unbind(0)
        return [
            [QuantizedLinearWeight.from_checked_fields(
                weight=by_field["weight"][p][e], weight_scale=by_field["weight_scale"][p][e], weight_scale_2=decodes[e],
                residual_channels=channels[e], residual_weight=by_field["residual_weight"][p][e],
                residual_weight_scale=by_field["residual_weight_scale"][p][e])
             for p in range(row_parts)]
            for e in range(self.num_experts)
        ]


_STACK_DTYPES = {
    "weight": torch.uint8,
    "weight_scale": _FP8,
    "weight_scale_2": torch.float32,
    "residual_channels": torch.int32,
    "residual_weight": torch.uint8,
    "residual_weight_scale": _FP8,
}


def check_stack_fields(fields: dict[str, torch.Tensor], prefix: str,
                       names: tuple[str, ...] = StackedLinearWeight.FIELDS) -> None:
    """Raise ValueError naming ``<prefix><field>`` unless the stacked fields ``names`` (all by default)
    are there and their dtypes, shapes and devices fit together (values are not read)."""
    for name, dtype in _STACK_DTYPES.items():
        if name not in names:
            continue
        t = fields.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"missing tensor '{prefix}{name}' of a stacked expert projection")
        if t.dtype != dtype:
            raise ValueError(f"'{prefix}{name}' has dtype {t.dtype}; a stacked expert projection needs {dtype}")
    w = fields["weight"]
    if w.ndim != 3 or 0 in w.shape or w.shape[2] % _PACKED_BLOCK:
        raise ValueError(f"'{prefix}weight' has shape {tuple(w.shape)}; expected uint8 [experts, N, K/2] with K a multiple of 16")
    n, rows, k = w.shape[0], w.shape[1], 2 * w.shape[2]
    s = fields["residual_channels"].shape[-1] if fields["residual_channels"].ndim == 2 else -1
    expected = {
        "weight_scale": (n, rows, k // BLOCK_SIZE),
        "weight_scale_2": (n,),
        "residual_channels": (n, s),
        "residual_weight": (n, rows, s // 2),
        "residual_weight_scale": (n, rows, s // BLOCK_SIZE),
    }
    for name, shape in expected.items():
        if name not in names:
            continue
        if tuple(fields[name].shape) != shape or s < 0 or s % BLOCK_SIZE or s > k:
            raise ValueError(
                f"'{prefix}{name}' has shape {tuple(fields[name].shape)}; expected {shape} for weight "
                f"{tuple(w.shape)} and residual_channels [experts, |S|] with |S| a multiple of 16 and at most K={k}"
            )
    devices = {fields[name].device for name in names}
    if len(devices) > 1:
        raise ValueError(f"'{prefix}*' tensors live on different devices {sorted(map(str, devices))}; move them to one")


def expert_amax(weight: torch.Tensor) -> torch.Tensor:
    """``max |w|`` of each expert of a ``[n, N, K]`` stack, fp32 ``[n]`` (exact: a max is not rounded;
    NaN where an expert holds one)."""
    from megatron_quads.nvfp4.backend import use_kernels

    if use_kernels(weight):
        from megatron_quads.nvfp4.quantize_kernel import leading_amax_kernel

        return leading_amax_kernel(weight)
    return torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), ord=float("inf"), dim=1).to(torch.float32)


def reblock_stack(weight: NVFP4Tensor, channels: torch.Tensor,
                  checks: DeferredChecks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_S`` ``(codes uint8 [n, N, |S|/2], scales e4m3 [n, N, |S|/16])`` of every expert of a stacked
    ``[n, N, K]`` NVFP4 weight for channels ``[n, |S|]`` (sorted and unique per expert: the stack's
    producer guarantees it), by :func:`megatron_quads.nvfp4.reblock.reblock_columns_deferred`; a
    ``weight_scale_2`` without an fp32 amax is recorded in ``checks`` (no host read here)."""
    residual, no_amax = reblock_columns_deferred(weight, channels)
    if checks is not None and channels.shape[1]:
        checks.add("a weight_scale_2 that is not amax / 2688 for any fp32 amax", no_amax)
    return residual.codes, residual.scales


def _check_stack(weight: torch.Tensor, what: str) -> None:
    if weight.ndim != 3 or weight.shape[2] % BLOCK_SIZE or not weight.is_floating_point():
        raise ValueError(f"{what}: a stack is a floating-point [experts, N, K] tensor with K a multiple of 16, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


def _stack_weight(weight: torch.Tensor, q: NVFP4Tensor, amax: torch.Tensor, channels: torch.Tensor | None,
                  checks: DeferredChecks | None, what: str) -> StackedLinearWeight:
    """The :class:`StackedLinearWeight` of ``weight`` from its quantization ``q`` with per-expert ``amax``."""
    n, rows, k = weight.shape
    if checks is not None:
        checks.add_finite(f"{what} (NaN or Inf weights)", amax)
    ws2 = q.weight_scale_2.reshape(n)
    if channels is None:
        channels = torch.zeros(n, 0, dtype=torch.int32, device=weight.device)
    if channels.ndim != 2 or channels.shape[0] != n:
        raise ValueError(f"{what}: residual channels must be [experts={n}, |S|], got {tuple(channels.shape)}")
    stacked = NVFP4Tensor(codes=q.codes, scales=q.scales, weight_scale_2=ws2, shape=torch.Size((n, rows, k)),
                          dtype=torch.float32)
    residual, residual_scales = reblock_stack(stacked, channels, checks)
    return StackedLinearWeight(q.codes, q.scales.view(_FP8), ws2, channels.to(device=weight.device, dtype=torch.int32),
                               residual, residual_scales)


def _quantize_with_next_amax(weight: torch.Tensor, amax: torch.Tensor, following: torch.Tensor | None,
                             what: str) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """``weight`` quantized with its per-expert ``amax``, and the per-expert amax of ``following`` (on
    CUDA in one launch: the amax streams memory while the quantization computes)."""
    from megatron_quads.nvfp4.backend import use_kernels

    if following is not None and use_kernels(weight, following) and following.device == weight.device:
        from megatron_quads.nvfp4.quantize_kernel import quantize_stack_and_amax

        return quantize_stack_and_amax(weight, amax, following)
    try:
        q = quantize_experts(weight, amax)
    except ValueError as err:  # the reference path checks values itself
        raise ValueError(f"{what}: {err}") from err
    return q, None if following is None else expert_amax(following)


class StackQuantizer:
    """Quantizes stacks in the order they are added, each as :func:`quantize_stack` does, holding one
    back: a stack is quantized when the next one arrives (or at :meth:`finish`), together with the
    next one's per-expert amax, so on CUDA each launch keeps the SMs and DRAM busy at once."""

    def __init__(self, checks: DeferredChecks | None = None) -> None:
        self.checks = checks
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str, object] | None = None

    def add(self, weight: torch.Tensor, channels: torch.Tensor | None = None, what: str = "expert stack",
            key: object = None) -> list[tuple[object, StackedLinearWeight]]:
        """Queue ``weight`` (``[n, N, K]``, channels as :func:`quantize_stack`); returns the stacks this
        completes as ``(key, stack)``."""
        _check_stack(weight, what)
        if self._pending is None:
            self._pending = (weight, expert_amax(weight), channels, what, key)
            return []
        done = self._complete(weight)
        self._pending = (weight, done[1], channels, what, key)
        return [done[0]]

    def finish(self) -> list[tuple[object, StackedLinearWeight]]:
        """Quantize the stack still held back; returns it as ``[(key, stack)]`` (empty if none)."""
        if self._pending is None:
            return []
        done = self._complete(None)
        self._pending = None
        return [done[0]]

    def _complete(self, following: torch.Tensor | None) -> tuple[tuple[object, StackedLinearWeight], torch.Tensor | None]:
        weight, amax, channels, what, key = self._pending
        q, next_amax = _quantize_with_next_amax(weight, amax, following, what)
        return (key, _stack_weight(weight, q, amax, channels, self.checks, what)), next_amax


def quantize_stack(
    weight: torch.Tensor,
    channels: torch.Tensor | None = None,
    checks: DeferredChecks | None = None,
    what: str = "expert stack",
) -> StackedLinearWeight:
    """NVFP4-plus-residual weights of a high-precision ``[n, N, K]`` stack, one global amax per
    expert; ``channels`` ``[n, |S|]`` (sorted, unique per expert; None: no residual) give ``W_S``.

    Non-finite weights are flagged in ``checks`` (raised by :meth:`DeferredChecks.raise_if_failed`).
    """
    quantizer = StackQuantizer(checks)
    quantizer.add(weight, channels, what)
    return quantizer.finish()[0][1]


def rebuild_residual(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     residual_channels: torch.Tensor, checks: DeferredChecks | None = None) -> StackedLinearWeight:
    """The stack of ``q(W)`` fields and channels ``[n, |S|]`` (sorted and unique per expert, inside
    ``[0, K)``: the caller checks them first) with ``W_S`` re-blocked from ``q(W)`` on its device."""
    n, rows, kh = weight.shape
    stacked = NVFP4Tensor(codes=weight, scales=weight_scale, weight_scale_2=weight_scale_2,
                          shape=torch.Size((n, rows, 2 * kh)), dtype=torch.float32)
    channels = residual_channels.to(device=weight.device, dtype=torch.int32)
    residual, residual_scales = reblock_stack(stacked, channels, checks)
    return StackedLinearWeight(weight, weight_scale, weight_scale_2, channels, residual, residual_scales)
