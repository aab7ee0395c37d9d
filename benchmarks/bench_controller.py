"""Step-time breakdown of the embedded default, and weight-sync throughput of bf16 vs NVFP4 payloads (CPU).

    python benchmarks/bench_controller.py [--out benchmarks/results/controller_cpu.json]

1. Runs the embedded default (quads mode, the built-in engine) for 12 steps and reports the median seconds of each phase
   (sync, generate, reward, trainer log-probs, train) over steps 2..11.
2. Weight sync: a synthetic Qwen3-MoE-format model (random weights, ~0.4 GB in bf16) is exported
   (a) as BF16 tensors and (b) quantized once into NVFP4-plus-residual; each payload goes through Ray's
   object store to a rollout-side actor that rebuilds it. Reports bytes, quantize time, transfer
   time and GB/s of parameters (bf16-equivalent bytes per second).
Results: benchmarks/results/controller_cpu.json (the newest record) and controller_cpu.md
(``--render`` rewrites the table alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from results_io import load_records, save_record, write_text_atomic

from megatron_quads.controller.config import load_config
from megatron_quads.controller.run import run
from megatron_quads.controller.weight_sync import (
    buckets_bytes,
    from_buckets,
    to_buckets,
)
from megatron_quads.rollout.wire import decode_wire, encode_wire, stack_module

LAYERS, EXPERTS, HIDDEN, FFN = 4, 16, 1024, 768
KEY = "cpu"


def synthetic_parts() -> list[tuple[str, torch.Tensor]]:
    """Qwen3-MoE-named attention weights and each layer's experts as two stacks (bf16, random),
    named as the trainer's export names them."""
    gen = torch.Generator().manual_seed(0)
    parts: list[tuple[str, torch.Tensor]] = []
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN))):
            parts.append((f"{p}.{name}.weight", (torch.randn(shape, generator=gen) * 0.02).bfloat16()))
        for projection, shape in (("gate_up_proj", (EXPERTS, 2 * FFN, HIDDEN)), ("down_proj", (EXPERTS, HIDDEN, FFN))):
            stack = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
            parts.append((f"{stack_module(layer, 0, EXPERTS, projection)}.weight", stack))
    return parts


@ray.remote
class Receiver:
    """Stands in for a rollout worker: rebuilds the weights it is sent."""

    def receive(self, refs: list) -> int:
        tensors, quantized, version = from_buckets([ray.get(ref) for ref in refs])
        decode_wire(tensors, quantized, version)
        return version


def sync_case(name: str, payload: dict[str, torch.Tensor], quantized: bool, receiver) -> dict:
    """Ship a wire payload through the object store, rebuild the weights on the other side."""
    start = time.perf_counter()
    buckets = to_buckets(payload, 1, quantized=quantized, bucket_bytes=64 * 2**20)
    assert ray.get(receiver.receive.remote([ray.put(b) for b in buckets])) == 1
    seconds = time.perf_counter() - start
    return {"payload": name, "payload_MB": round(buckets_bytes(buckets) / 2**20, 1), "buckets": len(buckets),
            "transfer_s": round(seconds, 3)}


def markdown(records: dict[str, dict]) -> str:
    """The Markdown tables of the file's record."""
    record = records[KEY]
    phases, sync = record["step_phases_median_s"], record["sync"]
    lines = [f"# Controller on CPU ({record['date']}, {record['device']})", "", f"Command: `{record['command']}`", "",
             "Embedded default, quads mode, median seconds per phase over steps 2-11:", "",
             "| phase | seconds |", "|---|---:|"]
    lines += [f"| {k.removeprefix('time/')} | {v} |" for k, v in phases.items()]
    lines += ["", f"Weight sync of a synthetic {record['sync_model_bf16_GB']} GB (bf16) Qwen3-MoE-format model "
              "through Ray's object store to another actor (quantize on the sender, rebuild on the receiver):", "",
              "| payload | MB | quantize s | transfer + rebuild s | GB/s of bf16 params |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['payload']} | {r['payload_MB']} | {r.get('quantize_s', 0.0)} | {r['transfer_s']} | {r['GBps_of_bf16_params']} |"
              for r in sync]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Both measurements; one record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/controller_cpu.json"))
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown tables from the JSON file")
    args = parser.parse_args()
    if args.render:
        write_text_atomic(args.out.with_suffix(".md"), markdown(load_records(args.out)))
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(Path("examples/embedded_default.yaml"), [
            f"run_dir={tmp}", "grpo.steps=12", "checkpoint.every=0", "logging.wandb=disabled", "rollout.engine=torch"])
        records = [json.loads(line) for line in run(cfg).read_text().splitlines()][2:]
    phases = {k: round(statistics.median(r[k] for r in records), 4) for k in records[0] if k.startswith("time/")}

    parts = synthetic_parts()
    params_gb = sum(t.numel() for _, t in parts) * 2 / 1e9
    receiver = Receiver.remote()
    dense = encode_wire(parts, quantized=False, dtype=torch.bfloat16)
    start = time.perf_counter()
    quantized = encode_wire(parts, quantized=True, dtype=torch.bfloat16)
    quantize_s = time.perf_counter() - start
    sync = [sync_case("bf16", dense, False, receiver), sync_case("nvfp4+residual", quantized, True, receiver)]
    sync[1]["quantize_s"] = round(quantize_s, 3)
    for row in sync:
        total = row["transfer_s"] + row.get("quantize_s", 0.0)
        row["GBps_of_bf16_params"] = round(params_gb / total, 3)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU, {torch.get_num_threads()} threads", "command": "python benchmarks/bench_controller.py",
        "step_phases_median_s": phases, "sync_model_bf16_GB": round(params_gb, 3), "sync": sync,
    }
    records = save_record(args.out, KEY, record, args.out.with_suffix(".md"), markdown)
    print(markdown(records))


if __name__ == "__main__":
    main()
