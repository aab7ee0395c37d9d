"""The controller on GPUs: trainer ranks and rollout engines of one config, a synthetic MoE in quads mode.

    python benchmarks/bench_controller_gpu.py [--config FILE] [--steps 4] [key=value overrides of the config]

Runs a config (default ``examples/gpu_colocated_synthetic.yaml``: one GPU, Megatron trainer rank
on NCCL, built-in engine on the same GPU, weights handed over by CUDA IPC, engine memory released
during training; ``examples/gpu_multi.yaml``: two GPUs, two trainer ranks at expert parallel 2 and
two engines) on every GPU of the machine and reports, over the steps after the first (warm-up):
- the median seconds of each phase (sync, generate, reward, log-probs, train);
- the weight sync split into the trainer's export (gathers + NVFP4 quantization + packing), the
  engine's receive (IPC map + copy, object-store fetch or broadcast), load and RAC calibration, and
  its throughput in GB/s of bf16 parameters and of payload bytes.
Results: benchmarks/results/controller_gpu.json (the newest record per config and overrides, so a
one-GPU and a several-GPU record sit side by side) and controller_gpu.md, a table with a column per
record (``--render`` rewrites the table alone, no GPU needed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path

import ray
import torch
from results_io import load_records, save_record, write_text_atomic

from megatron_quads.controller.config import load_config
from megatron_quads.controller.run import run
from megatron_quads.controller.workers import policy_model_config
from megatron_quads.trainer.hf_export import qwen3_moe_config

CONFIG = Path(__file__).parents[1] / "examples" / "gpu_colocated_synthetic.yaml"
OUT = Path(__file__).parent / "results" / "controller_gpu.json"


def parameter_count(cfg) -> int:
    """Parameters of the policy (its Hugging Face twin built on the meta device)."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(qwen3_moe_config(policy_model_config(cfg)))
    return sum(p.numel() for p in model.parameters())


def record_key(config: Path, overrides: list[str]) -> str:
    """A record's key: its config file and overrides (a rerun of the same replaces its record)."""
    return " ".join([config.name, *overrides])


def markdown(records: dict[str, dict]) -> str:
    """The Markdown table of the file's records, one column per record."""
    keys = sorted(records, key=lambda k: (records[k].get("gpus", 1), k))
    cols = [records[k] for k in keys]
    lines = ["# Controller on GPUs", ""]
    for i, r in enumerate(cols, 1):
        lines.append(f"{i}. `{r['command']}` ({r['date']}, {r.get('gpus', 1)} x {r['device']}): "
                     f"{r['parameters'] / 1e6:.0f}M-parameter synthetic GPT-MoE ({r['config']}), {r['precision']} mode, "
                     f"{r.get('trainer_ranks', 1)} trainer rank(s), {r.get('engines', 1)} engine(s), "
                     f"{r.get('placement', 'colocated')}, weights by {r['transport']}; medians over "
                     f"{r['steps_measured']} steps after the first.")
    lines += ["", "| quantity | " + " | ".join(f"({i})" for i in range(1, len(cols) + 1)) + " |",
              "|---|" + "---:|" * len(cols)]
    for q in dict.fromkeys(q for r in cols for q in r["median"]):
        lines.append(f"| {q} | " + " | ".join(str(r["median"].get(q, "")) for r in cols) + " |")
    for label, field in (("sync GB/s (bf16 params)", "sync_GBps_of_bf16_params"),
                         ("sync GB/s (payload)", "sync_GBps_of_payload"),
                         ("engine GPU memory released in training, GB", "rollout_gpu_GB_released")):
        lines.append(f"| {label} | " + " | ".join(str(r[field]) for r in cols) + " |")
    lines += [""] + [f"Max |dlogp| per step ({i}): {r['gap_max_abs']}." for i, r in enumerate(cols, 1)]
    return "\n".join(lines) + "\n"


def main() -> None:
    """One run, one record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the run config (default: one GPU, colocated)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown table from the JSON file (no GPU)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.render:
        write_text_atomic(args.out.with_suffix(".md"), markdown(load_records(args.out)))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_controller_gpu.py needs a CUDA GPU (see benchmarks/bench_controller.py for CPU)")
    gpus = torch.cuda.device_count()
    ray.init(num_gpus=gpus, num_cpus=8 * gpus, include_dashboard=False, log_to_driver=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [f"run_dir={tmp}", f"grpo.steps={args.steps}", *args.overrides])
        records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    steady = records[1:] or records
    median = {k: statistics.median(r[k] for r in steady) for k in steady[0] if k.startswith(("time/", "sync/"))}
    params = parameter_count(cfg)
    sync_s = median["sync/export_s"] + median["sync/receive_s"] + median["sync/load_s"]
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "gpus": gpus, "command": "python benchmarks/bench_controller_gpu.py " + " ".join(
            [*([] if args.config == CONFIG else [f"--config {args.config}"]), f"--steps {args.steps}", *args.overrides]).strip(),
        "config": str(args.config.name), "parameters": params, "precision": cfg.precision.mode,
        "trainer_ranks": cfg.trainer_world_size, "engines": cfg.rollout.num_workers, "placement": cfg.placement.mode,
        "transport": cfg.weight_transport(), "steps_measured": len(steady),
        "median": {k: round(v, 4) for k, v in median.items()},
        "sync_GBps_of_bf16_params": round(params * 2 / 1e9 / sync_s, 3),
        "sync_GBps_of_payload": round(median["sync/bytes"] / 1e9 / sync_s, 3),
        "rollout_gpu_GB_released": round(statistics.median(r["rollout/gpu_bytes_released"] for r in steady) / 1e9, 3),
        "gap_max_abs": [round(r["mismatch/gap_max_abs"], 4) for r in records],
    }
    records = save_record(args.out, record_key(args.config, args.overrides), record, args.out.with_suffix(".md"), markdown)
    print(markdown(records))


if __name__ == "__main__":
    main()
