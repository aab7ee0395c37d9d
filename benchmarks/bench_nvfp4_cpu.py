"""Time the reference NVFP4 quantize / dequantize / fake_quant on CPU and write a results file.

    python benchmarks/bench_nvfp4_cpu.py [--out benchmarks/results/nvfp4_cpu.json] [--min-run-time 1.0]

Each run replaces the file's record (date, device, torch version, threads, per-case times) and
rewrites the Markdown table beside it (``--render`` rewrites the table alone). No assertions: speed
targets live here, never in unit tests.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

import torch
from results_io import load_records, save_record, write_text_atomic
from torch.utils.benchmark import Timer

from megatron_quads.nvfp4 import dequantize, fake_quant, quantize

SHAPES = [(16, 4096), (1024, 1024), (4096, 4096)]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _median_ms(stmt: str, env: dict, min_run_time: float) -> float:
    return Timer(stmt=stmt, globals=env).blocked_autorange(min_run_time=min_run_time).median * 1e3


def bench_case(rows: int, cols: int, min_run_time: float) -> dict:
    """Time one shape; bandwidth counts bf16 bytes in plus packed codes and scales out."""
    x = torch.randn(rows, cols, dtype=torch.bfloat16)
    t = quantize(x)
    w = x.clone().requires_grad_(True)
    env = {"quantize": quantize, "dequantize": dequantize, "fake_quant": fake_quant, "x": x, "t": t, "w": w}
    bf16_bytes = x.numel() * 2
    nvfp4_bytes = t.codes.numel() + t.scales.numel()
    times = {
        "quantize_ms": _median_ms("quantize(x)", env, min_run_time),
        "dequantize_ms": _median_ms("dequantize(t)", env, min_run_time),
        "fake_quant_fwd_bwd_ms": _median_ms("fake_quant(w).sum().backward()", env, min_run_time),
    }
    return {
        "shape": [rows, cols],
        **{k: round(v, 4) for k, v in times.items()},
        "quantize_GBps": round((bf16_bytes + nvfp4_bytes) / times["quantize_ms"] / 1e6, 3),
        "dequantize_GBps": round((bf16_bytes + nvfp4_bytes) / times["dequantize_ms"] / 1e6, 3),
    }


KEY = "cpu"


def markdown(records: dict[str, dict]) -> str:
    """The Markdown table of the file's record."""
    record = records[KEY]
    lines = [
        f"# NVFP4 reference on CPU ({record['date']}, {record['device']}, torch {record['torch']}, "
        f"{record['threads']} threads)",
        "",
        f"Command: `{record['command']}`",
        "",
        "| shape | quantize ms | GB/s | dequantize ms | GB/s | fake_quant fwd+bwd ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in record["cases"]:
        lines.append(
            f"| {c['shape'][0]}x{c['shape'][1]} | {c['quantize_ms']:.3f} | {c['quantize_GBps']:.2f} | "
            f"{c['dequantize_ms']:.3f} | {c['dequantize_GBps']:.2f} | {c['fake_quant_fwd_bwd_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark and store its record in the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/nvfp4_cpu.json"))
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown table from the JSON file")
    args = parser.parse_args()
    if args.render:
        write_text_atomic(args.out.with_suffix(".md"), markdown(load_records(args.out)))
        return

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/bench_nvfp4_cpu.py"
        + (f" --min-run-time {args.min_run_time:g}" if args.min_run_time != parser.get_default("min_run_time") else ""),
        "cases": [bench_case(r, c, args.min_run_time) for r, c in SHAPES],
    }
    records = save_record(args.out, KEY, record, args.out.with_suffix(".md"), markdown)
    print(markdown(records))


if __name__ == "__main__":
    main()
