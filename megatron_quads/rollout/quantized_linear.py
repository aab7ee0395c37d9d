"""One linear's NVFP4-plus-residual weights: :class:`QuantizedLinearWeight`, the record a rollout
engine holds for a QUADS W4A4 + RAC linear, and the rules its fields obey.

A quantized linear stores ModelOpt's NVFP4 fields (``weight``, ``weight_scale``, ``weight_scale_2``,
``input_scale``) plus the Residual Activation Compensation (RAC) fields: the input channels S whose
activation residual gets a second NVFP4 pass, and ``W_S``, the columns S of the quantized weight
re-blocked into 1x16 NVFP4 blocks with the same global scale (``nvfp4.reblock``), so the rollout GEMM
is one W4A4 GEMM over an augmented reduction dimension: ``[q(x), q(r_S)] @ [q(W), W_S]^T``.
docs/format.md is the schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_quads.nvfp4 import BLOCK_SIZE, NVFP4Tensor, decode_scale_from_amax, dequantize, quantize
from megatron_quads.nvfp4.metrics import relative_error
from megatron_quads.nvfp4.reblock import check_channels, reblock_columns
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.stored_scales import invalid_block_scales, invalid_decode_scales

ChannelsLike = torch.Tensor | Sequence[int]
ScaleLike = torch.Tensor | float

_FP8 = torch.float8_e4m3fn
_PACKED_BLOCK = BLOCK_SIZE // 2  # bytes of packed codes per 16-element block

FIELD_SPECS = {
    fmt.WEIGHT: "uint8 [N, K/2] packed E2M1 codes",
    fmt.WEIGHT_SCALE: "float8_e4m3fn [N, K/16] block scales",
    fmt.WEIGHT_SCALE_2: "float32 0-dim scalar, amax / 2688",
    fmt.INPUT_SCALE: "float32 0-dim scalar, activation amax / 2688",
    fmt.RESIDUAL_CHANNELS: "int32 [|S|] sorted residual input channels",
    fmt.RESIDUAL_WEIGHT: "uint8 [N, |S|/2] packed codes of W_S",
    fmt.RESIDUAL_WEIGHT_SCALE: "float8_e4m3fn [N, |S|/16] block scales of W_S",
}
"""What each stored field of a quantized linear is, by field name (quoted in error messages)."""


# --------------------------------------------------------------------------------------------------
# field validation (shared by the dataclass and the checkpoint loader, which passes a name prefix)


def _require_tensor(value: Any, leaf: str, prefix: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{leaf} must be a torch.Tensor ({FIELD_SPECS[leaf]}), got {type(value).__name__}")
    return value


def _check_dtype(t: torch.Tensor, leaf: str, prefix: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{prefix}{leaf} has dtype {t.dtype}; expected {FIELD_SPECS[leaf]}")


def _check_shape(t: torch.Tensor, leaf: str, prefix: str, shape: tuple[int, ...], because: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{prefix}{leaf} has shape {tuple(t.shape)}; expected {shape} ({FIELD_SPECS[leaf]}) {because}")


def _check_scale_bytes(t: torch.Tensor, leaf: str, prefix: str) -> None:
    """E4M3 block scales must be finite and non-negative: no NaN byte (0x7F/0xFF), no sign bit."""
    if not t.numel():
        return
    bad = invalid_block_scales(t)
    if bool(bad.any()):
        count = int(bad.sum())
        raise ValueError(
            f"{prefix}{leaf} holds {count} negative or NaN block scales; NVFP4 block scales are finite and >= 0: "
            "the tensor is damaged or was not produced by an NVFP4 quantizer"
        )


def _check_scalar(t: torch.Tensor, leaf: str, prefix: str, positive: bool) -> None:
    _check_dtype(t, leaf, prefix, torch.float32)
    if t.ndim != 0:
        raise ValueError(f"{prefix}{leaf} has shape {tuple(t.shape)}; expected {FIELD_SPECS[leaf]} (shape ())")
    value = float(t)
    if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{prefix}{leaf} is {value}; expected a finite value {bound}")


def _check_linear_fields(
    weight: Any,
    weight_scale: Any,
    weight_scale_2: Any,
    input_scale: Any,
    residual_channels: Any,
    residual_weight: Any,
    residual_weight_scale: Any,
    prefix: str = "",
) -> None:
    """Check the fields of one quantized linear; errors name the field as ``<prefix><field>``."""
    w = _require_tensor(weight, fmt.WEIGHT, prefix)
    _check_dtype(w, fmt.WEIGHT, prefix, torch.uint8)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1 or w.shape[1] % _PACKED_BLOCK:
        raise ValueError(
            f"{prefix}weight has shape {tuple(w.shape)}; expected {FIELD_SPECS[fmt.WEIGHT]} with N >= 1 and K a "
            f"positive multiple of {BLOCK_SIZE} (so K/2 a multiple of {_PACKED_BLOCK})"
        )
    n, k = w.shape[0], 2 * w.shape[1]
    of_weight = f"for {prefix}weight of shape {tuple(w.shape)} (N={n}, K={k})"
    ws = _require_tensor(weight_scale, fmt.WEIGHT_SCALE, prefix)
    _check_dtype(ws, fmt.WEIGHT_SCALE, prefix, _FP8)
    _check_shape(ws, fmt.WEIGHT_SCALE, prefix, (n, k // BLOCK_SIZE), of_weight)
    _check_scalar(_require_tensor(weight_scale_2, fmt.WEIGHT_SCALE_2, prefix), fmt.WEIGHT_SCALE_2, prefix, False)
    if input_scale is not None:
        _check_scalar(_require_tensor(input_scale, fmt.INPUT_SCALE, prefix), fmt.INPUT_SCALE, prefix, True)
    ch = _require_tensor(residual_channels, fmt.RESIDUAL_CHANNELS, prefix)
    _check_dtype(ch, fmt.RESIDUAL_CHANNELS, prefix, torch.int32)
    if ch.ndim != 1:
        raise ValueError(f"{prefix}residual_channels has shape {tuple(ch.shape)}; expected a 1-D int32 tensor")
    check_channels(ch, k, f"{prefix}residual_channels")
    s = ch.numel()
    of_channels = f"for {s} residual channels and N={n} (from {prefix}weight {tuple(w.shape)})"
    rw = _require_tensor(residual_weight, fmt.RESIDUAL_WEIGHT, prefix)
    _check_dtype(rw, fmt.RESIDUAL_WEIGHT, prefix, torch.uint8)
    _check_shape(rw, fmt.RESIDUAL_WEIGHT, prefix, (n, s // 2), of_channels)
    rs = _require_tensor(residual_weight_scale, fmt.RESIDUAL_WEIGHT_SCALE, prefix)
    _check_dtype(rs, fmt.RESIDUAL_WEIGHT_SCALE, prefix, _FP8)
    _check_shape(rs, fmt.RESIDUAL_WEIGHT_SCALE, prefix, (n, s // BLOCK_SIZE), of_channels)
    _check_scale_bytes(ws, fmt.WEIGHT_SCALE, prefix)
    _check_scale_bytes(rs, fmt.RESIDUAL_WEIGHT_SCALE, prefix)
    if bool(invalid_decode_scales(weight_scale_2, ws.view(torch.uint8).ne(0).any())):
        raise ValueError(
            f"{prefix}weight_scale_2 is 0 but {prefix}weight_scale holds non-zero block scales: the weight would "
            "decode to zeros (only an all-zero weight has weight_scale_2 = 0); the checkpoint is damaged: re-export it"
        )
    devices = {t.device for t in (w, ws, weight_scale_2, ch, rw, rs)}
    if input_scale is not None:
        devices.add(input_scale.device)
    if len(devices) > 1:
        raise ValueError(f"{prefix}* tensors live on different devices {sorted(map(str, devices))}; move them to one")


# --------------------------------------------------------------------------------------------------
# helpers


def as_residual_channels(channels: ChannelsLike | None, in_features: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Validate a channel set (any integer tensor or sequence) and return it as int32 on ``device``."""
    if channels is None:
        return torch.zeros(0, dtype=torch.int32, device=device)
    ch = channels if isinstance(channels, torch.Tensor) else torch.as_tensor(list(channels), dtype=torch.int64)
    check_channels(ch, in_features, "residual channels")
    return ch.to(device=device, dtype=torch.int32)


def input_scale_from_amax(amax: ScaleLike) -> torch.Tensor:
    """ModelOpt's static activation scale ``input_scale = amax / 2688`` (fp32 0-dim)."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if a.numel() != 1 or not bool(torch.isfinite(a).all()) or float(a) <= 0:
        raise ValueError(f"activation amax must be one finite value > 0, got {a}")
    return decode_scale_from_amax(a.reshape(()))


# --------------------------------------------------------------------------------------------------
# one linear


@dataclass(frozen=True, eq=False)
class QuantizedLinearWeight:
    """One NVFP4 linear weight ``[N, K]`` with its RAC residual columns (ModelOpt field names).

    Attributes:
        weight: uint8 ``[N, K/2]`` packed E2M1 codes (element 2i in the low nibble).
        weight_scale: float8_e4m3fn ``[N, K/16]`` block scales, linear (row-major) layout.
        weight_scale_2: fp32 0-dim per-tensor decode scale ``amax / 2688``.
        input_scale: fp32 0-dim static activation scale ``act_amax / 2688``, or None (dynamic).
        residual_channels: int32 ``[|S|]`` sorted unique input channels, ``|S|`` a multiple of 16
            (``None`` on construction means none).
        residual_weight: uint8 ``[N, |S|/2]`` packed codes of ``W_S``.
        residual_weight_scale: float8_e4m3fn ``[N, |S|/16]`` block scales of ``W_S``; ``W_S``
            shares ``weight_scale_2``.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor | None = None
    residual_channels: torch.Tensor | None = None
    residual_weight: torch.Tensor | None = None
    residual_weight_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Fill empty residual fields when there are no channels, then validate every field."""
        if self.residual_channels is None and self.residual_weight is None and self.residual_weight_scale is None:
            device = self.weight.device if isinstance(self.weight, torch.Tensor) else "cpu"
            rows = self.weight.shape[0] if isinstance(self.weight, torch.Tensor) and self.weight.ndim else 0
            object.__setattr__(self, "residual_channels", torch.zeros(0, dtype=torch.int32, device=device))
            object.__setattr__(self, "residual_weight", torch.zeros(rows, 0, dtype=torch.uint8, device=device))
            object.__setattr__(self, "residual_weight_scale", torch.zeros(rows, 0, dtype=_FP8, device=device))
        self.validate()

    def validate(self, prefix: str = "") -> None:
        """Raise ValueError naming ``<prefix><field>`` and the shapes if any field is inconsistent."""
        _check_linear_fields(
            self.weight,
            self.weight_scale,
            self.weight_scale_2,
            self.input_scale,
            self.residual_channels,
            self.residual_weight,
            self.residual_weight_scale,
            prefix,
        )

    @classmethod
    def from_weight(
        cls,
        w: torch.Tensor,
        residual_channels: ChannelsLike | None = None,
        global_amax: float | torch.Tensor | None = None,
        input_scale: ScaleLike | None = None,
    ) -> QuantizedLinearWeight:
        """Quantize a high-precision ``[N, K]`` weight (via ``megatron_quads.nvfp4``) and build ``W_S``.

        ``global_amax`` overrides ``max |w|`` so fused siblings (gate/up, q/k/v) share one scale.
        """
        if not isinstance(w, torch.Tensor) or w.ndim != 2:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"from_weight expects a 2-D [out_features, in_features] weight, got {shape}")
        if global_amax is not None:
            amax = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device)
            if amax.numel() != 1:
                raise ValueError(f"a linear weight has one global amax; got global_amax of shape {tuple(amax.shape)}")
            global_amax = amax.reshape(())
        q = quantize(w, global_amax=global_amax)
        channels = as_residual_channels(residual_channels, w.shape[1], w.device)
        scale = None if input_scale is None else torch.as_tensor(input_scale, dtype=torch.float32, device=w.device)
        base = cls(weight=q.codes, weight_scale=q.scales, weight_scale_2=q.weight_scale_2.reshape(()), input_scale=scale)
        return base.with_residual_channels(channels)

    @classmethod
    def from_checked_fields(cls, **fields: torch.Tensor | None) -> QuantizedLinearWeight:
        """Build from fields that were already checked (as part of a checked stack of experts,
        ``expert_stacks.StackedLinearWeight``) without reading any value again."""
        linear = object.__new__(cls)
        for name in cls.__dataclass_fields__:
            object.__setattr__(linear, name, fields.get(name))
        return linear

    @property
    def out_features(self) -> int:
        """N, the number of output features (rows)."""
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        """K, the number of input features (the reduction dimension)."""
        return 2 * self.weight.shape[1]

    @property
    def num_residual_channels(self) -> int:
        """``|S|``."""
        return self.residual_channels.numel()

    @property
    def device(self) -> torch.device:
        """Device of the stored tensors."""
        return self.weight.device

    def to_nvfp4(self, dtype: torch.dtype = torch.bfloat16) -> NVFP4Tensor:
        """The main weight ``q(W)`` as an :class:`NVFP4Tensor` (``dtype``: its default dequantize dtype)."""
        return NVFP4Tensor(
            codes=self.weight,
            scales=self.weight_scale,
            weight_scale_2=self.weight_scale_2,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=dtype,
        )

    def residual_to_nvfp4(self, dtype: torch.dtype = torch.bfloat16) -> NVFP4Tensor | None:
        """``W_S`` as an :class:`NVFP4Tensor` ``[N, |S|]`` sharing ``weight_scale_2``; None when S is empty."""
        if not self.num_residual_channels:
            return None
        return NVFP4Tensor(
            codes=self.residual_weight,
            scales=self.residual_weight_scale,
            weight_scale_2=self.weight_scale_2,
            shape=torch.Size((self.out_features, self.num_residual_channels)),
            dtype=dtype,
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``dq(q(W))`` ``[N, K]`` in ``dtype``."""
        return dequantize(self.to_nvfp4(dtype), dtype)

    def dequantized_residual_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``dq(W_S)`` ``[N, |S|]`` in ``dtype`` (an empty ``[N, 0]`` tensor when S is empty)."""
        residual = self.residual_to_nvfp4(dtype)
        if residual is None:
            return torch.zeros(self.out_features, 0, dtype=dtype, device=self.device)
        return dequantize(residual, dtype)

    def with_residual_channels(self, channels: ChannelsLike | None) -> QuantizedLinearWeight:
        """A copy with residual channels ``channels`` and ``W_S`` rebuilt from the stored ``q(W)`` only.

        The main codes and scales are shared, not re-quantized: RAC refreshes S at each weight sync.
        """
        ch = as_residual_channels(channels, self.in_features, self.device)
        residual = reblock_columns(self.to_nvfp4(torch.float32), ch)
        return replace(self, residual_channels=ch, residual_weight=residual.codes, residual_weight_scale=residual.scales)

    def with_input_scale(self, input_scale: ScaleLike | None) -> QuantizedLinearWeight:
        """A copy with another static activation scale (``act_amax / 2688``), or None for dynamic."""
        scale = None if input_scale is None else torch.as_tensor(input_scale, dtype=torch.float32, device=self.device)
        return replace(self, input_scale=scale)

    def state_dict(self, module: str, include_residual: bool = True) -> dict[str, torch.Tensor]:
        """Checkpoint tensors ``<module>.<field>`` (``input_scale`` only when set)."""
        out = {
            fmt.tensor_name(module, fmt.WEIGHT): self.weight,
            fmt.tensor_name(module, fmt.WEIGHT_SCALE): self.weight_scale,
            fmt.tensor_name(module, fmt.WEIGHT_SCALE_2): self.weight_scale_2,
        }
        if self.input_scale is not None:
            out[fmt.tensor_name(module, fmt.INPUT_SCALE)] = self.input_scale
        if include_residual:
            out[fmt.tensor_name(module, fmt.RESIDUAL_CHANNELS)] = self.residual_channels
            out[fmt.tensor_name(module, fmt.RESIDUAL_WEIGHT)] = self.residual_weight
            out[fmt.tensor_name(module, fmt.RESIDUAL_WEIGHT_SCALE)] = self.residual_weight_scale
        return out

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], module: str) -> QuantizedLinearWeight:
        """Build from checkpoint tensors ``<module>.<field>``; errors name the full tensor."""
        get = {leaf: tensors.get(fmt.tensor_name(module, leaf)) for leaf in (*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES)}
        for leaf in (fmt.WEIGHT, fmt.WEIGHT_SCALE, fmt.WEIGHT_SCALE_2):
            if get[leaf] is None:
                raise ValueError(f"missing tensor '{module}.{leaf}' ({FIELD_SPECS[leaf]})")
        residual = [get[leaf] for leaf in fmt.RESIDUAL_LEAVES]
        if any(t is None for t in residual) and not all(t is None for t in residual):
            leaf = fmt.RESIDUAL_LEAVES[[t is None for t in residual].index(True)]
            raise ValueError(f"missing tensor '{module}.{leaf}' ({FIELD_SPECS[leaf]}); the residual tensors come as three")
        _check_linear_fields(
            *(get[leaf] for leaf in fmt.MODELOPT_LEAVES),
            *(residual if residual[0] is not None else _empty_residual(get[fmt.WEIGHT])),
            prefix=f"{module}.",
        )
        return cls(*(get[leaf] for leaf in fmt.MODELOPT_LEAVES), *residual)

    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        tensors = [self.weight, self.weight_scale, self.weight_scale_2, self.residual_channels, self.residual_weight]
        tensors += [self.residual_weight_scale] + ([self.input_scale] if self.input_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _empty_residual(weight: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.ndim else 0
    device = weight.device if isinstance(weight, torch.Tensor) else "cpu"
    return (
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(rows, 0, dtype=torch.uint8, device=device),
        torch.zeros(rows, 0, dtype=_FP8, device=device),
    )


def reblocking_error(weight: QuantizedLinearWeight) -> float:
    """Relative L2 error of ``dq(W_S)`` against the columns S of ``dq(q(W))`` (0 when S is empty)."""
    if not weight.num_residual_channels:
        return 0.0
    reference = weight.dequantized_weight(torch.float32).index_select(-1, weight.residual_channels.long())
    return relative_error(reference, weight.dequantized_residual_weight(torch.float32))
