"""NVFP4-plus-residual weights: what a rollout engine holds for QUADS' W4A4 + RAC linears.

A quantized linear stores ModelOpt's NVFP4 fields (``weight``, ``weight_scale``, ``weight_scale_2``,
``input_scale``) plus the Residual Activation Compensation (RAC) fields: the input channels S whose
activation residual gets a second NVFP4 pass, and ``W_S``, the columns S of the quantized weight
re-blocked into 1x16 NVFP4 blocks with the same global scale, so the rollout GEMM is one W4A4 GEMM
over an augmented reduction dimension: ``[q(x), q(r_S)] @ [q(W), W_S]^T``.

:class:`QuantizedLinearWeight` is one linear, :class:`QuantizedModelWeights` a whole model (plus its
unquantized tensors and config), :func:`quantize_hf_weights` builds one from Hugging Face named
tensors, and :func:`save_quantized_weights` / :func:`load_quantized_weights` write and read the
safetensors checkpoint (file mechanics in ``checkpoint_format``). docs/format.md is the schema.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_quads.nvfp4 import (
    BLOCK_SIZE,
    GLOBAL_SCALE_DIVISOR,
    NVFP4Tensor,
    compute_global_amax,
    decode_scale_from_amax,
    dequantize,
    quantize,
)
from megatron_quads.nvfp4.metrics import relative_error
from megatron_quads.precision import Precision
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.stored_scales import invalid_block_scales, invalid_decode_scales

logger = logging.getLogger(__name__)

ChannelsLike = torch.Tensor | Sequence[int]
ScaleLike = torch.Tensor | float

_FP8 = torch.float8_e4m3fn
_PACKED_BLOCK = BLOCK_SIZE // 2  # bytes of packed codes per 16-element block

_EXPECTED = {
    fmt.WEIGHT: "uint8 [N, K/2] packed E2M1 codes",
    fmt.WEIGHT_SCALE: "float8_e4m3fn [N, K/16] block scales",
    fmt.WEIGHT_SCALE_2: "float32 0-dim scalar, amax / 2688",
    fmt.INPUT_SCALE: "float32 0-dim scalar, activation amax / 2688",
    fmt.RESIDUAL_CHANNELS: "int32 [|S|] sorted residual input channels",
    fmt.RESIDUAL_WEIGHT: "uint8 [N, |S|/2] packed codes of W_S",
    fmt.RESIDUAL_WEIGHT_SCALE: "float8_e4m3fn [N, |S|/16] block scales of W_S",
}


# --------------------------------------------------------------------------------------------------
# field validation (shared by the dataclass and the checkpoint loader, which passes a name prefix)


def _require_tensor(value: Any, leaf: str, prefix: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{leaf} must be a torch.Tensor ({_EXPECTED[leaf]}), got {type(value).__name__}")
    return value


def _check_dtype(t: torch.Tensor, leaf: str, prefix: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{prefix}{leaf} has dtype {t.dtype}; expected {_EXPECTED[leaf]}")


def _check_shape(t: torch.Tensor, leaf: str, prefix: str, shape: tuple[int, ...], because: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{prefix}{leaf} has shape {tuple(t.shape)}; expected {shape} ({_EXPECTED[leaf]}) {because}")


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
        raise ValueError(f"{prefix}{leaf} has shape {tuple(t.shape)}; expected {_EXPECTED[leaf]} (shape ())")
    value = float(t)
    if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{prefix}{leaf} is {value}; expected a finite value {bound}")


def _check_channel_values(ch: torch.Tensor, k: int, where: str) -> None:
    """Sorted ascending, unique, in [0, K), count a multiple of 16: else a ValueError saying which."""
    n = ch.numel()
    if n % BLOCK_SIZE:
        raise ValueError(
            f"{where} holds {n} channels; the count must be a multiple of {BLOCK_SIZE} (W_S and q(r_S) are "
            f"NVFP4 tensors of {BLOCK_SIZE}-element blocks): round the selection, e.g. rac.num_residual_channels"
        )
    if n > k:
        raise ValueError(f"{where} holds {n} channels but the weight has only K={k} input channels")
    if not n:
        return
    low, high = int(ch.min()), int(ch.max())
    if low < 0 or high >= k:
        pos = int(torch.nonzero((ch < 0) | (ch >= k))[0])
        raise ValueError(f"{where}[{pos}] = {int(ch[pos])} is outside [0, K={k}): channels index input features")
    step = ch[1:] - ch[:-1]
    if bool((step <= 0).any()):
        pos = int(torch.nonzero(step <= 0)[0])
        a, b = int(ch[pos]), int(ch[pos + 1])
        if a == b:
            raise ValueError(f"{where} repeats channel {a} (positions {pos} and {pos + 1}); channels must be unique")
        raise ValueError(
            f"{where} is not sorted ascending: channel {b} at position {pos + 1} follows {a}; "
            "sort it (torch.sort) before passing it"
        )


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
            f"{prefix}weight has shape {tuple(w.shape)}; expected {_EXPECTED[fmt.WEIGHT]} with N >= 1 and K a "
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
    _check_channel_values(ch, k, f"{prefix}residual_channels")
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
    if ch.dtype == torch.bool or ch.is_floating_point() or ch.is_complex():
        raise ValueError(f"residual channels must be an integer tensor of channel indices, got dtype {ch.dtype}")
    if ch.ndim != 1:
        raise ValueError(f"residual channels must be 1-D, got shape {tuple(ch.shape)}")
    _check_channel_values(ch.to(torch.int64), in_features, "residual channels")
    return ch.to(device=device, dtype=torch.int32)


def input_scale_from_amax(amax: ScaleLike) -> torch.Tensor:
    """ModelOpt's static activation scale ``input_scale = amax / 2688`` (fp32 0-dim)."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if a.numel() != 1 or not bool(torch.isfinite(a).all()) or float(a) <= 0:
        raise ValueError(f"activation amax must be one finite value > 0, got {a}")
    return decode_scale_from_amax(a.reshape(()))


def amax_from_weight_scale_2(weight_scale_2: torch.Tensor) -> torch.Tensor:
    """An fp32 amax with ``amax / 2688 == weight_scale_2`` exactly: the global scale W_S is re-blocked with."""
    ws2 = weight_scale_2.to(torch.float32).reshape(())
    guess = ws2 * torch.tensor(GLOBAL_SCALE_DIVISOR, dtype=torch.float32, device=ws2.device)
    up = down = guess
    candidates = [guess]
    for _ in range(4):  # the rounded product is within an ulp or two of an exact preimage
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        candidates += [up, down]
    for amax in candidates:
        if bool(torch.isfinite(amax)) and float(amax) >= 0 and torch.equal(decode_scale_from_amax(amax), ws2):
            return amax
    raise ValueError(f"weight_scale_2 = {float(ws2)!r} is not amax / 2688 for any fp32 amax; the scale is damaged")


def reblock_residual(weight: NVFP4Tensor, channels: ChannelsLike | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_S`` as ``(codes uint8 [N, |S|/2], scales e4m3 [N, |S|/16])`` from a 2-D quantized weight.

    Each block of 16 gathered channels that is exactly one block of ``weight`` (16 consecutive
    channels starting at a multiple of 16) is copied; every other block is the NVFP4 quantization
    (``nvfp4.quantize``) of the gathered columns of ``dequantize(weight)`` with the global amax
    recovered from ``weight_scale_2``. So ``W_S`` is a function of the stored fields and ``channels``
    only, and equals ``weight`` byte for byte when ``channels`` is every channel.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"W_S is built from a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    rows, k = weight.shape
    ch = as_residual_channels(channels, k, weight.device).long()
    if ch.numel() == 0:
        return (
            torch.zeros(rows, 0, dtype=torch.uint8, device=weight.device),
            torch.zeros(rows, 0, dtype=_FP8, device=weight.device),
        )
    blocks = ch.view(-1, BLOCK_SIZE)
    first = blocks[:, 0]
    # channels are sorted and unique, so 16 of them spanning 15 are consecutive
    aligned = (first % BLOCK_SIZE == 0) & (blocks[:, -1] - first == BLOCK_SIZE - 1)
    num_blocks = blocks.shape[0]
    codes = torch.empty(rows, num_blocks, _PACKED_BLOCK, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, num_blocks, dtype=torch.uint8, device=weight.device)
    if bool(aligned.any()):
        src = first[aligned] // BLOCK_SIZE
        codes[:, aligned] = weight.codes.view(rows, k // BLOCK_SIZE, _PACKED_BLOCK)[:, src]
        scales[:, aligned] = weight.scales.view(torch.uint8)[:, src]
    if not bool(aligned.all()):
        columns = blocks[~aligned].reshape(-1)
        gathered = dequantize(weight, torch.float32).index_select(-1, columns)
        requant = quantize(gathered, global_amax=amax_from_weight_scale_2(weight.weight_scale_2))
        if not torch.equal(requant.weight_scale_2, weight.weight_scale_2.to(torch.float32).reshape(())):
            raise RuntimeError("re-blocked W_S did not reproduce weight_scale_2; report this as a bug")
        codes[:, ~aligned] = requant.codes.view(rows, -1, _PACKED_BLOCK)
        scales[:, ~aligned] = requant.scales.view(torch.uint8)
    return codes.reshape(rows, -1), scales.view(_FP8)


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
        codes, scales = reblock_residual(self.to_nvfp4(torch.float32), ch)
        return replace(self, residual_channels=ch, residual_weight=codes, residual_weight_scale=scales)

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
                raise ValueError(f"missing tensor '{module}.{leaf}' ({_EXPECTED[leaf]})")
        residual = [get[leaf] for leaf in fmt.RESIDUAL_LEAVES]
        if any(t is None for t in residual) and not all(t is None for t in residual):
            leaf = fmt.RESIDUAL_LEAVES[[t is None for t in residual].index(True)]
            raise ValueError(f"missing tensor '{module}.{leaf}' ({_EXPECTED[leaf]}); the residual tensors come as three")
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


# --------------------------------------------------------------------------------------------------
# scope: which modules share a global scale, which are excluded


_EXPERT_MODULE = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")
_ROUTED_EXPERT_LINEAR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")
_ATTENTION_LINEAR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$")


def shared_scale_group(module: str) -> tuple[str, tuple[str, ...]] | None:
    """``(group key, member leaves)`` for a linear engines fuse with siblings (gate/up, w1/w3, q/k/v)."""
    parent, _, leaf = module.rpartition(".")
    for members in fmt.SHARED_GLOBAL_SCALE_GROUPS:
        if leaf in members:
            return f"{parent}.{{{','.join(members)}}}", members
    return None


def routed_expert_scope(bf16_layers: Iterable[int] = ()) -> Callable[[str], bool]:
    """``is_quantized`` for QUADS' default scope: routed-expert linears (Qwen3-MoE names), minus ``bf16_layers``."""
    skip = frozenset(bf16_layers)

    def is_quantized(module: str) -> bool:
        match = _ROUTED_EXPERT_LINEAR.match(module)
        return match is not None and int(match.group(1)) not in skip

    return is_quantized


def is_attention_linear(module: str) -> bool:
    """Whether ``module`` is an attention projection ``model.layers.N.self_attn.{q,k,v,o}_proj`` (Qwen3-MoE names)."""
    return _ATTENTION_LINEAR.match(module) is not None


def experts_and_attention_scope(bf16_layers: Iterable[int] = ()) -> Callable[[str], bool]:
    """``is_quantized`` for routed-expert linears plus attention q/k/v/o projections, minus ``bf16_layers``."""
    skip = frozenset(bf16_layers)
    experts = routed_expert_scope(skip)

    def is_quantized(module: str) -> bool:
        match = _ATTENTION_LINEAR.match(module)
        return experts(module) or (match is not None and int(match.group(1)) not in skip)

    return is_quantized


_FUSED_LINEAR = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "q_proj": "qkv_proj", "k_proj": "qkv_proj"}
_FUSED_LINEAR["v_proj"] = "qkv_proj"


def _vllm_prefixes(module: str) -> list[str]:
    """The layer names vLLM asks its exclusion rule about for a checkpoint module."""
    expert = _EXPERT_MODULE.match(module)
    if expert:
        return [expert.group("experts")]  # one FusedMoE layer holds all experts
    parent, _, leaf = module.rpartition(".")
    return [module, f"{parent}.{_FUSED_LINEAR[leaf]}"] if leaf in _FUSED_LINEAR else [module]


def _excludes(module: str, entry: str) -> bool:
    """Whether vLLM's ModelOpt exclusion rule (exact, substring, wildcard) skips ``module`` for ``entry``."""
    return entry == module or entry in module or fnmatch(module, entry)


def excluded_modules(quantized: Iterable[str], unquantized: Mapping[str, torch.Tensor]) -> list[str]:
    """ModelOpt ``exclude_modules``: modules with a 2-D unquantized ``.weight``; expert lists become ``...experts``."""
    skip: set[str] = set()
    for name, t in unquantized.items():
        module, leaf = fmt.split_tensor_name(name)
        if leaf != fmt.WEIGHT or not module or t.ndim < 2:
            continue
        expert = _EXPERT_MODULE.match(module)
        skip.add(expert.group("experts") if expert else module)
    quantized_set = set(quantized)
    return sorted(m for m in skip if m not in quantized_set)


# --------------------------------------------------------------------------------------------------
# the model container


QUANT_CONFIG_KEYS = ("quant_algo", "group_size", "residual_ratio", "exclude_modules", "weight_version")
OPTIONAL_QUANT_CONFIG_KEYS = ("precision",)
"""``precision``: the text form of the rollout :class:`~megatron_quads.precision.Precision` the
weights are made for (weights that came without one serve as their reader derives)."""


def make_quant_config(
    residual_ratio: float = 0.0, exclude_modules: Iterable[str] = (), weight_version: int = 0,
    precision: Precision | str | None = None,
) -> dict[str, Any]:
    """The container's config dict (validated); ``precision`` is recorded in its text form."""
    config = {
        "quant_algo": fmt.QUANT_ALGO,
        "group_size": fmt.GROUP_SIZE,
        "residual_ratio": float(residual_ratio),
        "exclude_modules": list(exclude_modules),
        "weight_version": int(weight_version),
    }
    if precision is not None:
        config["precision"] = str(precision)
    validate_quant_config(config)
    return config


def recorded_precision(config: Mapping[str, Any]) -> Precision | None:
    """The rollout precision a config dict records, or None when it records none."""
    text = config.get("precision")
    return None if text is None else Precision.parse(text, float(config["residual_ratio"]))


def validate_quant_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError naming the key if the config dict is not a valid QUADS NVFP4 config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict with keys {QUANT_CONFIG_KEYS}, got {type(config).__name__}")
    missing = [k for k in QUANT_CONFIG_KEYS if k not in config]
    unknown = [k for k in config if k not in QUANT_CONFIG_KEYS + OPTIONAL_QUANT_CONFIG_KEYS]
    if missing or unknown:
        raise ValueError(f"config has missing keys {missing} / unknown keys {unknown}; expected exactly {QUANT_CONFIG_KEYS}")
    if config["quant_algo"] != fmt.QUANT_ALGO or config["group_size"] != fmt.GROUP_SIZE:
        raise ValueError(
            f"config quant_algo={config['quant_algo']!r}, group_size={config['group_size']!r}; "
            f"this format is quant_algo='{fmt.QUANT_ALGO}', group_size={fmt.GROUP_SIZE}"
        )
    ratio = config["residual_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"config residual_ratio={ratio!r}; expected a fraction of input channels in [0, 1]")
    excl = config["exclude_modules"]
    if not isinstance(excl, list) or not all(isinstance(e, str) and e for e in excl):
        raise ValueError(f"config exclude_modules must be a list of non-empty module names, got {excl!r}")
    version = config["weight_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"config weight_version={version!r}; expected an integer >= 0")
    if "precision" in config:
        precision = recorded_precision(config)
        if not precision.quantized_rollout or (precision.uses_rac and precision.ratio != ratio):
            raise ValueError(f"config precision={config['precision']!r} does not fit NVFP4 weights with residual_ratio={ratio}")


def _check_unquantized(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"unquantized tensor '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in fmt.UNQUANTIZED_DTYPES:
        hint = ""
        if t.dtype in (torch.uint8, _FP8):
            hint = (
                f" ({t.dtype} suggests quantized data: is '{fmt.split_tensor_name(name)[0]}' missing its "
                f"{fmt.WEIGHT_SCALE} / {fmt.WEIGHT_SCALE_2} tensors?)"
            )
        allowed = ", ".join(str(d) for d in fmt.UNQUANTIZED_DTYPES)
        raise ValueError(f"unquantized tensor '{name}' has dtype {t.dtype}; expected one of {allowed}{hint}")
    if fmt.split_tensor_name(name)[1] in fmt.QUANTIZED_ONLY_LEAVES:
        raise ValueError(
            f"unquantized tensor '{name}' ends in '.{fmt.split_tensor_name(name)[1]}', a name reserved for quantized "
            "modules; rename it"
        )


class LazyLinears(Mapping[str, "QuantizedLinearWeight"]):
    """Quantized linears by module name, whose objects are built by ``build`` on the first access to
    a value: names, membership and length need no objects (a weight sync's engine that holds experts
    stacked never asks for them)."""

    def __init__(self, names: Sequence[str], build: Callable[[], dict[str, QuantizedLinearWeight]]) -> None:
        self._names, self._known = list(names), frozenset(names)
        self._build: Callable[[], dict[str, QuantizedLinearWeight]] | None = build
        self._linears: dict[str, QuantizedLinearWeight] = {}

    def _built(self) -> dict[str, QuantizedLinearWeight]:
        if self._build is not None:
            self._linears, self._build = self._build(), None
        return self._linears

    def __getitem__(self, module: str) -> QuantizedLinearWeight:
        return self._built()[module]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, module: object) -> bool:
        return module in self._known


@dataclass(eq=False)
class QuantizedModelWeights:
    """A model's rollout weights: quantized linears by HF module name, other tensors by HF tensor name.

    Attributes:
        quantized: ``{module name: QuantizedLinearWeight}``, e.g. ``model.layers.3.mlp.experts.7.gate_proj``.
        unquantized: ``{tensor name: tensor}`` kept in high precision (norms, embeddings, router,
            attention when not in scope), bf16 unless built otherwise.
        config: ``quant_algo`` ("NVFP4"), ``group_size`` (16), ``residual_ratio`` (the RAC ratio),
            ``exclude_modules`` (ModelOpt's list of modules left unquantized), ``weight_version``.
        expert_stacks: each MoE layer's projection (``model.layers.L.mlp.experts.gate_up_proj`` or
            ``...down_proj``) as one ``expert_stacks.StackedLinearWeight`` when the weights arrived
            stacked (the weight sync): the expert linears in ``quantized`` view them. Empty otherwise;
            not part of the checkpoint, and dropped by every method that returns new weights.
    """

    quantized: Mapping[str, QuantizedLinearWeight]
    unquantized: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=make_quant_config)
    expert_stacks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Validate the config, names, dtypes and cross-module rules."""
        self._validate(shared_scales=True)

    @classmethod
    def from_checked_linears(
        cls, quantized: dict[str, QuantizedLinearWeight], unquantized: dict[str, torch.Tensor], config: dict[str, Any],
        expert_stacks: dict[str, Any] | None = None,
    ) -> QuantizedModelWeights:
        """Build from linears whose fused siblings already share one ``weight_scale_2`` tensor (views
        of the checked ``expert_stacks``): every rule but that value comparison is checked. For
        :class:`LazyLinears` (built from stacks, without input scales) only the rules on names are."""
        weights = object.__new__(cls)
        weights.quantized, weights.unquantized, weights.config = quantized, unquantized, config
        weights.expert_stacks = dict(expert_stacks or {})
        weights._validate(shared_scales=False, per_linear=not isinstance(quantized, LazyLinears))
        return weights

    def _validate(self, shared_scales: bool, per_linear: bool = True) -> None:
        validate_quant_config(self.config)
        for module in self.quantized:
            if not isinstance(module, str) or not module:
                raise ValueError(f"quantized module names must be non-empty strings, got {module!r}")
        if per_linear:
            for module, lin in self.quantized.items():
                if not isinstance(lin, QuantizedLinearWeight):
                    raise TypeError(f"quantized['{module}'] must be a QuantizedLinearWeight, got {type(lin).__name__}")
        reserved_leaves = {*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES}
        for name, t in self.unquantized.items():
            _check_unquantized(name, t)
            module, leaf = fmt.split_tensor_name(name)
            if leaf in reserved_leaves and module in self.quantized:
                raise ValueError(f"unquantized tensor '{name}' collides with a tensor of quantized module '{module}'")
        if per_linear:
            self._check_input_scales()
        if shared_scales:
            self._check_shared_scales()
        self._check_excludes()

    def _check_input_scales(self) -> None:
        have = [m for m, lin in self.quantized.items() if lin.input_scale is not None]
        if have and len(have) != len(self.quantized):
            lacking = next(m for m, lin in self.quantized.items() if lin.input_scale is None)
            raise ValueError(
                f"'{have[0]}' has an input_scale but '{lacking}' has none: give every quantized module a static "
                "input_scale, or none (dynamic activation scales)"
            )

    def _check_shared_scales(self) -> None:
        first: dict[str, str] = {}
        for module, lin in self.quantized.items():
            group = shared_scale_group(module)
            if group is None:
                continue
            other = first.setdefault(group[0], module)
            if other != module and not torch.equal(lin.weight_scale_2, self.quantized[other].weight_scale_2):
                raise ValueError(
                    f"'{other}' and '{module}' have different weight_scale_2 ({float(self.quantized[other].weight_scale_2)!r} "
                    f"vs {float(lin.weight_scale_2)!r}); engines fuse them and keep one: quantize both with one "
                    "global_amax (the max of their amaxes), as quantize_hf_weights does"
                )

    def _check_excludes(self) -> None:
        entries = self.config["exclude_modules"]
        prefixes = {p: m for m in self.quantized for p in _vllm_prefixes(m)}
        for prefix, module in prefixes.items():
            hit = next((e for e in entries if _excludes(prefix, e)), None)
            if hit is not None:
                raise ValueError(
                    f"quantized module '{module}' is matched by exclude_modules entry '{hit}' (vLLM checks "
                    f"'{prefix}' by exact, substring and wildcard match) and would be loaded as unquantized"
                )

    @property
    def input_scales(self) -> bool:
        """Whether the quantized modules carry static activation scales."""
        return any(lin.input_scale is not None for lin in self.quantized.values())

    @property
    def residual_fraction(self) -> float:
        """``sum |S| / sum K`` over the quantized modules (0 when there are none)."""
        total = sum(lin.in_features for lin in self.quantized.values())
        return sum(lin.num_residual_channels for lin in self.quantized.values()) / total if total else 0.0

    def state_dict(self, include_residual: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor by checkpoint name: quantized modules' tensors, then the unquantized ones."""
        out: dict[str, torch.Tensor] = {}
        for module, lin in self.quantized.items():
            out.update(lin.state_dict(module, include_residual))
        out.update(self.unquantized)
        return out

    @classmethod
    def from_state_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        residual_tensors: bool = True,
        input_scales: bool | None = None,
    ) -> QuantizedModelWeights:
        """Rebuild from checkpoint tensors; a missing, misshapen or mistyped tensor raises ValueError naming it.

        A module is quantized when any of its quantized-only tensors is present. ``residual_tensors``
        and ``input_scales`` (None: either) say which optional tensors every quantized module must have.
        """
        modules: dict[str, set[str]] = {}
        for name in tensors:
            module, leaf = fmt.split_tensor_name(name)
            if module and leaf in fmt.QUANTIZED_ONLY_LEAVES:
                modules.setdefault(module, set()).add(leaf)
        required = [fmt.WEIGHT, fmt.WEIGHT_SCALE, fmt.WEIGHT_SCALE_2] + (list(fmt.RESIDUAL_LEAVES) if residual_tensors else [])
        if input_scales:
            required.append(fmt.INPUT_SCALE)
        forbidden = ([] if residual_tensors else list(fmt.RESIDUAL_LEAVES)) + ([fmt.INPUT_SCALE] if input_scales is False else [])
        quantized: dict[str, QuantizedLinearWeight] = {}
        for module, leaves in modules.items():
            present = sorted(leaves | ({fmt.WEIGHT} if fmt.tensor_name(module, fmt.WEIGHT) in tensors else set()))
            for leaf in required:
                if fmt.tensor_name(module, leaf) not in tensors:
                    raise ValueError(
                        f"checkpoint is missing tensor '{module}.{leaf}' ({_EXPECTED[leaf]}) of quantized module "
                        f"'{module}' (it has: {', '.join(present)}); the checkpoint is incomplete: re-export it"
                    )
            for leaf in forbidden:
                if leaf in leaves:
                    raise ValueError(
                        f"checkpoint has tensor '{module}.{leaf}' but its config says there are no '{leaf}' tensors; "
                        "the config and the tensors disagree: re-export the checkpoint"
                    )
            quantized[module] = QuantizedLinearWeight.from_state_dict(tensors, module)
        taken = {fmt.tensor_name(m, leaf) for m in quantized for leaf in (*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES)}
        unquantized = {name: t for name, t in tensors.items() if name not in taken}
        return cls(quantized=quantized, unquantized=unquantized, config=dict(config))

    def with_residual_channels(
        self, channels: Mapping[str, ChannelsLike | None], weight_version: int | None = None
    ) -> QuantizedModelWeights:
        """A copy with new channel sets for the named modules (others keep theirs); ``q(W)`` is not re-quantized."""
        unknown = [m for m in channels if m not in self.quantized]
        if unknown:
            raise ValueError(f"residual channels given for {len(unknown)} module(s) that are not quantized, e.g. '{unknown[0]}'")
        quantized = dict(self.quantized)
        for module, ch in channels.items():
            try:
                quantized[module] = quantized[module].with_residual_channels(ch)
            except ValueError as err:
                raise ValueError(f"{module}: {err}") from err
        config = dict(self.config)
        if weight_version is not None:
            config["weight_version"] = weight_version
        return QuantizedModelWeights(quantized=quantized, unquantized=dict(self.unquantized), config=config)

    def with_input_amax(self, input_amax: Mapping[str, ScaleLike] | None) -> QuantizedModelWeights:
        """A copy with static activation scales ``input_scale = amax / 2688`` (``input_amax`` names
        every quantized module, as :func:`quantize_hf_weights` requires), or none for ``None``."""
        quantized = {}
        for module, lin in self.quantized.items():
            if input_amax is not None and module not in input_amax:
                raise ValueError(f"input_amax has no entry for quantized module '{module}'; give one for every quantized module")
            try:
                scale = None if input_amax is None else input_scale_from_amax(input_amax[module])
            except ValueError as err:
                raise ValueError(f"{module}: {err}") from err
            quantized[module] = lin.with_input_scale(scale)
        return QuantizedModelWeights(quantized=quantized, unquantized=dict(self.unquantized), config=dict(self.config))

    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(lin.nbytes() for lin in self.quantized.values()) + sum(
            t.numel() * t.element_size() for t in self.unquantized.values()
        )


# --------------------------------------------------------------------------------------------------
# building from Hugging Face weights


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


def _check_scope_consistency(quantized: Mapping[str, QuantizedLinearWeight], unquantized: Mapping[str, torch.Tensor]) -> None:
    """Fused siblings and one MoE layer's experts must be all quantized or all not (engines fuse them)."""
    groups = {g[0]: m for m in quantized if (g := shared_scale_group(m)) is not None}
    expert_parents = {e.group("experts"): m for m in quantized if (e := _EXPERT_MODULE.match(m))}
    for name in unquantized:
        module, leaf = fmt.split_tensor_name(name)
        if leaf != fmt.WEIGHT or not module:
            continue
        group = shared_scale_group(module)
        if group is not None and group[0] in groups:
            raise ValueError(
                f"'{groups[group[0]]}' is quantized but its fused sibling '{module}' is not; engines fuse "
                f"{'/'.join(group[1])} into one linear with one scheme: make is_quantized agree for both"
            )
        expert = _EXPERT_MODULE.match(module)
        if expert and expert.group("experts") in expert_parents:
            raise ValueError(
                f"'{expert_parents[expert.group('experts')]}' is quantized but '{module}' of the same MoE layer is "
                "not; engines run a layer's experts as one fused MoE with one scheme: make is_quantized agree"
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
    _check_scope_consistency(quantized, unquantized)
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


# --------------------------------------------------------------------------------------------------
# safetensors checkpoint


def _quads_block(weights: QuantizedModelWeights, include_residual: bool, precision: Precision | None) -> dict[str, Any]:
    recorded = precision if precision is not None else recorded_precision(weights.config)
    return fmt.quads_block(
        residual_ratio=weights.config["residual_ratio"],
        weight_version=weights.config["weight_version"],
        residual_tensors=include_residual,
        input_scales=weights.input_scales,
        num_quantized_modules=len(weights.quantized),
        num_unquantized_tensors=len(weights.unquantized),
        precision=None if recorded is None else str(recorded),
    )


def save_quantized_weights(
    weights: QuantizedModelWeights,
    directory: str | os.PathLike[str],
    max_shard_bytes: int = fmt.DEFAULT_MAX_SHARD_BYTES,
    *,
    include_residual: bool = True,
    model_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    finish: Callable[[Path], object] | None = None,
    precision: Precision | None = None,
) -> Path:
    """Write ``weights`` as a safetensors checkpoint directory, atomically; return its path.

    Files: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + index when the tensors
    exceed ``max_shard_bytes``), ``hf_quant_config.json``, and ``config.json`` (``model_config``
    with a ``quantization_config`` block) when ``model_config`` is given. ``include_residual=False``
    writes only the ModelOpt-named tensors: a plain ModelOpt NVFP4 checkpoint. ``finish(tmp)`` runs
    on the complete temporary directory before it is renamed into place (more files, a manifest).
    ``precision``: the rollout precision the ``quads`` block records (default: the weights' own, if any).
    """
    if not isinstance(weights, QuantizedModelWeights):
        raise TypeError(f"save_quantized_weights expects QuantizedModelWeights, got {type(weights).__name__}")
    quads = _quads_block(weights, include_residual, precision)
    exclude = weights.config["exclude_modules"]
    files: dict[str, Any] = {fmt.QUANT_CONFIG_FILE: fmt.hf_quant_config(exclude, quads)}
    if model_config is not None:
        files[fmt.MODEL_CONFIG_FILE] = {**model_config, "quantization_config": fmt.quantization_config_block(exclude, quads)}
    if not weights.input_scales and weights.quantized:
        logger.warning(
            "no input_scale tensors: activations use dynamic scales; stock ModelOpt/vLLM NVFP4 loaders expect a "
            "static input_scale per quantized linear"
        )
    metadata = {"quads_version": str(fmt.FORMAT_VERSION), "weight_version": str(weights.config["weight_version"])}
    return fmt.write_checkpoint(
        directory,
        weights.state_dict(include_residual),
        files,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        safetensors_metadata=metadata,
        finish=finish,
    )




def _non_finite(name: str, tensor: torch.Tensor, file: Path, more: str = "") -> ValueError:
    count = int((~torch.isfinite(tensor)).sum())
    return ValueError(
        f"unquantized tensor '{name}' in {file} holds {count} NaN or Inf values{more}; the checkpoint is damaged or "
        "was exported from diverged weights: re-export it"
    )


def _require_finite_unquantized(unquantized: Mapping[str, torch.Tensor], root: Path) -> None:
    """Every high-precision tensor read from the checkpoint ``root`` is finite; the first that holds a
    NaN or Inf raises ValueError naming it and its file. One pass: one device sync."""
    names = list(unquantized)
    if not names:
        return
    finite = torch.stack([torch.isfinite(unquantized[n]).all() for n in names]).tolist()
    bad = [n for n, ok in zip(names, finite, strict=True) if not ok]
    if bad:
        file = root / fmt.tensor_file_map(root)[bad[0]]
        raise _non_finite(bad[0], unquantized[bad[0]], file, f" ({len(bad)} tensor(s) in all)")


def require_finite_unquantized_files(directory: str | os.PathLike[str]) -> int:
    """Every floating-point tensor of the checkpoint files in ``directory`` that belongs to no quantized
    module (embeddings, norms, router, ``lm_head``, excluded linears) is finite: else ValueError naming
    the first that is not and its file. Reads one tensor at a time (memory-mapped); returns how many
    tensors it checked. For readers that do not load the checkpoint through :func:`load_quantized_weights`."""
    root = Path(directory)
    files = fmt.tensor_file_map(root)
    quantized = {fmt.split_tensor_name(n)[0] for n in files if fmt.split_tensor_name(n)[1] in fmt.QUANTIZED_ONLY_LEAVES}
    by_file: dict[str, list[str]] = {}
    for name, file_name in files.items():
        if fmt.split_tensor_name(name)[0] not in quantized:
            by_file.setdefault(file_name, []).append(name)
    checked = 0
    for file_name, names in by_file.items():
        try:
            with safe_open(str(root / file_name), framework="pt") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise _non_finite(name, tensor, root / file_name)
                    checked += 1
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read {root / file_name}: {err}; the file is damaged: re-export the checkpoint") from err
    return checked


def load_quantized_weights(
    directory: str | os.PathLike[str], device: str | torch.device = "cpu", verify_residual: bool = False
) -> QuantizedModelWeights:
    """Read and validate a checkpoint written by :func:`save_quantized_weights`.

    A missing tensor, a tensor whose dtype or shape disagrees with the config or with the module's
    other tensors, an unquantized tensor holding NaN or Inf, or a damaged config raises ValueError
    naming it. ``verify_residual`` also rebuilds
    every ``W_S`` from ``q(W)`` and the channels and requires identical bytes.
    """
    root = Path(directory)
    source = str(root / fmt.QUANT_CONFIG_FILE)
    exclude, quads = fmt.parse_hf_quant_config(fmt.read_json_file(root, fmt.QUANT_CONFIG_FILE), source)
    fmt.check_quant_configs_agree(root)
    tensors = fmt.read_checkpoint_tensors(root, device)
    config = make_quant_config(quads["residual_ratio"], exclude, quads["weight_version"], quads.get("precision"))
    weights = QuantizedModelWeights.from_state_dict(tensors, config, quads["residual_tensors"], quads["input_scales"])
    _require_finite_unquantized(weights.unquantized, root)
    for key, found in (("num_quantized_modules", len(weights.quantized)), ("num_unquantized_tensors", len(weights.unquantized))):
        if found != quads[key]:
            raise ValueError(
                f"{source} says {key} = {quads[key]} but the safetensors files hold {found}; tensors are missing or "
                "extra: re-export the checkpoint"
            )
    if verify_residual:
        for module, lin in weights.quantized.items():
            rebuilt = lin.with_residual_channels(lin.residual_channels)
            for leaf in (fmt.RESIDUAL_WEIGHT, fmt.RESIDUAL_WEIGHT_SCALE):
                if not torch.equal(getattr(rebuilt, leaf).view(torch.uint8), getattr(lin, leaf).view(torch.uint8)):
                    raise ValueError(f"'{module}.{leaf}' is not W_S re-blocked from '{module}.weight'; re-export it")
    logger.info("loaded %d quantized linears and %d other tensors from %s", len(weights.quantized), len(weights.unquantized), root)
    return weights
