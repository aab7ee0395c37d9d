#!/usr/bin/env python3
"""Generate NVFP4 golden test vectors from Transformer Engine's pure-PyTorch reference.

What it does
------------
Quantizes a fixed, seeded set of small 2D tensors with Transformer Engine's (TE)
reference NVFP4 quantizer ``NVFP4QuantizerRef`` and writes inputs and outputs,
converted to this project's conventions, to a safetensors file (default
``tests/data/te_nvfp4_golden.safetensors``). Running it twice gives a
byte-identical file.

Where TE's code comes from
--------------------------
Nothing from TE is stored in this repository. At run time the tool runs
``python -m pip download --no-deps transformer-engine==<version>`` into a cache
directory (default ``.cache/te_wheel``, git-ignored), checks the wheel's sha256
against the pinned value, and reads two pure-Python files *from the zip, in
memory*:

* ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` (the quantizer);
* ``transformer_engine/pytorch/custom_recipes/reference_utils.py`` (its only
  pure-Python sibling that is genuinely used: dtype list, ``Fp4Formats``,
  ``roundup_div``).

Every other import of ``reference_nvfp4.py`` is satisfied by a minimal stand-in
module placed in ``sys.modules`` only while the module is executed:

* ``transformer_engine.pytorch.quantized_tensor``: ``Quantizer`` (the real
  ``__init__(*, rowwise, columnwise)`` and ``set_usage`` semantics, nothing
  else) and an empty ``QuantizedTensorStorage`` base class. The real module
  imports the compiled ``transformer_engine_torch`` extension.
* ``transformer_engine.pytorch.custom_recipes.gemm``: ``GEMMType`` and
  ``MMParams`` (only used by ``qgemm``'s signature and its WGRAD branch). The
  real module imports TE internals that need the compiled extension.
* empty packages ``transformer_engine``, ``transformer_engine.pytorch``,
  ``transformer_engine.pytorch.custom_recipes``.

The source is executed unmodified except that any literal ``device="cuda"`` /
``device='cuda'`` would be rewritten to ``"cpu"`` (TE 2.20.2 has none: the
reference follows its input's device). The quantizer is built with TE's own
factory ``nvfp4_ref_rht_2d_factory`` exactly as TE's ``CustomRecipe`` would:
role ``(linear, weight)`` gives 16x16 2D block scaling without RHT, any other
role gives 1x16 blocks with RHT enabled. RHT only touches the columnwise
(transposed) output, which is switched off with ``set_usage(columnwise=False)``;
but TE's ``_quantize`` still builds the RHT'd transpose, which raises unless
M % 16 == 0, so the tool also sets ``with_rht = False`` (rowwise outputs were
checked to be identical with the factory defaults, columnwise + RHT on).
``quantize(x)`` is called on the 2D tensor and the rowwise outputs ``data``,
``scale``, ``global_amax_row`` are kept.

Conventions of the stored tensors (and any conversion from TE's output)
----------------------------------------------------------------------
For each case ``<name>``:

* ``<name>.x``: the input ``[M, K]`` in its original dtype (bf16 / fp16 / fp32).
* ``<name>.codes``: uint8 ``[M, K/2]``; element ``2i`` in the LOW nibble,
  ``2i+1`` in the HIGH nibble; E2M1 code = bit 3 sign, bits 0-2 index into
  ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``. TE's ``cast_to_fp4x2`` already produces
  exactly this (``result[:, ::2] + result[:, 1::2] * 16``): no conversion.
* ``<name>.scales``: the raw bytes (``.view(torch.uint8)``) of the
  float8_e4m3fn block decode scales, LINEAR (not swizzled) layout.
  1x16: ``[M, K/16]``, TE's ``scale`` as is. 16x16: ``[ceil(M/16), K/16]``,
  one per 16x16 tile. TE returns 2D scales as ``[16*ceil(M/16), K/16]`` with the
  tile scale repeated on each of the tile's 16 (zero-padded) rows; the tool
  keeps every 16th row after asserting that all 16 rows of every tile are
  byte-identical.
* ``<name>.amax``: fp32 scalar (shape ``[]``): TE's ``global_amax_row``
  (shape ``[1]`` in TE) = ``max(|x|)`` taken in the input dtype, then cast to
  fp32. ``weight_scale_2 = amax / (6 * 448)``.
* ``<name>.dequant``: fp32 ``[M, K]``. TE's reference has NO dequantize
  (``supports_dequantize`` is False), so this is NOT a TE output: it is the
  exact value ``e2m1 * s_blk * amax / 2688`` (TE's ``qgemm`` applies the
  same factors: block scales per K-block and ``alpha = amax_a * amax_b /
  (6*6*448*448)``), computed in float64 (``e2m1 * s_blk * amax`` is exact there)
  and rounded once to fp32, i.e. correctly rounded. An fp32 implementation with
  a different evaluation order may differ from it by 1 ulp. For amax below
  2688/FLT_MAX (~7.9e-36) TE quantizes with S_dec = 1/FLT_MAX rather than
  amax/2688, so there this dequant (like TE's qgemm) is ~0, not ~x.

TE's arithmetic, as read from reference_nvfp4.py 2.20.2 (all fp32)
-----------------------------------------------------------------
``S_enc = min(2688 / amax, FLT_MAX)``, set to 1 only when it is 0 (amax = inf;
amax = 0 gives ``S_enc = FLT_MAX``, with no visible effect); ``S_dec = 1 / S_enc``;
block scale ``e4m3(clamp(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX), +-448))``;
``enc = min(1 / (s_blk * S_dec), FLT_MAX)``; codes = E2M1 round-half-even of
``clamp(x.float() * enc, +-6)``, negative sign only for values < 0 (an input -0.0
gives code 0). The same summary is stored in the metadata as ``te_arithmetic``.

Self-checks done on every run: TE's codes decoded with TE's own
``cast_from_fp4x2`` equal our decoding of the stored codes (sign of zero
included); the stored scales expand back to TE's scale tensor byte for byte;
for the random cases whose shapes ``qgemm`` accepts, TE's ``qgemm(x, x)``
matches ``dequant @ dequant.T``; for the tie cases, that the inputs really are
ties in TE's fp32 arithmetic (TE's own scales are asserted equal to the ones the
tie construction assumed).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import importlib.machinery
import json
import logging
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import types
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

LOG = logging.getLogger("make_te_golden_vectors")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("tests/data/te_nvfp4_golden.safetensors")
DEFAULT_CACHE_DIR = Path(".cache/te_wheel")
DEFAULT_TE_VERSION = "2.20.2"
# PyPI files are immutable: pin what the vectors were generated from.
KNOWN_WHEEL_SHA256 = {
    "2.20.2": "7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094",
}

PKG = "transformer_engine.pytorch.custom_recipes"
REF_MEMBER = "transformer_engine/pytorch/custom_recipes/reference_nvfp4.py"
UTILS_MEMBER = "transformer_engine/pytorch/custom_recipes/reference_utils.py"

F32 = torch.float32
F64 = torch.float64
E4M3 = torch.float8_e4m3fn
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP4_MAX = 6.0
FP8_MAX = 448.0
GLOBAL_DENOM = FP4_MAX * FP8_MAX  # 2688
# With amax == 2688, TE's S_enc = 2688 / amax is exactly 1 (and S_dec too).
UNIT_SENC_AMAX = GLOBAL_DENOM


# --------------------------------------------------------------------------------------
# Fetching and loading TE's reference
# --------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(version: str, cache_dir: Path) -> Path:
    """Return the cached TE wheel, downloading it with ``pip download`` if needed."""
    wheel = cache_dir / f"transformer_engine-{version}-py3-none-any.whl"
    if wheel.exists():
        LOG.info("using cached wheel %s", wheel)
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(cache_dir), f"transformer-engine=={version}",
    ]
    LOG.info("running: %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    if not wheel.exists():
        raise FileNotFoundError(f"pip did not produce {wheel}; got {sorted(os.listdir(cache_dir))}")
    return wheel


def check_wheel(wheel: Path, version: str) -> str:
    digest = sha256_file(wheel)
    expected = KNOWN_WHEEL_SHA256.get(version)
    if expected is None:
        LOG.warning("no pinned sha256 for TE %s; wheel sha256 is %s", version, digest)
    elif digest != expected:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {expected}")
    LOG.info("wheel sha256 %s", digest)
    return digest


def read_members(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return {m: zf.read(m).decode("utf-8") for m in (REF_MEMBER, UTILS_MEMBER)}


def patch_cuda_device(source: str) -> tuple[str, int]:
    """Rewrite hard-coded ``device="cuda"`` literals to CPU (none in TE 2.20.2)."""
    return re.subn(r"""device\s*=\s*(["'])cuda(:\d+)?\1""", 'device="cpu"', source)


class _StubQuantizedTensorStorage:
    """Stand-in for TE's QuantizedTensorStorage: only a base class is needed."""


class _StubQuantizer:
    """Stand-in for TE's Quantizer: the real __init__ and set_usage semantics."""

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False
        self.optimize_for_gemm = False

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise


class _StubGEMMType(enum.Enum):
    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


@dataclasses.dataclass(frozen=True)
class _StubMMParams:
    out_dtype: torch.dtype | None = None
    use_split_accumulator: bool = True


def _package(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # type: ignore[attr-defined]
    return mod


def stub_modules() -> dict[str, types.ModuleType]:
    mods = {n: _package(n) for n in ("transformer_engine", "transformer_engine.pytorch", PKG)}
    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
    qt.Quantizer = _StubQuantizer  # type: ignore[attr-defined]
    qt.QuantizedTensorStorage = _StubQuantizedTensorStorage  # type: ignore[attr-defined]
    gemm = types.ModuleType(f"{PKG}.gemm")
    gemm.GEMMType = _StubGEMMType  # type: ignore[attr-defined]
    gemm.MMParams = _StubMMParams  # type: ignore[attr-defined]
    mods[qt.__name__] = qt
    mods[gemm.__name__] = gemm
    mods["transformer_engine"].pytorch = mods["transformer_engine.pytorch"]  # type: ignore[attr-defined]
    mods["transformer_engine.pytorch"].custom_recipes = mods[PKG]  # type: ignore[attr-defined]
    mods["transformer_engine.pytorch"].quantized_tensor = qt  # type: ignore[attr-defined]
    mods[PKG].gemm = gemm  # type: ignore[attr-defined]
    return mods


def exec_source(name: str, source: str, origin: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = origin
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, origin=origin)
    sys.modules[name] = mod  # dataclasses looks the module up while decorating
    exec(compile(source, origin, "exec"), mod.__dict__)  # noqa: S102 - TE's reference source
    return mod


def load_reference(wheel: Path) -> types.ModuleType:
    """Execute TE's reference_nvfp4.py from the wheel with stand-ins for its TE imports."""
    sources = read_members(wheel)
    ref_src, n_patched = patch_cuda_device(sources[REF_MEMBER])
    LOG.info("patched %d hard-coded cuda device literal(s) in %s", n_patched, REF_MEMBER)
    stubs = stub_modules()
    names = [*stubs, f"{PKG}.reference_utils", f"{PKG}.reference_nvfp4"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules.update(stubs)
        utils = exec_source(f"{PKG}.reference_utils", sources[UTILS_MEMBER], f"{wheel.name}/{UTILS_MEMBER}")
        stubs[PKG].reference_utils = utils  # type: ignore[attr-defined]
        return exec_source(f"{PKG}.reference_nvfp4", ref_src, f"{wheel.name}/{REF_MEMBER}")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


# --------------------------------------------------------------------------------------
# Calling TE and converting to our conventions
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TeOut:
    data: torch.Tensor  # uint8 [M, K/2]
    scale: torch.Tensor  # float8_e4m3fn, TE layout
    amax: torch.Tensor  # fp32 [1]
    qresult: Any  # NVFP4TensorRef (for qgemm)
    quantizer: Any  # NVFP4QuantizerRef


def make_quantizer(ref: types.ModuleType, block: str) -> Any:
    """Build the quantizer with TE's own factory, as TE's CustomRecipe would."""
    tensor_type = "weight" if block == "16x16" else "input"
    role = types.SimpleNamespace(module_type="linear", tensor_type=tensor_type)
    quantizer = ref.nvfp4_ref_rht_2d_factory(role)
    expected = (16, 16) if block == "16x16" else (1, 16)
    if tuple(quantizer.quant_tile_shape) != expected or quantizer.pow_2_scales:
        raise RuntimeError(f"unexpected factory result for {block}: {quantizer.quant_tile_shape}")
    quantizer.set_usage(rowwise=True, columnwise=False)
    # The 1x16 factory quantizer has with_rht=True. RHT is applied only to the transposed
    # (columnwise) input, but TE's _quantize computes that input even when columnwise usage
    # is off, and it raises unless M % 16 == 0. The rowwise result never depends on it.
    quantizer.with_rht = False
    return quantizer


def te_quantize(ref: types.ModuleType, x: torch.Tensor, block: str) -> TeOut:
    quantizer = make_quantizer(ref, block)
    with torch.no_grad():
        res = quantizer.quantize(x)
    return TeOut(res.data, res.scale, res.global_amax_row, res, quantizer)


def compact_scales(scale: torch.Tensor, m: int, block: str) -> torch.Tensor:
    """TE scale tensor -> our linear layout, as uint8 bytes."""
    raw = scale.contiguous().view(torch.uint8)
    if block == "1x16":
        return raw.clone()
    tiles = math.ceil(m / 16)
    if raw.shape[0] != 16 * tiles:
        raise RuntimeError(f"2D scale rows {raw.shape[0]} != 16*ceil({m}/16)")
    compact = raw[::16].clone()
    if not torch.equal(compact.repeat_interleave(16, dim=0), raw):
        raise RuntimeError("2D scales are not constant over the 16 rows of a tile")
    return compact


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """Our convention: low nibble = element 2i; bit 3 sign; bits 0-2 magnitude index."""
    nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(codes.shape[0], -1).long()
    mag = torch.tensor(E2M1_VALUES, dtype=F64)[nib & 7]
    return torch.where((nib & 8) != 0, -mag, mag)


def expand_scales(scales_u8: torch.Tensor, m: int, block: str) -> torch.Tensor:
    s = scales_u8.view(E4M3).to(F64)
    if block == "16x16":
        s = s.repeat_interleave(16, dim=0)[:m]
    return s.repeat_interleave(16, dim=1)


def dequantize(codes: torch.Tensor, scales_u8: torch.Tensor, amax: torch.Tensor, block: str) -> torch.Tensor:
    """Correctly rounded fp32 of e2m1 * s_blk * amax / 2688 (numerator exact in float64)."""
    m = codes.shape[0]
    num = decode_codes(codes) * expand_scales(scales_u8, m, block) * amax.to(F64)
    return (num / GLOBAL_DENOM).to(F32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.to(F32).view(torch.int32), b.to(F32).view(torch.int32))


def self_check(ref: types.ModuleType, case: Case, te: TeOut, out: dict[str, torch.Tensor]) -> None:
    m, k = case.x.shape
    te_e2m1 = ref.cast_from_fp4x2(te.data, F32)
    ours = decode_codes(out["codes"]).to(F32)
    if not same_bits(te_e2m1, ours):
        raise RuntimeError(f"{case.name}: our nibble decoding disagrees with TE's cast_from_fp4x2")
    if case.block == "16x16":
        back = out["scales"].repeat_interleave(16, dim=0)
        if not torch.equal(back, te.scale.contiguous().view(torch.uint8)):
            raise RuntimeError(f"{case.name}: compacted 2D scales do not expand back to TE's")
    if case.gemm_check and k % 32 == 0 and m % 8 == 0 and tuple(te.scale.shape) == (m, k // 16):
        y_te = te.quantizer.qgemm(
            te.data, te.data, ref.gemm.MMParams(), F32, te.scale, te.scale,
            qresult_x=te.qresult, qresult_w=te.qresult,
        )
        dq = out["dequant"].to(F64)
        y_ours = dq @ dq.T
        if not torch.allclose(y_te.to(F64), y_ours, rtol=1e-5, atol=1e-6 * float(y_ours.abs().max())):
            raise RuntimeError(f"{case.name}: TE qgemm disagrees with our dequantization")
        LOG.debug("%s: qgemm cross-check ok", case.name)
    for (r, c), s in case.expected_scales.items():
        got = float(out["scales"][r, c].view(E4M3).to(F32))
        if got != s:
            raise RuntimeError(f"{case.name}: TE scale[{r},{c}]={got}, tie construction assumed {s}")


# --------------------------------------------------------------------------------------
# fp32 mirror of TE's arithmetic, used ONLY to construct and verify tie inputs
# --------------------------------------------------------------------------------------


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


FLT_MAX = _f32(torch.finfo(F32).max)


def mirror_global(amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) with TE's ops: min(2688/amax, FLT_MAX), 0 -> 1, S_dec = 1/S_enc."""
    s_enc = torch.minimum(_f32(FP8_MAX) * _f32(FP4_MAX) / _f32(amax), FLT_MAX)
    if float(s_enc) == 0.0:
        s_enc = _f32(1.0)
    return s_enc, 1.0 / s_enc


def mirror_scale_pre(block_amax: float, s_enc: torch.Tensor) -> torch.Tensor:
    """Block scale before the e4m3 cast: block_amax * (S_enc * fp32(1/6)), min FLT_MAX."""
    mult = s_enc * torch.reciprocal(_f32(FP4_MAX))
    return torch.minimum(_f32(block_amax) * mult, FLT_MAX)


def to_e4m3(v: torch.Tensor) -> float:
    return float(torch.clamp(v, -FP8_MAX, FP8_MAX).to(E4M3).to(F32))


def mirror_encode(s_blk: float, s_dec: torch.Tensor) -> torch.Tensor:
    return torch.minimum(1.0 / (_f32(s_blk) * s_dec), FLT_MAX)


def e4m3_positive_values() -> list[float]:
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).to(F32)
    return sorted({float(v) for v in vals if math.isfinite(float(v)) and float(v) > 0})


def e4m3_midpoints() -> list[tuple[float, float, float]]:
    """(midpoint, lower, upper) for every pair of adjacent e4m3 values, 0 included."""
    vals = [0.0, *e4m3_positive_values()]
    return [((a + b) / 2, a, b) for a, b in pairwise(vals)]


def step_value(x: float, steps: int, dtype: torch.dtype) -> float:
    """Move |x| by ``steps`` ulps of ``dtype`` (keeping the sign); x must be in dtype."""
    int_t = torch.int32 if dtype == F32 else torch.int16
    mag = torch.tensor(abs(x), dtype=F64).to(dtype).view(int_t)
    moved = (mag.to(torch.int64) + steps).to(int_t).view(dtype)
    return math.copysign(float(moved), x)


def in_dtype(v: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(v, dtype=F64).to(dtype))


def search_dtype(start: float, dtype: torch.dtype, ok: Callable[[float], bool], radius: int = 64) -> float | None:
    x0 = in_dtype(start, dtype)
    for d in range(radius + 1):
        for s in ((0,) if d == 0 else (d, -d)):
            x = step_value(x0, s, dtype)
            if x != 0.0 and math.isfinite(x) and ok(x):
                return x
    return None


def find_input_for_scaled(target: float, enc: torch.Tensor, dtype: torch.dtype) -> float | None:
    """x in dtype with fp32(x * enc) == target exactly (TE's ``x.float() * encode_scale``)."""
    return search_dtype(target / float(enc), dtype, lambda x: float(_f32(x) * enc) == target)


def find_block_amax(target_pre: float, s_enc: torch.Tensor, dtype: torch.dtype) -> float | None:
    """b in dtype with block-scale pre-cast value exactly ``target_pre``."""
    start = target_pre * FP4_MAX / float(s_enc)
    return search_dtype(start, dtype, lambda b: float(mirror_scale_pre(b, s_enc)) == target_pre)


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    x: torch.Tensor
    block: str
    description: str
    gemm_check: bool = False
    # (row or tile-row, block column) -> e4m3 scale value the construction relies on
    expected_scales: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)


def gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def randn(name: str, m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=gen(name), dtype=F64)


def exact_cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = values.to(dtype)
    if not torch.equal(out.to(F64), values.to(F64)):
        raise ValueError(f"values not exactly representable in {dtype}")
    return out


def rows_of_blocks(blocks: Sequence[Sequence[float]], blocks_per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Lay out 16-element blocks row-major into [ceil(n/bpr), 16*bpr]; pad with zero blocks."""
    blocks = [list(b) for b in blocks]
    if any(len(b) != 16 for b in blocks):
        raise ValueError("blocks must have 16 elements")
    while len(blocks) % blocks_per_row:
        blocks.append([0.0] * 16)
    t = torch.tensor(blocks, dtype=F64).reshape(-1, blocks_per_row * 16)
    return exact_cast(t, dtype)


def tiles_to_tensor(tiles: Sequence[torch.Tensor], tiles_per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Lay out [16,16] float64 tiles into a [16*rows, 16*tiles_per_row] tensor."""
    tiles = list(tiles)
    while len(tiles) % tiles_per_row:
        tiles.append(torch.zeros(16, 16, dtype=F64))
    rows = [torch.cat(tiles[i:i + tiles_per_row], dim=1) for i in range(0, len(tiles), tiles_per_row)]
    return exact_cast(torch.cat(rows, dim=0), dtype)


def with_amax(name: str, m: int, k: int, amax: float, dtype: torch.dtype) -> torch.Tensor:
    x = randn(name, m, k)
    return (x / x.abs().max() * amax).to(dtype)


def random_cases() -> Iterator[Case]:
    for dn, dt in DTYPES.items():
        for (m, k) in ((8, 128), (7, 48)):
            name = f"rand_{dn}_1x16_m{m}k{k}"
            yield Case(name, randn(name, m, k).to(dt), "1x16", f"standard normal {dn} [{m},{k}]", gemm_check=True)
        for (m, k) in ((32, 64), (20, 32)):
            name = f"rand_{dn}_16x16_m{m}k{k}"
            desc = f"standard normal {dn} [{m},{k}], 2D 16x16 tiles" + (" (M padded to 32 by TE)" if m % 16 else "")
            yield Case(name, randn(name, m, k).to(dt), "16x16", desc, gemm_check=True)
        for tag, factor in (("1em3", 1e-3), ("1e3", 1e3)):
            for block, (m, k) in (("1x16", (8, 64)), ("16x16", (16, 32))):
                name = f"rand_{dn}_{block}_x{tag}"
                x = (randn(name, m, k) * factor).to(dt)
                yield Case(name, x, block, f"standard normal * {factor:g} in {dn} [{m},{k}]", gemm_check=True)


def tie_block(scale: float, s_enc: torch.Tensor, s_dec: torch.Tensor,
              dtype: torch.dtype) -> tuple[list[float], int] | None:
    """One block whose e4m3 scale is ``scale`` and whose other 15 elements scale (TE's fp32
    ``x * encode_scale``) exactly onto the 14 signed E2M1 ties (+ a 0). A tie that no input
    of the dtype reaches exactly is replaced by 0. Returns (block, number of ties) or None."""
    amax = find_block_amax(scale, s_enc, dtype)  # prefer a pre-cast value of exactly `scale`
    if amax is None:
        start = scale * FP4_MAX / float(s_enc)
        amax = search_dtype(start, dtype, lambda b: to_e4m3(mirror_scale_pre(b, s_enc)) == scale)
    if amax is None or to_e4m3(mirror_scale_pre(amax, s_enc)) != scale:
        return None
    enc = mirror_encode(scale, s_dec)
    out, n_ties = [amax], 0
    for t in E2M1_TIES:
        for sign in (1.0, -1.0):
            x = find_input_for_scaled(sign * t, enc, dtype)
            if x is None or abs(x) > amax:
                out.append(0.0)
            else:
                out.append(x)
                n_ties += 1
    out.append(0.0)
    return (out, n_ties) if n_ties else None


def global_amax_block(amax: float) -> list[float]:
    return [amax, -amax / 2, amax / 4, *([0.0] * 13)]


def ties_e2m1_1x16(dn: str, dt: torch.dtype, amax: float, scales: Sequence[float], tag: str,
                   min_blocks: int) -> Case:
    s_enc, s_dec = mirror_global(amax)
    blocks = [global_amax_block(in_dtype(amax, dt))]
    expected: dict[tuple[int, int], float] = {}
    bpr, total = 4, 0
    for s in scales:
        found = tie_block(s, s_enc, s_dec, dt)
        if found is None or found[0][0] > in_dtype(amax, dt):  # must not change the global amax
            LOG.info("ties_e2m1 %s %s: no tie block for scale %g, skipped", dn, tag, s)
            continue
        expected[divmod(len(blocks), bpr)] = s
        blocks.append(found[0])
        total += found[1]
    if len(expected) < min_blocks:
        raise RuntimeError(f"only {len(expected)} tie blocks found for {dn} {tag}")
    LOG.info("ties_e2m1 %s %s: %d exact ties in %d blocks", dn, tag, total, len(expected))
    name = f"ties_e2m1_{dn}_1x16_{tag}"
    desc = (f"exact E2M1 ties +-{list(E2M1_TIES)} after scaling, global amax {amax:g} "
            f"(S_enc={float(s_enc):.9g}), block scales {sorted(expected.values())}; {total} exact ties "
            "(a tie no input of the dtype reaches is replaced by 0)")
    return Case(name, rows_of_blocks(blocks, bpr, dt), "1x16", desc, expected_scales=expected)


def tie_cases() -> Iterator[Case]:
    pow2 = [1.0, 2.0, 0.5, 448.0 / 2, 2.0 ** -6, 2.0 ** -9]
    for dn, dt in DTYPES.items():
        yield ties_e2m1_1x16(dn, dt, UNIT_SENC_AMAX, pow2 + [1.5, 0.75, 3.0, 448.0, 104.0], "senc1", 8)
    yield ties_e2m1_1x16("fp32", F32, GLOBAL_DENOM / 1024, pow2 + [1.5, 448.0, 13.0], "senc1024", 8)
    # S_enc = fp32(2688/1000) and S_dec are inexact; bf16/fp16 reach no exact tie there, so they
    # use amax 7 (S_enc = 384 exact, S_dec = fp32(1/384) inexact).
    inexact = [1.0, 2.0, 1.5, 0.5, 448.0, 96.0, 2.0 ** -3, 0.1875, 0.75, 3.0, 2.0 ** -9]
    yield ties_e2m1_1x16("fp32", F32, 1000.0, inexact, "amax1000", 4)
    for dn in ("bf16", "fp16"):
        yield ties_e2m1_1x16(dn, DTYPES[dn], 7.0, inexact, "amax7", 4)
    yield near_ties_e2m1_fp32()
    for dn, dt in DTYPES.items():
        yield ties_e2m1_16x16(dn, dt)
    for dn, dt in DTYPES.items():
        yield ties_e4m3_1x16(dn, dt, UNIT_SENC_AMAX, "senc1", all_required=True)
    yield ties_e4m3_1x16("fp32", F32, 1000.0, "amax1000", all_required=False)
    yield near_ties_e4m3_fp32()
    yield ties_e4m3_16x16_fp32()


def near_ties_e2m1_fp32() -> Case:
    """S_enc = 1, scale 1: ties moved by +-1 fp32 ulp (must round away from the tie)."""
    blocks = [global_amax_block(UNIT_SENC_AMAX)]
    for direction in (1, -1):
        blk = [6.0]
        for t in E2M1_TIES:
            for sign in (1.0, -1.0):
                blk.append(sign * step_value(t, direction, F32))
        blk.append(0.0)
        blocks.append(blk)
    return Case("near_ties_e2m1_fp32_1x16", rows_of_blocks(blocks, 3, F32), "1x16",
                "E2M1 ties +-1 fp32 ulp (block amax 6, S_enc=1, scale 1)",
                expected_scales={(0, 1): 1.0, (0, 2): 1.0})


def ties_e2m1_16x16(dn: str, dt: torch.dtype) -> Case:
    """2D: tiles whose amax is 6*s (S_enc=1) with every E2M1 tie in each row of the tile."""
    s_enc, s_dec = mirror_global(UNIT_SENC_AMAX)
    tiles, expected = [], {}
    first = torch.zeros(16, 16, dtype=F64)
    first[0, 0] = UNIT_SENC_AMAX
    tiles.append(first)
    for s in (1.0, 0.5, 2.0 ** -9, 1.5, 448.0):
        found = tie_block(s, s_enc, s_dec, dt)
        if found is None:
            raise RuntimeError(f"no 2D tie tile for scale {s} in {dn}")
        row = torch.tensor(found[0], dtype=F64)
        tile = torch.stack([torch.roll(row, i) for i in range(16)])  # amax in every row once
        expected[divmod(len(tiles), 3)] = s
        tiles.append(tile)
    return Case(f"ties_e2m1_{dn}_16x16", tiles_to_tensor(tiles, 3, dt), "16x16",
                f"2D tiles with exact E2M1 ties, S_enc=1, tile scales {sorted(expected.values())}",
                expected_scales=expected)


def e4m3_tie_block(b: float, name: str, idx: int) -> list[float]:
    """Block with amax b (first element) and 15 values spread over (-b, b)."""
    fr = torch.rand(15, generator=gen(f"{name}/{idx}"), dtype=F64) * 2 - 1
    return [b, *(float(v) * b for v in fr)]


def ties_e4m3_1x16(dn: str, dt: torch.dtype, amax: float, tag: str, all_required: bool) -> Case:
    s_enc, _ = mirror_global(amax)
    name = f"ties_e4m3_{dn}_1x16_{tag}"
    blocks, expected, bpr = [global_amax_block(in_dtype(amax, dt))], {}, 8
    for i, (mid, lo, hi) in enumerate(e4m3_midpoints()):
        b = find_block_amax(mid, s_enc, dt)
        if b is None:
            if all_required:
                raise RuntimeError(f"{name}: no block amax for e4m3 midpoint {mid}")
            continue
        expected[divmod(len(blocks), bpr)] = to_e4m3(_f32(mid))
        blocks.append([in_dtype(v, dt) for v in e4m3_tie_block(b, name, i)])
    desc = (f"block amax chosen so block_amax*S_enc/6 (TE fp32 op order) is exactly halfway between "
            f"two e4m3 values; {len(expected)} of {len(e4m3_midpoints())} midpoints incl. 2^-10 (-> scale 0); "
            f"global amax {amax:g}")
    return Case(name, rows_of_blocks(blocks, bpr, dt), "1x16", desc, expected_scales=expected)


def near_ties_e4m3_fp32() -> Case:
    s_enc, _ = mirror_global(UNIT_SENC_AMAX)
    mids = [m for m in e4m3_midpoints() if m[0] in (2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 432.0, 17.0)]
    blocks = [global_amax_block(UNIT_SENC_AMAX)]
    for i, (mid, _, _) in enumerate(mids):
        for direction in (1, -1):
            lo, hi = sorted((mid, step_value(mid, 2 * direction, F32)))

            def near(b: float, mid: float = mid, lo: float = lo, hi: float = hi) -> bool:
                pre = float(mirror_scale_pre(b, s_enc))
                return pre != mid and lo <= pre <= hi  # 1 or 2 fp32 ulps off the tie

            b = search_dtype(mid * FP4_MAX, F32, near)
            if b is None:
                raise RuntimeError(f"no block amax for pre-scale near {mid}")
            blocks.append(e4m3_tie_block(b, "near_ties_e4m3", 2 * i + (direction > 0)))
    blocks = [[in_dtype(v, F32) for v in blk] for blk in blocks]
    return Case("near_ties_e4m3_fp32_1x16", rows_of_blocks(blocks, 4, F32), "1x16",
                "block scale pre-cast value = e4m3 midpoint +-(1 or 2) fp32 ulps (S_enc=1)")


def ties_e4m3_16x16_fp32() -> Case:
    s_enc, _ = mirror_global(UNIT_SENC_AMAX)
    picks = [m for m in e4m3_midpoints() if m[0] in (2.0 ** -10, 3 * 2.0 ** -10, 15 * 2.0 ** -10,
                                                       1.0625, 1.1875, 8.5, 15.5, 240.0, 432.0)]
    tiles = [torch.zeros(16, 16, dtype=F64)]
    tiles[0][3, 5] = UNIT_SENC_AMAX
    expected = {}
    for i, (mid, _, _) in enumerate(picks):
        b = find_block_amax(mid, s_enc, F32)
        if b is None:
            raise RuntimeError(f"no tile amax for e4m3 midpoint {mid}")
        fr = torch.rand(16, 16, generator=gen(f"ties_e4m3_2d/{i}"), dtype=F64) * 2 - 1
        tile = (fr * b).to(F32).to(F64)
        tile[i % 16, (3 * i) % 16] = -b
        expected[divmod(len(tiles), 4)] = to_e4m3(_f32(mid))
        tiles.append(tile)
    return Case("ties_e4m3_fp32_16x16", tiles_to_tensor(tiles, 4, F32), "16x16",
                "2D tiles whose amax puts the tile scale exactly on an e4m3 midpoint (S_enc=1)",
                expected_scales=expected)


def zero_cases() -> Iterator[Case]:
    for dn, dt in DTYPES.items():
        x = torch.zeros(4, 32, dtype=dt)
        x[1, 3] = -0.0
        x[2] = -0.0
        yield Case(f"zeros_{dn}_1x16", x, "1x16", "entirely zero tensor (amax 0) with some -0.0 elements")
        x2 = torch.zeros(17, 32, dtype=dt)
        x2[16, :] = -0.0
        yield Case(f"zeros_{dn}_16x16", x2, "16x16", "entirely zero tensor, 2D, M=17, last row -0.0")
        blocks = [
            [6.0, -6.0, 1.0, *([0.0] * 13)],
            [0.0] * 16,  # all-zero block -> scale 0
            [-0.0] * 16,  # all -0.0 block
            [0.0, -0.0] * 8,
            [-0.0, 3.0, -0.0, -2.0, *([-0.0] * 12)],  # -0.0 next to nonzero values
            # small values that round to (signed) zero, next to the block amax 6 (scale 1)
            [6.0, -0.25, 0.25, -0.125, 0.125, -1e-3, 1e-3, -0.0, 0.0, -0.2499, 0.2499, -0.2501, 0.2501,
             -0.0, -6.0, 0.0],
        ]
        blocks = [[in_dtype(v, dt) for v in b] for b in blocks]
        yield Case(f"signed_zeros_{dn}_1x16", rows_of_blocks(blocks, 3, dt), "1x16",
                   "zero blocks, -0.0 blocks, and values rounding to +-0 at scale 1 (amax 6)")
    tiles = [torch.zeros(16, 16, dtype=F64) for _ in range(4)]
    tiles[1] = randn("zero_tiles", 16, 16).to(F32).to(F64)
    tiles[2][7, 7] = -0.0
    tiles[3] = (randn("zero_tiles_b", 16, 16) * 1e-3).to(F32).to(F64)
    x = tiles_to_tensor(tiles, 2, F32)
    x[16:, 0:16] = torch.where(torch.arange(256).reshape(16, 16) % 3 == 0, -0.0, 0.0)
    yield Case("zero_tiles_fp32_16x16", x, "16x16", "2D: all-zero tiles (+-0) next to random tiles")


def saturation_cases() -> Iterator[Case]:
    s_enc, _ = mirror_global(UNIT_SENC_AMAX)
    vals = e4m3_positive_values()
    for dn, dt in DTYPES.items():
        blocks = [global_amax_block(UNIT_SENC_AMAX)]
        for lo in (2.0 ** -9, 2.0 ** -7, 0.015625, 1.0, 1.875, 6.0, 104.0, 416.0):
            hi = vals[vals.index(lo) + 1]
            pre = lo + 0.49 * (hi - lo)  # rounds down to lo, so the block amax maps to ~6*1.49*...
            b = in_dtype(pre * FP4_MAX / float(s_enc), dt)
            frac = [1.0, -1.0, 0.99, -0.97, 0.95, 0.93, 0.9, -0.88, 0.86, 0.84, 0.5, -0.3, 0.2, 0.1, 0.0, -0.05]
            blocks.append([in_dtype(f * b, dt) for f in frac])
        yield Case(f"saturate_{dn}_1x16", rows_of_blocks(blocks, 3, dt), "1x16",
                   "block scale rounds down (pre-cast ~ lo+0.49*step), so the largest elements map beyond 6 "
                   "and saturate; S_enc=1")
        yield scale_range_case(dn, dt)
    x = torch.zeros(32, 32, dtype=F64)
    x[0, 0] = UNIT_SENC_AMAX
    g = randn("saturate_2d", 16, 16)
    x[16:, :16] = g / g.abs().max() * (1.0 + 0.49 * 0.125) * FP4_MAX
    x[:16, 16:] = g.T / g.abs().max() * (416 + 0.49 * 32) * FP4_MAX
    yield Case("saturate_fp32_16x16", x.to(F32), "16x16", "2D tiles whose scale rounds down -> saturation")
    yield scale_range_case_2d()
    yield from amax_edge_cases()


def scale_range_case(dn: str, dt: torch.dtype) -> Case:
    """S_enc=1; block amaxes 2688 * 0.6^j: scales walk 448 -> normal -> subnormal -> 0."""
    name = f"scale_range_{dn}_1x16"
    x = randn(name, 6, 128).reshape(-1, 16)
    targets = torch.tensor([UNIT_SENC_AMAX * 0.6 ** j for j in range(x.shape[0])], dtype=F64)
    x = x / x.abs().amax(dim=1, keepdim=True) * targets[:, None]
    return Case(name, x.reshape(6, 128).to(dt), "1x16",
                "global amax 2688 (S_enc=1); block amax 2688*0.6^j, j=0..47: e4m3 scales from 448 through "
                "subnormals down to 0 (nonzero data in zero-scale blocks)")


def scale_range_case_2d() -> Case:
    name = "scale_range_fp32_16x16"
    tiles = []
    for j in range(12):
        t = randn(f"{name}/{j}", 16, 16)
        tiles.append(t / t.abs().max() * UNIT_SENC_AMAX * 0.3 ** j)
    x = torch.cat([torch.cat(tiles[i:i + 6], dim=1) for i in range(0, 12, 6)], dim=0)
    return Case(name, x.to(F32), "16x16", "2D tiles with amax 2688*0.3^j, j=0..11 (scales 448 .. 0)")


def amax_edge_cases() -> Iterator[Case]:
    """Global amax for which the amax block's pre-cast scale lands above / on / below 448."""
    found: dict[str, float] = {}
    g = gen("amax_edge")
    for _ in range(100_000):
        if len(found) == 3:
            break
        a = float(torch.empty((), dtype=F64).uniform_(1e-3, 1e4, generator=g).to(F32))
        s_enc, _ = mirror_global(a)
        pre = float(mirror_scale_pre(a, s_enc))
        key = "over448" if pre > FP8_MAX else ("exact448" if pre == FP8_MAX else "under448")
        found.setdefault(key, a)
    else:
        raise RuntimeError(f"amax edge search found only {sorted(found)}")
    for key in ("over448", "exact448", "under448"):
        a = found[key]
        s_enc, _ = mirror_global(a)
        fr = torch.rand(2, 32, generator=gen(f"amax_edge/{key}"), dtype=F64) * 2 - 1
        x = (fr * a).to(F32)
        x[0, 0] = a
        x[1, 17] = -a
        x[1, 18] = step_value(a, -1, F32)
        pre = float(mirror_scale_pre(a, s_enc))
        what = {"over448": "above 448, clamped to 448", "exact448": "exactly 448",
                "under448": "below 448, e4m3 rounds it to 448"}[key]
        yield Case(f"amax_edge_{key}_fp32_1x16", x, "1x16",
                   f"global amax {a!r}: its block's pre-cast scale amax*(S_enc*fp32(1/6)) = {pre!r} ({what})")


def extreme_cases() -> Iterator[Case]:
    specs = [
        ("fp32", "1em30", 1e-30), ("fp32", "1em40", 1e-40), ("fp32", "3e38", 3e38),
        ("bf16", "1em30", 1e-30), ("bf16", "1em39", 1e-39), ("bf16", "3e38", 3e38),
        ("fp16", "1em6", 1e-6), ("fp16", "6e4", 6e4),
    ]
    for dn, tag, amax in specs:
        kind = "huge" if amax > 1 else "tiny"
        name = f"{kind}_{dn}_1x16_amax{tag}"
        x = with_amax(name, 4, 64, amax, DTYPES[dn])
        yield Case(name, x, "1x16", f"random normal scaled to global amax ~{amax:g} in {dn}" + capped_note(amax))
    for dn, tag, amax in (("fp32", "1em40", 1e-40), ("fp32", "3e38", 3e38), ("fp16", "6e4", 6e4)):
        kind = "huge" if amax > 1 else "tiny"
        name = f"{kind}_{dn}_16x16_amax{tag}"
        yield Case(name, with_amax(name, 32, 32, amax, DTYPES[dn]), "16x16",
                   f"2D, random normal scaled to global amax ~{amax:g} in {dn}" + capped_note(amax))


def capped_note(amax: float) -> str:
    if amax >= GLOBAL_DENOM / float(FLT_MAX):
        return ""
    return ("; subnormal inputs; 2688/amax overflows so S_enc = FLT_MAX and TE quantizes with "
            "S_dec = 1/FLT_MAX (not amax/2688): .dequant (amax/2688 convention) underflows to ~0")


def outlier_cases() -> Iterator[Case]:
    for dn, dt in DTYPES.items():
        name = f"outlier_{dn}_1x16"
        x = randn(name, 8, 64).reshape(-1, 16)
        idx = torch.randint(0, 16, (x.shape[0],), generator=gen(name + "/idx"))
        sign = torch.where(torch.rand(x.shape[0], generator=gen(name + "/sign")) < 0.5, -1.0, 1.0).to(F64)
        mag = torch.logspace(1, 3, x.shape[0], dtype=F64)  # outlier 10x .. 1000x
        x[torch.arange(x.shape[0]), idx] = sign * mag
        yield Case(name, x.reshape(8, 64).to(dt), "1x16", "random normal with one outlier (+-10..1000) per block")
        name2 = f"outlier_{dn}_16x16"
        x2 = randn(name2, 32, 32)
        for ti in range(2):
            for tj in range(2):
                r, c = [int(v) for v in torch.randint(0, 16, (2,), generator=gen(f"{name2}/{ti}{tj}"))]
                x2[16 * ti + r, 16 * tj + c] = (-1) ** (ti + tj) * 10.0 ** (1 + ti + tj)
        yield Case(name2, x2.to(dt), "16x16", "2D, random normal with one outlier (+-10..1000) per tile")


def all_cases() -> list[Case]:
    cases = [*random_cases(), *tie_cases(), *zero_cases(), *saturation_cases(), *extreme_cases(),
             *outlier_cases()]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise RuntimeError("duplicate case names")
    for c in cases:
        if c.x.ndim != 2 or c.x.shape[1] % 16 or c.x.dtype not in DTYPE_NAMES:
            raise RuntimeError(f"bad case {c.name}: {tuple(c.x.shape)} {c.x.dtype}")
    return cases


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def run_case(ref: types.ModuleType, case: Case) -> dict[str, torch.Tensor]:
    te = te_quantize(ref, case.x, case.block)
    m = case.x.shape[0]
    if te.data.dtype != torch.uint8 or te.scale.dtype != E4M3:
        raise RuntimeError(f"{case.name}: unexpected TE dtypes {te.data.dtype} {te.scale.dtype}")
    out = {
        "x": case.x.contiguous(),
        "codes": te.data.contiguous().clone(),
        "scales": compact_scales(te.scale, m, case.block),
        "amax": te.amax.to(F32).reshape(()).clone(),
    }
    out["dequant"] = dequantize(out["codes"], out["scales"], out["amax"], case.block)
    self_check(ref, case, te, out)
    return out


def case_meta(case: Case, out: dict[str, torch.Tensor]) -> dict[str, object]:
    return {
        "name": case.name,
        "dtype": DTYPE_NAMES[case.x.dtype],
        "shape": list(case.x.shape),
        "block": case.block,
        "scales_shape": list(out["scales"].shape),
        "description": case.description,
    }


TE_ARITHMETIC = (
    "TE 2.20.2 NVFP4QuantizerRef (non-4over6, non-pow2), all fp32: amax = max|x| (input dtype) -> fp32; "
    "S_enc = min(2688/amax, FLT_MAX), replaced by 1 only if it is 0 (amax=inf); amax=0 gives S_enc=FLT_MAX; "
    "S_dec = 1/S_enc; pre = min(block_amax * (S_enc * fp32(1/6)), FLT_MAX) [1/6 folded into S_enc first]; "
    "s_blk = e4m3fn(clamp(pre, -448, 448)) (torch RNE cast); enc = min(1/(float(s_blk) * S_dec), FLT_MAX) "
    "[division]; y = clamp(x.float() * enc, -6, 6); code = RNE onto E2M1 via comparisons, ties to even "
    "mantissa; sign bit only for y < 0 (so -0.0 -> code 0, -0.1 -> code 8, NaN -> code 0). 16x16: block_amax "
    "over the 16x16 tile (rows zero-padded to a multiple of 16), same formulas."
)


CONVENTIONS = (
    "codes: uint8 [M,K/2], element 2i in low nibble, 2i+1 in high nibble; E2M1 code bit3=sign, bits0-2 index "
    "into [0,0.5,1,1.5,2,3,4,6] (TE's cast_to_fp4x2 layout, unchanged). scales: raw bytes of float8_e4m3fn "
    "decode scales, linear layout; 1x16: [M,K/16]; 16x16: [ceil(M/16),K/16], one per 16x16 tile (TE repeats "
    "each tile scale on the tile's 16 padded rows; every 16th row kept). amax: fp32 scalar shape [], TE's "
    "global_amax_row = max|x| (weight_scale_2 = amax/2688). dequant: NOT a TE output (the reference has no "
    "dequantize); correctly rounded fp32 of e2m1*s_blk*amax/2688 computed in float64 (the scale TE's qgemm "
    "applies); for amax < 2688/FLT_MAX TE quantizes with S_dec = 1/FLT_MAX instead, so it is ~0 there."
)


def build_metadata(te_version: str, wheel: Path, wheel_sha: str, ref_sha: str,
                   cases: list[dict[str, object]]) -> dict[str, str]:
    return {
        "cases": json.dumps(cases),
        "te_version": te_version,
        "te_wheel": wheel.name,
        "wheel_sha256": wheel_sha,
        "te_reference_file": REF_MEMBER,
        "te_reference_sha256": ref_sha,
        "te_quantizer": "nvfp4_ref_rht_2d_factory(role) -> NVFP4QuantizerRef; role (linear, weight) for 16x16, "
                        "(linear, input) for 1x16; set_usage(rowwise=True, columnwise=False); with_rht=False (RHT only "
                        "affects the unused columnwise output); quantize(x); rowwise data/scale/global_amax_row",
        "torch_version": torch.__version__.split("+")[0],
        "generator": f"python tools/make_te_golden_vectors.py --te-version {te_version}",
        "conventions": CONVENTIONS,
        "te_arithmetic": TE_ARITHMETIC,
        "amax_shape": "[]",
        "scales_2d_layout": "[ceil(M/16), K/16], one e4m3 scale per 16x16 tile",
        "skipped_dtypes": json.dumps([]),
        "supported_dtypes": json.dumps(sorted(DTYPES)),
    }


def canonical_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with a key-sorted header, so that equal inputs give equal files
    (the library writes ``__metadata__`` in hash-map order, which varies between runs)."""
    blob = save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.dumps(json.loads(blob[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + blob[8 + n:]


def write_atomic(tensors: dict[str, torch.Tensor], metadata: dict[str, str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    data = canonical_safetensors(tensors, metadata)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        check_readback(Path(tmp), tensors, metadata)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_readback(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    with safe_open(str(path), "pt") as f:
        if f.metadata() != metadata or sorted(f.keys()) != sorted(tensors):
            raise RuntimeError("safetensors read-back mismatch (metadata or keys)")
        for key, t in tensors.items():
            got = f.get_tensor(key)
            if got.dtype != t.dtype or got.shape != t.shape or got.reshape(-1).view(torch.uint8).tolist() != \
                    t.reshape(-1).view(torch.uint8).tolist():
                raise RuntimeError(f"safetensors read-back mismatch for {key}")


def generate(ref: types.ModuleType) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
    tensors: dict[str, torch.Tensor] = {}
    metas: list[dict[str, object]] = []
    for case in all_cases():
        out = run_case(ref, case)
        for key, t in out.items():
            tensors[f"{case.name}.{key}"] = t
        metas.append(case_meta(case, out))
        LOG.debug("%s: %s %s", case.name, case.block, tuple(case.x.shape))
    return tensors, metas


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / DEFAULT_OUT,
                   help=f"output safetensors (default: <repo>/{DEFAULT_OUT})")
    p.add_argument("--cache-dir", type=Path, default=REPO_ROOT / DEFAULT_CACHE_DIR,
                   help=f"where the TE wheel is downloaded (default: <repo>/{DEFAULT_CACHE_DIR})")
    p.add_argument("--te-version", default=DEFAULT_TE_VERSION, help="transformer-engine version (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.set_flush_denormal(False)  # TE's reference on CPU keeps fp32 subnormals
    wheel = fetch_wheel(args.te_version, args.cache_dir.resolve())
    wheel_sha = check_wheel(wheel, args.te_version)
    ref_sha = hashlib.sha256(read_members(wheel)[REF_MEMBER].encode()).hexdigest()
    ref = load_reference(wheel)
    tensors, metas = generate(ref)
    out = args.out.resolve()
    write_atomic(tensors, build_metadata(args.te_version, wheel, wheel_sha, ref_sha, metas), out)
    LOG.info("wrote %d cases (%d tensors, %d bytes) to %s", len(metas), len(tensors), out.stat().st_size, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
