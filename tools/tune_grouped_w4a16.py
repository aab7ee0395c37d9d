"""Time every tile config of the grouped W4A16 kernels at decode sizes of an MoE's expert shapes.

    python tools/tune_grouped_w4a16.py --out tune.json [--tokens 8 32 64 128 256 512]
        [--shape gate_up:1536,2048 --shape down:2048,768] [--experts 128] [--topk 8]
    python tools/tune_grouped_w4a16.py --launch-only {ws,triton} --tokens 64 [--shape ...]
        # one case's kernel launched 3 times, untimed: for ncu (tools/gpu/ncu_grouped.sh)

For each expert projection ``[E, N, K]`` and each decode batch (``tokens`` tokens, each routed to
``topk`` experts with a trained model's skew: expert popularity ``exp(0.5 z)``, ``z ~ N(0, 1)``), on
one CUDA GPU:

- the Triton grouped kernel (``kernel="triton"``) at every config of :data:`TRITON_TILES` with each
  token tile it may take, checked against the reference first;
- the kernel's default tile for the call (``kernels.w4a16.grouped_tile``);
- the warp-specialized Gluon grouped kernel (x in its K order, sm_90) at :data:`WS_CONFIGS`, and
  what putting the tokens' rows in that order costs;
- the byte floor: the reached experts' FP4 codes and scales, x and y, over the device-to-device
  copy bandwidth measured in the same run.

Writes one JSON record under the key ``gpu`` (device, date, command, bandwidth, per case every timing
and the best config), as benchmarks/results files hold them, and prints a summary line per case. The evidence for ``kernels.w4a16.GROUPED_TILES``,
``kernels.w4a16_ws.WIDE_K_CONFIG`` and ``kernels.dispatch.X_ORDER_MIN_ROWS_PER_EXPERT``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

TRITON_TILES = [(bn, bk, w, st) for bn in (64, 128, 256) for bk in (128, 256) for w in (4, 8) for st in (3, 4, 5)]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton grouped kernel's sweep."""

WS_CONFIGS = [
    {},
    {"DYNAMIC": 0},
    {"DYNAMIC": 1},
    {"BLOCK_N": 64, "num_warps": 4, "STAGES": 2, "CTAS_PER_SM": 2, "maxnreg": 128},
    {"BLOCK_K": 128, "STAGES": 3},
    {"BLOCK_K": 128, "STAGES": 4, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3, "maxnreg": 80},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 2, "CTAS_PER_SM": 4, "maxnreg": 64},
    {"BLOCK_M": 16},
    {"BLOCK_M": 32},
    {"WG_SPLIT": 1},
    {"WG_SPLIT": 1, "DYNAMIC": 0},
    {"BLOCK_N": 64, "num_warps": 4, "STAGES": 3, "CTAS_PER_SM": 4, "maxnreg": 64},
]
"""Configs of the warp-specialized grouped kernel over its defaults (``w4a16_ws.default_config``)."""


def time_us(fn) -> float:
    """Median microseconds per call over CUDA-graph replays (Triton's ``do_bench_cudagraph``)."""
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=20, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write) of a 1 GiB copy, after a second of
    copies (an idle GPU starts at low clocks)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        dst.copy_(src)
        torch.cuda.synchronize()
    return 2 * src.numel() * 4 / (time_us(lambda: dst.copy_(src)) * 1e-6)


def skewed_counts(tokens: int, experts: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """Rows per expert when ``tokens`` tokens each pick ``topk`` distinct experts, popularity ``exp(0.5 z)``."""
    bias = 0.5 * torch.randn(experts, generator=generator, device="cuda")
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=generator, device="cuda")))
    choice = (bias + gumbel).topk(topk, dim=1).indices.flatten()
    return torch.bincount(choice, minlength=experts)


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """int32 expert offsets ``[E + 1]`` of per-expert row counts."""
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)


def routed_case(n: int, k: int, experts: int, topk: int, tokens: int, generator: torch.Generator):
    """``(weight, rows per expert, expert offsets, routed x, output buffer)`` of one decode call: a random
    ``[E, N, K]`` stack and ``tokens`` tokens routed with :func:`skewed_counts`."""
    weight = stacked_weight(experts, n, k)
    counts = skewed_counts(tokens, experts, topk, generator)
    x = torch.randn(tokens * topk, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens * topk, n, device="cuda", dtype=torch.bfloat16)
    return weight, counts, offsets_of(counts), x, out


def stacked_weight(experts: int, n: int, k: int):
    """A random ``[E, N, K]`` NVFP4 stack with per-expert ``weight_scale_2``."""
    from megatron_quads.nvfp4 import quantize

    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return quantize(w, global_amax=w.abs().amax(dim=(1, 2)).unsqueeze(1).float())


def tune_case(name: str, n: int, k: int, experts: int, topk: int, tokens: int, bandwidth: float,
              generator: torch.Generator) -> dict:
    """Every timing of one (projection, tokens) case (see module docstring)."""

    from megatron_quads.kernels import w4a16
    from megatron_quads.kernels.dispatch import X_ORDER_BLOCK_K, warp_specialized_grouped

    qw, counts, offsets, x, out = routed_case(n, k, experts, topk, tokens, generator)
    rows = tokens * topk
    reference = w4a16.grouped_w4a16_into(x, qw, offsets, torch.empty_like(out), kernel="triton",
                                         config={"BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_M": 16})
    atol = 1e-3 * float(reference.float().abs().max())
    active = int((counts > 0).sum())
    nbytes = active * (n * k // 2 + n * k // 16) + rows * (k + n) * 2
    case = {"case": name, "N": n, "K": k, "tokens": tokens, "rows": rows, "active_experts": active,
            "busiest_over_mean": round(float(counts.max()) / (rows / experts), 2),
            "floor_us": round(nbytes / bandwidth * 1e6, 2)}

    block_m_default = w4a16._grouped_block_m(rows, experts)
    triton_times: dict[str, float | str] = {}
    for block_m in sorted({16, 32, 64} & {block_m_default, max(16, block_m_default // 2), min(64, block_m_default * 2)}):
        for bn, bk, warps, stages in TRITON_TILES:
            cfg = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            label = f"m{block_m} n{bn} k{bk} w{warps} s{stages}"
            try:
                out.fill_(float("nan"))
                w4a16.grouped_w4a16_into(x, qw, offsets, out, cfg, kernel="triton")
                if not torch.allclose(out.float(), reference.float(), rtol=2**-7, atol=atol):
                    triton_times[label] = "WRONG"
                    continue
                triton_times[label] = round(time_us(lambda: w4a16.grouped_w4a16_into(x, qw, offsets, out, cfg, kernel="triton")), 2)
            except Exception as err:  # a config that does not build or run here is recorded, not fatal
                triton_times[label] = f"error: {str(err).strip().splitlines()[-1][:100]}"
    timed = {key: t for key, t in triton_times.items() if isinstance(t, float)}
    best = min(timed, key=timed.get)
    case.update(triton_best=best, triton_best_us=timed[best], triton_best_frac_of_floor=round(case["floor_us"] / timed[best], 3),
                triton_sweep=triton_times)

    tile = {"BLOCK_M": block_m_default, **w4a16.grouped_tile(block_m_default, False)}
    case["default_tile"] = {"config": str(tile), "us": round(time_us(lambda: w4a16.grouped_w4a16_into(x, qw, offsets, out, kernel="triton")), 2)}

    ws = warp_specialized_grouped(x.device, k)
    if ws is not None:
        ordered = w4a16.mma_k_order_rows(x, X_ORDER_BLOCK_K)
        ws_times: dict[str, float | str] = {}
        for cfg in WS_CONFIGS:
            label = ",".join(f"{key}={value}" for key, value in cfg.items()) or "default"
            try:
                out.fill_(float("nan"))
                ws.grouped_w4a16_ws_into(ordered, qw, offsets, out, cfg)
                if not torch.allclose(out.float(), reference.float(), rtol=2**-7, atol=atol):
                    ws_times[label] = "WRONG"
                    continue
                ws_times[label] = round(time_us(lambda cfg=cfg: ws.grouped_w4a16_ws_into(ordered, qw, offsets, out, cfg)), 2)
            except Exception as err:  # as above
                ws_times[label] = f"error: {str(err).strip().splitlines()[-1][:100]}"
        timed = {key: t for key, t in ws_times.items() if isinstance(t, float)}
        if timed:
            best = min(timed, key=timed.get)
            case.update(ws_best=best, ws_best_us=timed[best], ws_best_frac_of_floor=round(case["floor_us"] / timed[best], 3))
        case["ws_sweep"] = ws_times
        hidden = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        case["order_tokens_us"] = round(time_us(lambda: w4a16.mma_k_order_rows(hidden, X_ORDER_BLOCK_K)), 2)
    return case


def launch_only(kernel: str, n: int, k: int, experts: int, topk: int, tokens: int, generator: torch.Generator) -> None:
    """Launch one case's grouped kernel (``"ws"``: x in its K order; ``"triton"``: natural x) at its
    defaults three times, untimed, for a profiler that picks the last launch."""
    from megatron_quads.kernels import w4a16
    from megatron_quads.kernels.dispatch import X_ORDER_BLOCK_K

    qw, _, offsets, x, out = routed_case(n, k, experts, topk, tokens, generator)
    ordered = kernel == "ws"
    if ordered:
        x = w4a16.mma_k_order_rows(x, X_ORDER_BLOCK_K)
    for _ in range(3):
        w4a16.grouped_w4a16_into(x, qw, offsets, out, x_mma_order=ordered, kernel=kernel)
    torch.cuda.synchronize()


def parse_shape(text: str) -> tuple[str, int, int]:
    """``name:N,K`` (argparse type)."""
    name, _, dims = text.partition(":")
    parts = dims.split(",")
    if not name or len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected NAME:N,K (e.g. gate_up:1536,2048), got {text!r}")
    return name, int(parts[0]), int(parts[1])


def main(argv: list[str] | None = None) -> None:
    """Sweep and write the record (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON record to write (the sweep)")
    parser.add_argument("--launch-only", choices=("ws", "triton"), default=None,
                        help="launch the first shape's kernel at the first token count three times, untimed (for ncu)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512])
    parser.add_argument("--shape", type=parse_shape, action="append", default=None, metavar="NAME:N,K",
                        help="an expert projection (default: Qwen3-30B-A3B's gate_up:1536,2048 and down:2048,768)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_grouped_w4a16.py needs a CUDA GPU (the kernels are timed, not emulated)")
    shapes = args.shape or [("gate_up", 1536, 2048), ("down", 2048, 768)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    if args.launch_only:
        _, n, k = shapes[0]
        launch_only(args.launch_only, n, k, args.experts, args.topk, args.tokens[0], generator)
        return
    if args.out is None:
        parser.error("--out is required for the sweep")
    bandwidth = copy_bandwidth()
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "command": "python tools/tune_grouped_w4a16.py " + " ".join(sys.argv[1:]),
              "copy_GBps": round(bandwidth / 1e9, 1), "experts": args.experts, "topk": args.topk, "cases": []}
    for name, n, k in shapes:
        for tokens in args.tokens:
            case = tune_case(name, n, k, args.experts, args.topk, tokens, bandwidth, generator)
            record["cases"].append(case)
            args.out.write_text(json.dumps({"gpu": record}, indent=1))  # benchmarks/results' keyed form
            print(f"{name} tokens={tokens}: floor {case['floor_us']} us, triton best {case['triton_best_us']} "
                  f"({case['triton_best']}), default tile {case['default_tile']['us']}, ws best {case.get('ws_best_us')} "
                  f"({case.get('ws_best')})", flush=True)


if __name__ == "__main__":
    main()
