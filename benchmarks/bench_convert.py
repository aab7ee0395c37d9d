"""``megatron-quads convert megatron-to-hf`` of a synthetic ~2 GB Qwen3-MoE: peak memory and throughput.

    python benchmarks/bench_convert.py              # CPU; builds the synthetic model in a scratch directory

A synthetic bf16 Qwen3-MoE (random weights, written shard by shard) is converted once with
``hf-to-megatron --ep 2``; then ``megatron-to-hf`` runs in a fresh process per shard bound, and the
record holds the child's resident memory after its imports (the floor every conversion pays), its
peak resident memory during the conversion (``VmHWM``, reset after the imports through
``/proc/self/clear_refs``), the largest layer's bytes, the model's bytes and the rate (model bytes / conversion seconds, imports excluded). The checkpoint is read in
full from the page cache (it was just written), so the rate is the converter's, not the disk's.

Stores the record in benchmarks/results/convert.json and writes convert_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from results_io import save_record  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SHAPE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=48, num_experts_per_tok=4)
SHARD_BOUNDS = {"1GB": 10**9, "200MB": 200 * 10**6}

_CHILD = """
import json, sys, time
from megatron_quads.convert.commands import megatron_to_hf

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

floor = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS: the peak then belongs to the conversion
start = time.perf_counter()
megatron_to_hf(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]), progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "import_rss": floor, "peak_rss": status("VmHWM")}))
"""


def _config() -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": True, "dtype": "bfloat16",
            **SHAPE}


def write_synthetic_hf(directory: Path) -> tuple[int, int]:
    """The synthetic model as an HF directory (one shard per layer); returns (model bytes, largest layer bytes)."""
    from megatron_quads.convert.names import hf_tensor_shapes
    from megatron_quads.trainer.hf_config import policy_config_from_hf

    directory.mkdir(parents=True)
    config = _config()
    shapes = hf_tensor_shapes(policy_config_from_hf(config))
    groups: dict[str, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "top"
        groups.setdefault(key, {})[name] = shape
    gen = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0
    for i, (key, members) in enumerate(groups.items()):
        tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in members.items()}
        size = sum(t.nbytes for t in tensors.values())
        total += size
        largest = max(largest, size) if key != "top" else largest
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return total, largest


def markdown(record: dict) -> str:
    lines = [
        "# megatron-to-hf on CPU: peak memory and throughput", "",
        f"{record['date']}, {record['device']}, `{record['command']}`.", "",
        f"Synthetic bf16 Qwen3-MoE: {record['model_gb']:.2f} GB, largest layer {record['largest_layer_mb']:.0f} MB, "
        f"converted from a dist checkpoint saved with hf-to-megatron --ep 2 ({record['hf_to_megatron_s']:.1f} s).", "",
        "| --max-shard-size | shards | seconds | MB/s | peak RSS (MB) | RSS after imports (MB) | peak - imports (MB) | "
        "(peak - imports) / largest layer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in record["runs"]:
        lines.append(
            f"| {run['max_shard_size']} | {run['shards']} | {run['seconds']:.1f} | {run['mb_per_s']:.0f} | "
            f"{run['peak_rss_mb']:.0f} | {run['import_rss_mb']:.0f} | {run['above_imports_mb']:.0f} | "
            f"{run['above_imports_per_layer']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "convert.json")
    parser.add_argument("--scratch", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    from megatron_quads.convert.commands import hf_to_megatron
    from megatron_quads.trainer.model import ParallelConfig

    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        root = Path(scratch)
        model_bytes, largest = write_synthetic_hf(root / "hf")
        start = time.perf_counter()
        hf_to_megatron(root / "hf", root / "megatron", ParallelConfig(expert_parallel=2), progress=False)
        to_megatron_s = time.perf_counter() - start
        runs = []
        for bound, bound_bytes in SHARD_BOUNDS.items():
            out = root / f"hf_{bound}"
            done = subprocess.run([sys.executable, "-c", _CHILD, str(root / "megatron"), str(out), str(bound_bytes)],
                                  check=True, capture_output=True, text=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            above = measured["peak_rss"] - measured["import_rss"]
            runs.append({
                "max_shard_size": bound, "shards": len(list(out.glob("*.safetensors"))),
                "seconds": measured["seconds"], "mb_per_s": model_bytes / 1e6 / measured["seconds"],
                "peak_rss_mb": measured["peak_rss"] / 1e6, "import_rss_mb": measured["import_rss"] / 1e6,
                "above_imports_mb": above / 1e6, "above_imports_per_layer": above / largest,
            })
            print(runs[-1], flush=True)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores",
        "command": "python benchmarks/bench_convert.py",
        "model_gb": model_bytes / 1e9, "largest_layer_mb": largest / 1e6, "shape": SHAPE,
        "hf_to_megatron_s": to_megatron_s, "runs": runs,
    }
    save_record(args.out, "cpu", record, RESULTS / "convert_cpu.md", lambda records: markdown(records["cpu"]))
    print(markdown(record))


if __name__ == "__main__":
    main()
