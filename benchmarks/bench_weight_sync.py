"""What a weight sync's export costs against the floor: a BF16 copy of the same expert tensors.

    python benchmarks/bench_weight_sync.py --profile gpu   # Qwen3-30B-A3B-shaped experts on one GPU
    python benchmarks/bench_weight_sync.py --profile cpu   # a small expert set on CPU

A synthetic routed-expert set (per layer: ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` in bf16, on
the device) is timed four ways:

- ``bf16 copy, stacked``: one ``copy_`` per stacked tensor (the floor: the bytes a BF16 sync moves);
- ``bf16 copy, per tensor``: one ``copy_`` per expert linear (what a per-tensor export launches);
- ``nvfp4 stacked quantize``: one ``quantize`` per stacked tensor with per-expert amax (gate and up
  share it; on GPU the project's Triton kernel without its NaN scan): what a layer-by-layer export
  needs at least;
- ``quantize_hf_weights``: today's export path, tensor by tensor, on ``--path-layers`` layers
  (scaled to the whole set: it is linear in the layers).

The record replaces the profile's older one in ``benchmarks/results/weight_sync.json`` (``--out``)
and is written as Markdown beside it (``weight_sync_<profile>.md``; ``--render`` rewrites every
profile's from the JSON alone).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch
from results_io import load_records, profile_markdown_path, save_record, write_text_atomic

PROFILES = {
    "gpu": dict(layers=48, experts=128, hidden=2048, ffn=768, path_layers=2, repeats=3),
    "cpu": dict(layers=4, experts=16, hidden=256, ffn=128, path_layers=1, repeats=3),
}
RESULTS = Path(__file__).parent / "results" / "weight_sync.json"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU ({torch.get_num_threads()} threads)"


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one warm-up call)."""
    fn()
    _sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return best


def _expert_set(p: dict, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = p["experts"], p["hidden"], p["ffn"]
    return [(torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
             torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
            for _ in range(p["layers"])]


def _hf_tensors(layer: int, gate_up: torch.Tensor, down: torch.Tensor):
    """One layer's experts as Hugging Face ``(name, [N, K])`` pairs."""
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        base = f"model.layers.{layer}.mlp.experts.{e}"
        yield f"{base}.gate_proj.weight", gate_up[e, :inter]
        yield f"{base}.up_proj.weight", gate_up[e, inter:]
        yield f"{base}.down_proj.weight", down[e]


def measure(p: dict) -> dict:
    """Seconds of each way over the whole expert set, and its bytes."""
    from megatron_quads.nvfp4 import quantize
    from megatron_quads.rollout.weights import quantize_hf_weights, routed_expert_scope

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts = _expert_set(p, device)
    bf16_bytes = sum(t.numel() * t.element_size() for pair in experts for t in pair)
    out = {"bf16_bytes": bf16_bytes, "linears": 3 * p["experts"] * p["layers"]}

    targets = [(torch.empty_like(a), torch.empty_like(b)) for a, b in experts]

    def copy_stacked() -> None:
        for (a, b), (ta, tb) in zip(experts, targets):
            ta.copy_(a)
            tb.copy_(b)

    def copy_per_tensor() -> None:
        for (a, b), (ta, tb) in zip(experts, targets):
            for e in range(a.shape[0]):
                ta[e].copy_(a[e])
                tb[e].copy_(b[e])

    out["bf16_copy_stacked_s"] = _best_seconds(copy_stacked, p["repeats"])
    out["bf16_copy_per_tensor_s"] = _best_seconds(copy_per_tensor, p["repeats"])
    del targets

    if device.type == "cuda":  # the Triton kernel without its NaN scan: no host sync
        from megatron_quads.nvfp4.quantize_kernel import quantize_kernel

        def quantize_stacked(w: torch.Tensor, amax: torch.Tensor):
            return quantize_kernel(w, amax, validate=False)
    else:
        def quantize_stacked(w: torch.Tensor, amax: torch.Tensor):
            return quantize(w, global_amax=amax)

    def stacked_quantize() -> list:
        held = []
        for a, b in experts:
            for w in (a, b):
                amax = w.abs().amax(dim=(1, 2)).float()[:, None]  # per expert; gate and up share it
                held.append(quantize_stacked(w, amax))
        return held

    out["nvfp4_stacked_quantize_s"] = _best_seconds(stacked_quantize, p["repeats"])
    nvfp4 = stacked_quantize()
    out["nvfp4_bytes"] = sum(t.codes.numel() + t.scales.numel() + 4 * t.weight_scale_2.numel() for t in nvfp4)
    del nvfp4

    scope = routed_expert_scope()
    layers = p["path_layers"]

    def today() -> None:
        for layer, (a, b) in enumerate(experts[:layers]):
            quantize_hf_weights(_hf_tensors(layer, a, b), scope)

    out["quantize_hf_weights_s"] = _best_seconds(today, 1) * p["layers"] / layers
    out["quantize_hf_weights_measured_layers"] = layers
    return out


def markdown(record: dict) -> str:
    """The record as a Markdown table (seconds and the ratio to the floor)."""
    r = record["results"]
    copy = r["bf16_copy_stacked_s"]
    rows = [
        ("bf16 copy, stacked (floor)", r["bf16_copy_stacked_s"]),
        ("bf16 copy, per tensor", r["bf16_copy_per_tensor_s"]),
        ("nvfp4 stacked quantize, per-expert amax", r["nvfp4_stacked_quantize_s"]),
        (f"quantize_hf_weights (measured on {r['quantize_hf_weights_measured_layers']} layers, scaled)",
         r["quantize_hf_weights_s"]),
    ]
    p = record["profile"]
    lines = [
        f"# Weight-sync export vs a BF16 copy ({record['date']}, {record['device']})", "",
        f"Command: `{record['command']}`. {p['layers']} layers x {p['experts']} experts, hidden {p['hidden']}, "
        f"ffn {p['ffn']}: {r['linears']} expert linears, {r['bf16_bytes'] / 1e6:.1f} MB in bf16, "
        f"{r['nvfp4_bytes'] / 1e6:.1f} MB in NVFP4 (codes, block scales, decode scales). Best of "
        f"{p['repeats']} after a warm-up, except today's path (one timed call).", "",
        "| way | seconds | vs the floor |", "|---|---:|---:|",
    ]
    lines += [f"| {name} | {seconds:.4f} | {seconds / copy:.2f}x |" for name, seconds in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure the profile and store its record (or, with ``--render``, rewrite the Markdown views)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown tables from the JSON file")
    args = parser.parse_args()
    if args.render:
        for profile, record in load_records(args.out).items():
            write_text_atomic(profile_markdown_path(args.out, profile), markdown(record))
        return
    p = PROFILES[args.profile]
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_name(),
        "command": " ".join(["python", *sys.argv]),
        "profile": p,
        "results": measure(p),
    }
    save_record(args.out, args.profile, record)
    text = markdown(record)
    write_text_atomic(profile_markdown_path(args.out, args.profile), text)
    print(text)


if __name__ == "__main__":
    main()
