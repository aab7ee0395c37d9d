"""FLOP and byte overhead of RAC over plain W4A4, computed per ratio and measured on CPU.

    python benchmarks/bench_rac_cpu.py [--out benchmarks/results/rac_cpu.json]

The computed columns are what an FP4 kernel moves and multiplies: the augmented GEMM has
``K + |S|`` reduction columns, so FLOPs and weight bytes grow by ``|S| / K``. The measured columns
time the PyTorch reference (``rac_linear`` vs ``w4a4_linear``), which emulates the FP4 GEMM with
dequantized operands: its overhead also includes the residual's second quantization pass. Results
go to ``benchmarks/results/rac_cpu.json`` (the newest record) and ``rac_cpu.md`` (``--render``
rewrites the table alone).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from results_io import load_records, save_record, write_text_atomic
from torch.utils.benchmark import Timer

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.rac import (
    num_residual_channels,
    rac_linear,
    select_channels,
)
from megatron_quads.rollout.w4a4 import w4a4_linear

SHAPES = [(64, 2048, 2048), (64, 4096, 4096)]  # tokens, K, N (decode-like batch)
RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)
KEY = "cpu"


def _bytes(tokens: int, k: int, n: int) -> int:
    """FP4 operand bytes of one GEMM over K columns: codes (1/2 byte) + e4m3 scales (1/16 byte each)."""
    return (n + tokens) * (k // 2 + k // 16)


def case(tokens: int, k: int, n: int) -> list[dict]:
    """Computed and measured overhead of each ratio for one shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    wq = quantize((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16))
    base = Timer("w4a4_linear(x, wq)", globals={"w4a4_linear": w4a4_linear, "x": x, "wq": wq})
    base_ms = base.blocked_autorange(min_run_time=0.5).median * 1e3
    rows = []
    for ratio in RATIOS:
        s = num_residual_channels(k, ratio)
        channels = select_channels(torch.rand(k, generator=gen), ratio)
        ws = reblock_columns(wq, channels)
        t = Timer("rac_linear(x, wq, c, ws)", globals={"rac_linear": rac_linear, "x": x, "wq": wq, "c": channels, "ws": ws})
        ms = t.blocked_autorange(min_run_time=0.5).median * 1e3
        rows.append({
            "tokens": tokens, "K": k, "N": n, "ratio": ratio, "residual_channels": s,
            "flop_overhead": s / k,
            "byte_overhead": _bytes(tokens, k + s, n) / _bytes(tokens, k, n) - 1,
            "w4a4_ms": round(base_ms, 3), "rac_ms": round(ms, 3), "measured_overhead": round(ms / base_ms - 1, 4),
        })
    return rows


def markdown(records: dict[str, dict]) -> str:
    """The Markdown table of the file's record."""
    record = records[KEY]
    lines = [
        f"# RAC overhead over W4A4 ({record['date']}, {record['device']}, torch {record['torch']})", "",
        f"Command: `{record['command']}`. Computed: FP4 kernel FLOPs and operand bytes. Measured: the "
        "PyTorch reference (emulated GEMM + the residual's second quantization).", "",
        "| tokens x K x N | ratio | residual channels | FLOPs + | bytes + | W4A4 ms | RAC ms | measured + |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['tokens']}x{r['K']}x{r['N']} | {r['ratio']:.3f} | {r['residual_channels']} | {r['flop_overhead']:.1%} | "
            f"{r['byte_overhead']:.1%} | {r['w4a4_ms']:.2f} | {r['rac_ms']:.2f} | {r['measured_overhead']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run every shape and ratio; store the record in the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rac_cpu.json"))
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown table from the JSON file")
    args = parser.parse_args()
    if args.render:
        write_text_atomic(args.out.with_suffix(".md"), markdown(load_records(args.out)))
        return
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "command": "python benchmarks/bench_rac_cpu.py",
        "rows": [row for shape in SHAPES for row in case(*shape)],
    }
    records = save_record(args.out, KEY, record, args.out.with_suffix(".md"), markdown)
    print(markdown(records))


if __name__ == "__main__":
    main()
