"""The grouped W4A16 diagnostic (benchmarks/diag_grouped_w4a16.py) builds and compiles its variants.

Each variant is a source transformation of megatron_quads/kernels/w4a16.py anchored on exact
lines; this compiles every variant for sm_90 offline (no GPU needed) and checks that each one
changed what it says it changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import diag_grouped_w4a16 as diag


@pytest.fixture(scope="module")
def cubin_sizes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    directory = tmp_path_factory.mktemp("diag_grouped")
    return {name: diag.compile_offline(diag.load_variant(name, directory)) for name in diag.VARIANTS}


def test_every_variant_compiles_for_sm90(cubin_sizes: dict[str, int]) -> None:
    assert all(size > 10_000 for size in cubin_sizes.values()), cubin_sizes
    # 4 moves where the dequantization PTX was: a smaller kernel; a constant x tile: a different one
    assert cubin_sizes["nodq"] < cubin_sizes["real"] and cubin_sizes["nox"] != cubin_sizes["real"]


def test_variants_replace_exactly_their_anchor() -> None:
    assert diag.variant_source("real") == diag.SOURCE
    for name, old in (("nodq", diag._DEQUANT_CALL), ("nox", diag._X_LOAD)):
        src = diag.variant_source(name)
        assert old not in src and src.count("\n") == diag.SOURCE.count("\n")
    with pytest.raises(RuntimeError, match="anchor is gone"):
        diag._replace("def f():\n    pass\n", diag._X_LOAD, "")
