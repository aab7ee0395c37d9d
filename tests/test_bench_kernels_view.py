"""The Markdown view of the GPU kernel results and the shape option (benchmarks/bench_kernels.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import argparse

import pytest
from bench_kernels import _shape_arg, markdown_view


def _record(date: str, command: str, rows: list[dict]) -> dict:
    return {"date": date, "device": "NVIDIA H200", "command": command, "copy_GBps": 4250.0, "eager_timed": [],
            "rows": rows}


def test_each_section_shows_its_record_in_a_fixed_order() -> None:
    records = {
        "rac": _record("2026-11-02", "--only rac", [{"case": "new rac", "us": 16.8}]),
        "grouped": _record("2026-11-02", "--only rac grouped", []),
        "quantize": _record("2026-11-01", "full", [{"case": "q", "us": 54.0, "sweep": {"a": 1.0}}]),
    }
    view = markdown_view(records)
    assert view.index("## quantize") < view.index("## rac")
    assert "## grouped" not in view  # an empty section shows nothing
    rac = view[view.index("## rac"):]
    assert "NVIDIA H200, 2026-11-02: `--only rac`; device-to-device copy 4250.0 GB/s" in rac
    assert "| new rac | 16.8 |" in rac
    quantize = view[view.index("## quantize"):view.index("## rac")]
    assert "2026-11-01: `full`" in quantize
    assert "| case | us |" in quantize and "sweep" not in quantize  # sweeps stay in the JSON


def test_dense_shape_option_parses_three_positive_integers() -> None:
    assert _shape_arg("64,8192,4096") == (64, 8192, 4096)
    for bad in ("64,8192", "64,0,8", "a,b,c", "1,2,3,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected M,K,N"):
            _shape_arg(bad)


def test_l2_cold_copies_pass_three_l2s_and_rotating_visits_every_copy_in_turn() -> None:
    from bench_kernels import L2_COLD_BYTES, l2_cold_copies, rotating

    fp4_8192 = 8192 * 8192 // 2 + 8192 * 8192 // 16  # 37.7 MB: fits the H200's 50 MB L2 alone
    copies = l2_cold_copies(fp4_8192)
    assert copies * fp4_8192 >= L2_COLD_BYTES > (copies - 1) * fp4_8192
    assert l2_cold_copies(4 * L2_COLD_BYTES) == 2  # never one copy: a replay would reread it
    seen = []
    call = rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [1, 2, 0, 1, 2, 0, 1]
