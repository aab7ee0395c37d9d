"""The dense ws kernel's timing probes (benchmarks/diag_ws_dense_floor.py) remove what they say.

Each probe patches a compile-time global of the kernels; a refactor that stopped reading one (a
helper importing ``warpgroup_mma`` under another name, say) would leave the probe timing the real
kernel under a wrong label. Each case compiles the patched kernel for sm_90 offline in a fresh
process (the patches last for the process) and counts what is left in its SASS.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

_COUNT = """
import collections, json, re, sys, torch
sys.path.insert(0, {benchmarks!r})
import diag_ws_dense_floor as diag
diag.apply_ablation({names!r})
from megatron_quads.kernels import w4a16_ws_dense
cfg = w4a16_ws_dense.resolve_config(16, 1024, 4096, torch.device("cpu"), {config!r})
sass = w4a16_ws_dense.compile_offline(cfg, 1024, 4096, x_mma_order=True)["sass"]
ops = collections.Counter(re.findall(r"^\\s+/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9]+)", sass, re.MULTILINE))
print(json.dumps(ops))
"""


def _ops(names: str, config: dict | None = None) -> collections.Counter:
    done = subprocess.run([sys.executable, "-c", _COUNT.format(benchmarks=str(BENCHMARKS), names=names, config=config)],
                          capture_output=True, text=True, check=True, timeout=300)
    return collections.Counter(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_probes_remove_the_dequantization_the_x_copies_and_the_mma() -> None:
    real = _ops("none")
    assert real["HGMMA"] > 0 and real["UTMALDG"] == 6 and real["HMUL2"] > 0  # words, scales, four x tiles
    no_dequant = _ops("no_dequant")
    # what is left of the multiplies: the scale bytes' conversion (two a scale pair), not a word's four
    assert no_dequant["HMUL2"] * 8 <= real["HMUL2"] and no_dequant["HGMMA"] == real["HGMMA"]
    ring_only = _ops("no_dequant,no_x,no_mma")
    assert ring_only["HGMMA"] == 0 and ring_only["UTMALDG"] == 2 and ring_only["HMUL2"] == 0
    deep = _ops("no_dequant,no_x,no_mma", {"STAGES": 8, "CTAS_PER_SM": 1, "SPLIT_K": 1})
    assert deep["UTMALDG"] == 2 and deep["ATOMG"] == 0  # one tile a program: no split-K arrivals


def test_an_unknown_probe_is_refused() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import diag_ws_dense_floor as diag

    with pytest.raises(ValueError, match="unknown probe"):
        diag.apply_ablation("no_dequant,no_loads")
