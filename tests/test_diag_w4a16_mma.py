"""The Gluon kernel diagnostic (benchmarks/diag_w4a16_mma.py) builds and compiles its variants.

Each variant is a source transformation of megatron_quads/kernels/w4a16_mma.py anchored on
exact lines; a refactor of the kernel can move an anchor somewhere it still matches but no longer
compiles (it happened once: the K-split lines moved into a helper). This compiles every variant for
sm_90 offline, which needs no GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import diag_w4a16_mma as diag


@pytest.mark.parametrize("variant", ["real", "loads", "loadsw", "nodq"])
def test_every_variant_compiles_for_sm90(variant: str, tmp_path: Path) -> None:
    module = diag.load_variant(variant, tmp_path)
    sizes = {config: diag.compile_offline(module, config) for _, config, variants in diag.CASES
             if variant in {name for name, _ in variants}}
    assert sizes and all(size > 10_000 for size in sizes.values()), sizes


def test_a_moved_anchor_is_reported() -> None:
    with pytest.raises(RuntimeError, match="anchor is gone"):
        diag._replace("def f():\n    pass\n", "    k_tiles = K // BLOCK_K\n", "")
