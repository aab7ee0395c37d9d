"""Step time of a Megatron GPT-MoE policy with and without Asymmetric QAT (NVFP4 expert fake quant).

    python benchmarks/bench_aqat_step.py --profile cpu   # tiny model, 2-core CPU (gloo)
    python benchmarks/bench_aqat_step.py --profile gpu   # ~0.5B-parameter MoE on one GPU (NCCL)

For each number of micro-batches it builds a BF16 and an AQAT :class:`PolicyWorker`, steps them
alternately (warm-up first), times ``train_step`` (forward + backward + optimizer step over all
micro-batches), and separately one rebuild of every fake-quantized expert weight (the
once-per-step cost AQAT adds). The record of the profile replaces the older one in
``benchmarks/results/aqat_step.json`` and is written as Markdown beside it (``aqat_step_<profile>.md``;
``--render`` rewrites every profile's table alone).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from bench_device import device_name, synchronize
from results_io import load_records, profile_markdown_path, save_record, write_text_atomic

PROFILES = {
    "cpu": dict(
        model=dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_experts=8, moe_ffn_hidden_size=64,
                   moe_router_topk=2, vocab_size=64, dtype="bf16"),
        seq=128, micro_batch=8, micro_batches=(1, 4), steps=8, warmup=2,
    ),
    "gpu": dict(
        model=dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_experts=32, moe_ffn_hidden_size=512,
                   moe_router_topk=4, vocab_size=32000, max_sequence_length=1024, dtype="bf16"),
        seq=1024, micro_batch=8, micro_batches=(1, 4), steps=20, warmup=3,
    ),
}


def _loss(logprobs: torch.Tensor, mb: dict) -> tuple:
    return -logprobs.sum(), torch.tensor(logprobs.numel(), device=logprobs.device), {}


def _build_worker(profile: dict, quads: bool):
    from megatron_quads.trainer.model import PolicyModelConfig
    from megatron_quads.trainer.policy import (
        OptimConfig,
        PolicyWorker,
        PolicyWorkerConfig,
    )
    from megatron_quads.trainer.quads_config import QuadsTrainerConfig

    cfg = PolicyWorkerConfig(
        model=PolicyModelConfig(**profile["model"]),
        quads=QuadsTrainerConfig(enabled=quads),
        optim=OptimConfig(lr=1e-5),
        micro_batch_size=profile["micro_batch"],
    )
    return PolicyWorker(cfg)


def _rebuild_ms(worker) -> tuple[float, float]:
    """Median time of rebuilding every fake-quantized weight once, and the cached bytes."""
    from megatron_quads.trainer.expert_linears import (
        FakeQuantColumnParallelLinear,
        FakeQuantRowParallelLinear,
    )
    from megatron_quads.trainer.fake_quant import invalidate_fake_quant_caches

    linears = [m for m in worker.model.modules() if isinstance(m, (FakeQuantColumnParallelLinear, FakeQuantRowParallelLinear))]
    times = []
    for _ in range(5):
        invalidate_fake_quant_caches(worker.model)
        synchronize()
        start = time.perf_counter()
        for m in linears:
            m.quantized_weight()
        synchronize()
        times.append(time.perf_counter() - start)
    cached = sum(m.quantized_weight().numel() * m.quantized_weight().element_size() for m in linears)
    return statistics.median(times) * 1e3, cached


def run_setting(profile: dict, micro_batches: int) -> list[dict]:
    """BF16 and AQAT workers stepped alternately (so drift in machine speed hits both alike)."""
    workers = {False: _build_worker(profile, False), True: _build_worker(profile, True)}
    gen = torch.Generator().manual_seed(0)
    vocab = profile["model"]["vocab_size"]
    tokens = torch.randint(0, vocab, (profile["micro_batch"] * micro_batches, profile["seq"]), generator=gen)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(profile["warmup"] + profile["steps"]):
        for quads, worker in workers.items():
            synchronize()
            start = time.perf_counter()
            worker.train_step({"tokens": tokens}, _loss)
            synchronize()
            if step >= profile["warmup"]:
                times[quads].append(time.perf_counter() - start)
    results = []
    for quads, worker in workers.items():
        rebuild_ms, cached = _rebuild_ms(worker) if quads else (0.0, 0)
        results.append({
            "quads": quads,
            "micro_batches": micro_batches,
            "tokens_per_step": tokens.numel(),
            "params_M": round(sum(p.numel() for p in worker.model.parameters()) / 1e6, 1),
            "step_ms_median": round(statistics.median(times[quads]) * 1e3, 2),
            "step_ms_min": round(min(times[quads]) * 1e3, 2),
            "fake_quant_rebuild_ms": round(rebuild_ms, 2),
            "fake_quant_cache_MB": round(cached / 2**20, 1),
        })
    del workers
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def markdown(record: dict) -> str:
    """The Markdown table of one profile's record."""
    lines = [
        f"# AQAT step time ({record['date']}, {record['device']}, profile {record['profile']})",
        "",
        f"Command: `{record['command']}`. Model: {record['model']}.",
        "",
        "| micro-batches | tokens/step | BF16 step ms (median) | AQAT step ms (median) | overhead | fake-quant rebuild ms | cache MB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mb in sorted({r["micro_batches"] for r in record["results"]}):
        base = next(r for r in record["results"] if r["micro_batches"] == mb and not r["quads"])
        aqat = next(r for r in record["results"] if r["micro_batches"] == mb and r["quads"])
        overhead = aqat["step_ms_median"] / base["step_ms_median"] - 1
        lines.append(
            f"| {mb} | {base['tokens_per_step']} | {base['step_ms_median']:.1f} | {aqat['step_ms_median']:.1f} | "
            f"{overhead:+.1%} | {aqat['fake_quant_rebuild_ms']:.1f} | {aqat['fake_quant_cache_MB']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run every setting of the chosen profile and store the record in the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/aqat_step.json"))
    parser.add_argument("--render", action="store_true", help="only rewrite each profile's Markdown table from the JSON file")
    args = parser.parse_args()
    if args.render:
        for profile, record in load_records(args.out).items():
            write_text_atomic(profile_markdown_path(args.out, profile), markdown(record))
        return

    from megatron_quads.trainer.rendezvous import find_free_port
    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import ParallelConfig

    init_trainer_distributed(1, 0, ParallelConfig(), master_port=find_free_port())
    profile = PROFILES[args.profile]
    results = [r for mb in profile["micro_batches"] for r in run_setting(profile, mb)]
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "torch": torch.__version__,
        "profile": args.profile,
        "command": f"python benchmarks/bench_aqat_step.py --profile {args.profile}",
        "model": profile["model"],
        "results": results,
    }
    save_record(args.out, args.profile, record, profile_markdown_path(args.out, args.profile),
                lambda records: markdown(records[args.profile]))
    print(markdown(record))


if __name__ == "__main__":
    main()
