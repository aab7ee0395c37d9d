"""Byte-exact agreement with Transformer Engine's NVFP4 reference quantizer.

The vectors in tests/data/te_nvfp4_golden.safetensors were produced by
``tools/make_te_golden_vectors.py``, which runs TE 2.20's own ``reference_nvfp4.py`` (fetched from its
wheel) on CPU. Each case holds the input, TE's packed codes, its e4m3 scale bytes and its amax. 2D
cases store one scale per 16x16 tile; the project stores that scale on every row of the tile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_quads.nvfp4 import dequantize, quantize

GOLDEN = Path(__file__).parent / "data" / "te_nvfp4_golden.safetensors"


def _load_cases() -> tuple[dict, list[dict], dict[str, torch.Tensor]]:
    with safe_open(str(GOLDEN), "pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return metadata, json.loads(metadata["cases"]), tensors


METADATA, CASES, TENSORS = _load_cases()


def _mismatches(case: dict, codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> list[str]:
    """Every way our (codes, tile-compacted scale bytes, amax) differ from TE's for one case."""
    name = case["name"]
    problems = []
    expected_codes = TENSORS[f"{name}.codes"]
    if not torch.equal(codes, expected_codes):
        n = int((codes != expected_codes).sum())
        problems.append(f"{name}: {n} packed code bytes differ")
    expected_scales = TENSORS[f"{name}.scales"]
    if not torch.equal(scales, expected_scales):
        n = int((scales != expected_scales).sum())
        problems.append(f"{name}: {n} scale bytes differ")
    if amax.reshape(()).item() != TENSORS[f"{name}.amax"].reshape(()).item():
        problems.append(f"{name}: amax {amax.item()} != {TENSORS[f'{name}.amax'].item()}")
    return problems


def _ours(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = TENSORS[f"{case['name']}.x"]
    block_2d = case["block"] == "16x16"
    t = quantize(x, block_2d=block_2d)
    scale_bytes = t.scales.view(torch.uint8)
    if block_2d:
        scale_bytes = scale_bytes[::16]  # one row per 16-row tile, as the golden file stores it
    return t.codes, scale_bytes, t.global_amax


def test_golden_file_covers_the_required_cases() -> None:
    names = " ".join(c["name"] for c in CASES)
    dtypes = {c["dtype"] for c in CASES}
    blocks = {c["block"] for c in CASES}
    assert dtypes == {"bf16", "fp16", "fp32"} and blocks == {"1x16", "16x16"}
    for kind in ("rand", "ties_e2m1", "ties_e4m3", "zero", "sat", "tiny", "huge", "outlier"):
        assert kind in names, f"no golden case of kind {kind!r}"
    assert METADATA["te_version"] == "2.20.2"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_codes_scales_and_amax_are_te_bytes(case: dict) -> None:
    codes, scales, amax = _ours(case)
    assert _mismatches(case, codes, scales, amax) == []


@pytest.mark.parametrize("case", [c for c in CASES if c["name"].startswith("rand")], ids=lambda c: c["name"])
def test_dequantize_matches_exact_value_within_one_rounding(case: dict) -> None:
    x = TENSORS[f"{case['name']}.x"]
    ours = dequantize(quantize(x, block_2d=case["block"] == "16x16"), torch.float32)
    exact = TENSORS[f"{case['name']}.dequant"]  # e2m1 * scale * amax / 2688 in fp64, rounded once
    assert torch.allclose(ours, exact, rtol=2**-22, atol=0)


def test_one_changed_code_is_detected() -> None:
    case = next(c for c in CASES if c["name"].startswith("ties_e2m1"))
    codes, scales, amax = _ours(case)
    assert _mismatches(case, codes, scales, amax) == []
    flipped = codes.clone()
    flipped.view(-1)[3] ^= 0x01  # change one 4-bit code in one byte
    assert _mismatches(case, flipped, scales, amax) == [f"{case['name']}: 1 packed code bytes differ"]
    bumped = scales.clone()
    bumped.view(-1)[0] += 1
    assert _mismatches(case, codes, bumped, amax) == [f"{case['name']}: 1 scale bytes differ"]
