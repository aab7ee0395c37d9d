"""``NVFP4Tensor``: packed E2M1 codes, E4M3 block scales and a per-tensor decode scale, and its decoding."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_quads.nvfp4.format import BLOCK_SIZE, codes_to_values, unpack_codes


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 with 1x16 blocks along the last dimension.

    Attributes:
        codes: uint8 ``[..., K/2]``, two E2M1 codes per byte, element 2i in the low nibble.
        scales: float8_e4m3fn ``[..., K/16]`` block scales in the linear (row-major) layout. With
            2D (16x16) block scaling every row of a 16-row tile carries the tile's scale, so the
            layout is the same for both modes and consumers need not know which was used.
        weight_scale_2: fp32 per-tensor decode scale ``global_amax / 2688`` (ModelOpt's
            ``weight_scale_2``); a 0-dim tensor, or one value per leading index (e.g. per token)
            with a shape that broadcasts against ``shape[:-1]``.
        shape: the original (unpacked) shape.
        dtype: the original floating dtype; ``dequantize`` returns it by default.
        global_amax: the fp32 amax the encode scale was derived from; ``None`` when the tensor was
            built from stored checkpoint fields, which carry only ``weight_scale_2``.
        block_2d: whether the block scales were computed over 16x16 tiles.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    weight_scale_2: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    global_amax: torch.Tensor | None = None
    block_2d: bool = False

    @property
    def device(self) -> torch.device:
        """Device of the stored tensors."""
        return self.codes.device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize to ``dtype`` (default: the original dtype)."""
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """A copy with every stored tensor on ``device``."""
        amax = None if self.global_amax is None else self.global_amax.to(device)
        return replace(
            self,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            weight_scale_2=self.weight_scale_2.to(device),
            global_amax=amax,
        )

    def nbytes(self) -> int:
        """Bytes held by codes, scales and the decode scale."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.weight_scale_2))


def dequantize(t: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize: ``dtype((e2m1 * e4m3_scale) * weight_scale_2)``.

    ``e2m1 * e4m3_scale`` is exact in fp32, so the only roundings are the product with the fp32
    decode scale and the final cast: the value an FP4 GEMM with fp32 accumulation multiplies with.
    """
    out_dtype = t.dtype if dtype is None else dtype
    values = codes_to_values(unpack_codes(t.codes)).unflatten(-1, (-1, BLOCK_SIZE))
    block_values = values * t.scales.to(torch.float32).unsqueeze(-1)
    decode = t.weight_scale_2.to(torch.float32)
    out = block_values * decode.reshape(decode.shape + (1, 1))
    return out.flatten(-2).reshape(t.shape).to(out_dtype)
