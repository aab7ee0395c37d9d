"""The one NVFP4 numerics path of megatron_quads.

Everything that decides NVFP4 codes and scales (the trainer's fake quant, weight sync, checkpoint
tools, the vLLM plugin) calls this package. Its semantics are bit-exact with Transformer Engine's
NVFP4 quantizer; see docs/nvfp4.md.
"""

from megatron_quads.nvfp4.fake_quant import fake_quant
from megatron_quads.nvfp4.format import (
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    FP4_MAX,
    FP8_E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    codes_to_values,
    pack_codes,
    round_to_e2m1_codes,
    unpack_codes,
)
from megatron_quads.nvfp4.metrics import per_channel_mse, relative_error, sqnr_db
from megatron_quads.nvfp4.global_scale import compute_global_amax, decode_scale_from_amax, global_encode_scale
from megatron_quads.nvfp4.quantize import quantize, quantize_dequantize
from megatron_quads.nvfp4.swizzle import (
    swizzle_scales,
    swizzled_shape,
    unswizzle_scales,
)
from megatron_quads.nvfp4.tensor import NVFP4Tensor, dequantize

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAGNITUDES",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "GLOBAL_SCALE_DIVISOR",
    "NVFP4Tensor",
    "codes_to_values",
    "compute_global_amax",
    "decode_scale_from_amax",
    "dequantize",
    "fake_quant",
    "global_encode_scale",
    "pack_codes",
    "per_channel_mse",
    "quantize",
    "quantize_dequantize",
    "relative_error",
    "round_to_e2m1_codes",
    "sqnr_db",
    "swizzle_scales",
    "swizzled_shape",
    "unpack_codes",
    "unswizzle_scales",
]
