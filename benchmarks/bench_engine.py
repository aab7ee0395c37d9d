"""Tokens per second of the built-in rollout engine in each precision mode.

    python benchmarks/bench_engine.py --profile cpu   # the tiny embedded-default MoE, 2-core CPU
    python benchmarks/bench_engine.py --profile gpu   # a larger synthetic MoE (random weights) on a GPU

Greedy decoding of a batch of prompts. Each NVFP4 mode runs twice: with the routed experts as grouped
NVFP4 GEMMs (the engine's default: one call per projection and layer) and with the per-expert loop.
On CPU the NVFP4 GEMMs are the PyTorch reference (dequantize and multiply); on CUDA they are the
Triton kernels (W4A16 for w4a16, W4A4 + RAC for w4a4 / quads). Each row also records the bytes the engine
holds for the routed experts (``TorchRolloutEngine.expert_weight_bytes``). Stores the record of the profile
in benchmarks/results/engine.json (the newest of each profile) and writes engine_<profile>.md
(``--render`` rewrites every profile's table alone).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch
from results_io import load_records, profile_markdown_path, save_record, write_text_atomic

from megatron_quads.precision import ROLLOUT_KINDS, Precision
from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.rollout.rac import DEFAULT_RATIO
from megatron_quads.rollout.torch_engine import TorchRolloutEngine

PROFILES = {
    "cpu": dict(model=dict(), batch=16, prompt=16, new_tokens=32, dtype="bfloat16"),
    "gpu": dict(model=dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_experts=32,
                           moe_ffn_hidden_size=512, moe_router_topk=4, vocab_size=32000, max_sequence_length=1024),
                batch=32, prompt=64, new_tokens=32, dtype="bfloat16"),
}


def markdown(record: dict) -> str:
    """The Markdown table of one profile's record."""
    lines = [f"# Built-in engine throughput ({record['date']}, {record['device']}, profile {record['profile']})", "",
             f"Command: `{record['command']}`. Greedy, batch {record['batch']}, prompt {record['prompt_tokens']} tokens, "
             f"{record['new_tokens']} new tokens; NVFP4 GEMMs: "
             + ("the PyTorch reference." if record["device"].startswith("CPU") else "Triton kernels."), "",
             "| precision | experts | tokens | seconds | tokens/s | expert weights held, MiB |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['precision']} | {r['experts']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']} "
              f"| {r.get('expert_weight_mb', '-')} |" for r in record["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Time greedy generation for each precision and record tokens/s."""
    from megatron_quads.trainer.hf_export import qwen3_moe_config
    from megatron_quads.trainer.model import PolicyModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine.json"))
    parser.add_argument("--render", action="store_true", help="only rewrite each profile's Markdown table from the JSON file")
    args = parser.parse_args()
    if args.render:
        for profile, record in load_records(args.out).items():
            write_text_atomic(profile_markdown_path(args.out, profile), markdown(record))
        return
    profile = PROFILES[args.profile]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = qwen3_moe_config(PolicyModelConfig(**profile["model"]))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (profile["batch"], profile["prompt"]), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=profile["new_tokens"], temperature=0.0)
    from transformers import Qwen3MoeForCausalLM

    from megatron_quads.rollout.hf_experts import checkpoint_weights

    torch.manual_seed(0)
    weights = checkpoint_weights(Qwen3MoeForCausalLM(config))  # random weights, checkpoint names
    rows = []
    runs = [(p, True) for p in ROLLOUT_KINDS] + [(p, False) for p in ROLLOUT_KINDS if p != "bf16"]
    for precision, grouped in runs:
        engine = TorchRolloutEngine(config, precision=Precision.parse(precision, DEFAULT_RATIO), device=device, dtype=getattr(torch, profile["dtype"]), grouped=grouped)
        engine.load_weights(weights, version=0)
        if precision == "quads":
            engine.calibrate(prompts[:4])
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=0.0))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in out)
        rows.append({"precision": precision, "experts": "grouped" if grouped and precision != "bf16" else "per-expert",
                     "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                     "expert_weight_mb": round(engine.expert_weight_bytes() / 2**20, 2)})
        del engine
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads",
        "profile": args.profile, "command": f"python benchmarks/bench_engine.py --profile {args.profile}",
        "batch": profile["batch"], "prompt_tokens": profile["prompt"], "new_tokens": profile["new_tokens"], "rows": rows,
    }
    save_record(args.out, args.profile, record, profile_markdown_path(args.out, args.profile),
                lambda records: markdown(records[args.profile]))
    print(markdown(record))


if __name__ == "__main__":
    main()
