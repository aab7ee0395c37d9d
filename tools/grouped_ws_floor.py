"""Where the warp-specialized grouped W4A16 kernel's time goes at decode sizes: stream or compute.

    python tools/grouped_ws_floor.py --out floor.json [--tokens 8 64 256] [--experts 128] [--topk 8]

For Qwen3-30B-A3B's expert projections (gate/up ``N 1536, K 2048``, down ``N 2048, K 768``), each
plain (W4A16) and with a QUADS 50% RAC tail (``K2`` 1024 and 384 widened to the kernel's 512), and
``tokens`` tokens routed top-k with a trained router's skew (``tune_grouped_w4a16.skewed_counts``),
on one CUDA GPU (sm_90), the median over CUDA-graph replays of:

- ``kernel_us``: ``w4a16_ws.grouped_w4a16_ws_into`` at its default config, and per config variant of
  :data:`VARIANTS` (``split_us``: ``WG_SPLIT``, each MMA warpgroup its own partition; ``pipe_us``:
  ``A_PIPE``, each sub-step dequantized while the previous one's wgmma run; ``rotated_us`` and
  ``balanced_us``: the codes in those code orders, ``kernels.code_orders``), each checked to give the
  default's bits;
- ``no_stream_us``: the same launch with the weight's (and tail's) TMA descriptors spanning the first
  expert only. Every other expert's boxes lie outside them, so TMA fills them with zeros without
  reading memory; the loader, the ring, the dequantization, the wgmma and the stores run as before.
  This is the kernel's time with the weight stream taken away: its compute and pipeline floor (the
  output of those experts is checked to be zero, so a probe that read memory would fail);
- ``read_us``: a plain load loop over the reached experts' code and scale bytes (one launch a
  tensor): what streaming them alone takes;
- ``floor_us``: those bytes plus x and y over the device-to-device copy bandwidth of the same run.

If ``no_stream_us`` is close to ``kernel_us`` the kernel is bound by its own instructions (on Hopper,
the FP4-to-bf16 dequantization feeding the bf16 wgmma), not by memory, and no better overlap of the
weight stream brings it nearer the byte floor. Writes one JSON record under the key ``gpu``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from tune_grouped_w4a16 import copy_bandwidth, offsets_of, skewed_counts, stacked_weight, time_us

CASES = (("gate_up", 1536, 2048, 0), ("down", 2048, 768, 0), ("gate_up+rac50", 1536, 2048, 1024),
         ("down+rac50", 2048, 768, 384))
"""(name, N, K, RAC tail columns before widening) of Qwen3-30B-A3B's expert projections."""


@triton.jit
def _read_kernel(words_ptr, experts_ptr, words_per_expert, sink_ptr, BLOCK: tl.constexpr):
    """xor of every int32 word of expert ``experts[program 0]``'s block, split over axis-1 programs."""
    expert = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    base = words_ptr + expert * words_per_expert
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(tl.program_id(1) * BLOCK, words_per_expert, tl.num_programs(1) * BLOCK):
        acc ^= tl.load(base + start + offs, mask=start + offs < words_per_expert, other=0)
    tl.store(sink_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(acc, axis=0))


def read_launcher(stack: torch.Tensor, experts: torch.Tensor) -> Callable[[], None]:
    """A launch that reads the ``[E, ...]`` byte stack's blocks of ``experts`` once (int32 words)."""
    words = stack.reshape(stack.shape[0], -1).view(torch.int32)
    per_expert = words.shape[1]
    splits = max(1, min(64, 8 * 132 // max(1, experts.numel())))
    sink = torch.empty(experts.numel() * splits, dtype=torch.int32, device=stack.device)
    return lambda: _read_kernel[(experts.numel(), splits)](words, experts, per_expert, sink, BLOCK=1024, num_warps=4)


VARIANTS = {"split": {"WG_SPLIT": 1}, "pipe": {"A_PIPE": 1}, "rotated": {"CODE_ORDER": 1},
            "balanced": {"CODE_ORDER": 2}}
"""Config variants timed beside the default (each over it), by the name of their ``NAME_us`` field;
a ``CODE_ORDER`` variant runs on the weights' codes in that order (``kernels.code_orders``)."""


def variant_us(run: Callable[..., None], out: torch.Tensor, config: dict) -> float:
    """``run`` with ``config``, once checked against the default config's bits, timed."""
    run()
    expected = out.clone()
    out.fill_(float("nan"))
    run(config)
    if not torch.equal(out, expected):
        raise RuntimeError(f"{config} changed the grouped kernel's output")
    return round(time_us(lambda: run(config)), 2)


def floor_case(name: str, n: int, k: int, k2: int, experts: int, topk: int, tokens: int, bandwidth: float,
               generator: torch.Generator) -> dict:
    """The timings of one (projection, tokens) case (module docstring)."""
    from megatron_quads.kernels import w4a16_ws
    from megatron_quads.kernels.code_orders import CODE_ORDERS, ordered_weight
    from megatron_quads.kernels.dispatch import warp_specialized_tail_width
    from megatron_quads.nvfp4.tensor import NVFP4Tensor

    device = torch.device("cuda")
    k2 = warp_specialized_tail_width(device, k, k2) if k2 else 0
    qw = stacked_weight(experts, n, k)
    tail = stacked_weight(experts, n, k2) if k2 else None
    counts = skewed_counts(tokens, experts, topk, generator)
    offsets = offsets_of(counts)
    rows = tokens * topk
    x = torch.randn(rows, k + k2, device=device, dtype=torch.bfloat16)
    row_scale = torch.ones(rows, device=device, dtype=torch.float32) if k2 else None
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)

    ordered = {order: (ordered_weight(qw, order), None if tail is None else ordered_weight(tail, order))
               for order in CODE_ORDERS}

    def run(config: dict | None = None) -> None:
        weight, tail_ = ordered.get((config or {}).get("CODE_ORDER", 0), (qw, tail))
        w4a16_ws.grouped_w4a16_ws_into(x, weight, offsets, out, config, tail=tail_, row_scale=row_scale)

    active = torch.nonzero(counts).flatten().to(torch.int32)
    tensors: list[NVFP4Tensor] = [qw] + ([tail] if tail is not None else [])
    weight_bytes = sum(active.numel() * (t.shape[1] * t.shape[2] // 2 + t.shape[1] * t.shape[2] // 16) for t in tensors)
    reads = [read_launcher(t.codes, active) for t in tensors] + [read_launcher(t.scales.view(torch.uint8), active)
                                                                 for t in tensors]
    case = {"case": name, "N": n, "K": k, "K2": k2, "tokens": tokens, "rows": rows,
            "active_experts": int(active.numel()),
            "floor_us": round((weight_bytes + rows * (k + k2 + n) * 2) / bandwidth * 1e6, 2),
            "kernel_us": round(time_us(run), 2),
            **{f"{variant}_us": variant_us(run, out, config) for variant, config in VARIANTS.items()},
            "read_us": round(sum(time_us(read) for read in reads), 2)}

    real = w4a16_ws._descriptors

    def first_expert_only(codes, x_, scales, cfg):
        return real(codes[:n], x_, None if scales is None else scales[:n], cfg)

    w4a16_ws._descriptors = first_expert_only
    try:
        out.fill_(float("nan"))
        run()
        others = out[int(offsets[1]):]
        if others.numel() and not bool((others == 0).all()):
            raise RuntimeError(f"{name}: experts past the first read memory in the no-stream probe")
        case["no_stream_us"] = round(time_us(run), 2)
    finally:
        w4a16_ws._descriptors = real
    case["kernel_frac_of_floor"] = round(case["floor_us"] / case["kernel_us"], 3)
    case["no_stream_frac_of_kernel"] = round(case["no_stream_us"] / case["kernel_us"], 3)
    return case


def main(argv: list[str] | None = None) -> None:
    """Measure every case and write the record (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON record to write")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("grouped_ws_floor.py needs an sm_90 GPU (it times the warp-specialized Hopper kernel)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(),
              "command": "python tools/grouped_ws_floor.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "copy_GBps": round(bandwidth / 1e9, 1), "experts": args.experts, "topk": args.topk, "cases": []}
    for name, n, k, k2 in CASES:
        for tokens in args.tokens:
            case = floor_case(name, n, k, k2, args.experts, args.topk, tokens, bandwidth, generator)
            record["cases"].append(case)
            args.out.write_text(json.dumps({"gpu": record}, indent=1))
            variants = ", ".join(f"{variant} {case[variant + '_us']}" for variant in VARIANTS)
            print(f"{name} tokens={tokens}: kernel {case['kernel_us']} us, {variants}, "
                  f"no stream {case['no_stream_us']}, "
                  f"read {case['read_us']}, floor {case['floor_us']}", flush=True)


if __name__ == "__main__":
    main()
