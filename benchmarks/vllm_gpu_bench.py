"""vLLM on a GPU: a Qwen3-30B-A3B-shaped MoE in every precision, under the same engine settings.

    python benchmarks/bench_vllm.py --profile gpu [--layers 8] [--modes ...] [--batches ...]

What it does (``bench_vllm.py --profile gpu`` runs it):

1. **Checkpoints** (once, under ``--work``): a random Qwen3-MoE with Qwen3-30B-A3B's layer shapes and
   ``--layers`` of its 48 layers (``tests/random_moe.py``: weights drawn so that tokens spread over the
   experts as a trained model's do, which vLLM's dummy weights would not), written as a bf16 Hugging
   Face checkpoint, a plain ModelOpt NVFP4 checkpoint (routed experts; with ``-attn``, attention q/k/v/o
   too) and an NVFP4-plus-residual checkpoint (RAC channels chosen inside vLLM when served).
2. **Modes**, each in its own process (a fresh GPU): vLLM bf16; vLLM FP8 (``quantization="fp8"``,
   online, every linear but the head); vLLM's own NVFP4 on the ModelOpt checkpoint (Marlin W4A16 on
   Hopper); the plugin in w4a16, w4a4, quads at 25% and 50% (routed experts), and w4a16 / quads 25%
   with attention in scope. Every mode: in-process engine, bf16, CUDA graphs
   (``compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}``), prefix caching off,
   ``max_num_seqs`` the largest batch.
3. **Throughput** per batch: random prompts of ``--prompt-len`` tokens, ``--gen-len`` tokens sampled
   at temperature 1 with log-probs and ``ignore_eos`` (an RL rollout), the sampler seeded once per call. The prefill is timed alone
   (``max_tokens=1``, other prompts) and subtracted: decode tokens/s =
   ``batch * (gen_len - 1) / (t_gen - t_prefill)``, the fastest of ``--repeats`` timings (each on
   fresh prompts; all are kept in the record).
4. **Profile** at ``--profile-batch`` for ``--profile-modes``: the torch profiler over a short
   generation; kernel time per decode step split into MoE (routing, expert GEMMs, activation
   quantization, combine), attention (FlashAttention, KV-cache writes, RoPE) and the rest, with the
   top kernels.
5. **Byte floor** of one decode step at each batch, for the measured layers and for all 48: weights
   read (routed experts: the expected number of distinct experts a batch reaches under uniform
   routing), the KV cache read at the mean context of the run, over the device-to-device copy
   bandwidth measured on the GPU.

The parent process never touches CUDA: it runs the preparation and each mode as child processes
(``--child``) and merges their JSON records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from random_moe import QWEN3_30B_A3B, MoeShape, random_prompts  # noqa: E402

MODES: dict[str, dict] = {
    "bf16": {"checkpoint": "bf16", "quantization": None, "serve": None},
    "fp8": {"checkpoint": "bf16", "quantization": "fp8", "serve": None},
    "marlin-nvfp4": {"checkpoint": "plain", "quantization": None, "serve": None},
    "w4a16": {"checkpoint": "plain", "quantization": "quads_nvfp4", "serve": "w4a16"},
    "w4a4": {"checkpoint": "plain", "quantization": "quads_nvfp4", "serve": "w4a4"},
    "quads-0.25": {"checkpoint": "quads", "quantization": None, "serve": "quads@0.25"},
    "quads-0.5": {"checkpoint": "quads", "quantization": None, "serve": "quads@0.5"},
    "w4a16-attn": {"checkpoint": "plain-attn", "quantization": "quads_nvfp4", "serve": "w4a16"},
    "quads-0.25-attn": {"checkpoint": "quads-attn", "quantization": None, "serve": "quads@0.25"},
    "w4a16-kx": {"checkpoint": "plain", "quantization": "quads_nvfp4", "serve": "w4a16", "x_order_min_rows": 0},
    "w4a16-split": {"checkpoint": "plain", "quantization": "quads_nvfp4", "serve": "w4a16", "ws_config": {"WG_SPLIT": 1}},
    "quads-0.5-split": {"checkpoint": "quads", "quantization": None, "serve": "quads@0.5", "ws_config": {"WG_SPLIT": 1}},
    "w4a16-pipe": {"checkpoint": "plain", "quantization": "quads_nvfp4", "serve": "w4a16", "ws_config": {"A_PIPE": 1}},
    "quads-0.25-pipe": {"checkpoint": "quads", "quantization": None, "serve": "quads@0.25", "ws_config": {"A_PIPE": 1}},
    "quads-0.5-pipe": {"checkpoint": "quads", "quantization": None, "serve": "quads@0.5", "ws_config": {"A_PIPE": 1}},
}
"""Each mode: the checkpoint it serves, vLLM's ``quantization`` argument, the plugin's precision
(``MEGATRON_QUADS_VLLM_PRECISION``; None: vLLM's own kernels) and, for a dispatch variant, the mean
routed rows per expert from which the grouped W4A16 path takes x in the kernel's K order
(``kernels.dispatch.X_ORDER_MIN_ROWS_PER_EXPERT``; ``w4a16-kx``: always, so the warp-specialized
kernel runs at every batch); for a kernel-config variant, the warp-specialized grouped kernel's
config over its wide-K default (``ws_config``; ``-split``: ``WG_SPLIT``, each MMA warpgroup its own
partition; ``-pipe``: ``A_PIPE``, each sub-step dequantized while the previous one's wgmma run). Modes after the ninth are variants, not run by default."""
DEFAULT_MODES = list(MODES)[:9]

ENGINE_SETTINGS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
"""vLLM's ``compilation_config`` for every mode, with ``cudagraph_capture_sizes`` added per run
(:func:`engine_settings`)."""
DEVICE = "cuda"
CALIBRATION_PROMPTS = 64
WARM_UP_BATCH = 8
COPY_BANDWIDTH_FALLBACK = 4.3e12


# ---------------------------------------------------------------------- checkpoints (child)
def checkpoint_dir(work: Path, name: str, layers: int) -> Path:
    """Where checkpoint ``name`` of ``layers`` layers lives under ``work``."""
    return work / f"{name}-L{layers}"


def pending_checkpoints(work: Path, layers: int, needed: set[str]) -> list[str]:
    """The checkpoints of ``needed`` not yet complete under ``work`` (complete: its config written last)."""
    from megatron_quads.rollout.checkpoint_format import MODEL_CONFIG_FILE

    return sorted(n for n in needed if not (checkpoint_dir(work, n, layers) / MODEL_CONFIG_FILE).is_file())


def prepare_checkpoints(work: Path, layers: int, needed: set[str]) -> dict:
    """Write the checkpoints ``needed`` under ``work`` (kept if already complete); returns their dirs."""
    import torch

    from megatron_quads.rollout.checkpoint_format import MODEL_CONFIG_FILE, write_checkpoint
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights
    from megatron_quads.rollout.scopes import experts_and_attention_scope, routed_expert_scope
    from random_moe import random_weights

    shape = bench_shape(layers)
    config = shape.config_json()
    dirs = {name: checkpoint_dir(work, name, layers) for name in needed}
    todo = pending_checkpoints(work, layers, needed)
    if not todo:
        return {k: str(v) for k, v in dirs.items()}
    start = time.perf_counter()
    weights = dict(random_weights(shape, seed=0, device=DEVICE))
    if "bf16" in todo:
        write_checkpoint(dirs["bf16"], weights, {MODEL_CONFIG_FILE: config})
    for name in todo:
        if name == "bf16":
            continue
        scope = experts_and_attention_scope() if name.endswith("-attn") else routed_expert_scope()
        plain = name.startswith("plain")
        # a plain ModelOpt checkpoint carries static input scales (stock loaders expect them; unused by W4A16)
        amax = None
        if plain:
            amax = {n.removesuffix(".weight"): 8.0 for n in weights if n.endswith(".weight") and scope(n.removesuffix(".weight"))}
        quantized = quantize_hf_weights(weights.items(), scope, ratio=0.0 if plain else 0.25, input_amax=amax,
                                        weight_version=1)
        save_quantized_weights(quantized, dirs[name], include_residual=not plain, model_config=config,
                               finish=_plain_modelopt if plain else None)
        del quantized
    del weights
    _sync(torch)
    print(f"[bench] checkpoints {todo} written in {time.perf_counter() - start:.1f} s", flush=True)
    return {k: str(v) for k, v in dirs.items()}


def _plain_modelopt(directory: Path) -> None:
    """Drop the ``quads`` block from a checkpoint's configs: a plain ModelOpt NVFP4 checkpoint, which
    vLLM serves with its own NVFP4 kernels and the plugin only when asked (``quantization="quads_nvfp4"``)."""
    for name, block in (("config.json", "quantization_config"), ("hf_quant_config.json", None)):
        path = directory / name
        doc = json.loads(path.read_text())
        (doc[block] if block else doc).pop("quads", None)
        path.write_text(json.dumps(doc, indent=2))


def bench_shape(layers: int) -> MoeShape:
    """Qwen3-30B-A3B's shapes with ``layers`` layers and positions for the benchmark's sequences."""
    from dataclasses import replace

    return replace(QWEN3_30B_A3B, layers=layers, max_positions=4096)


# ---------------------------------------------------------------------- one mode (child)
def _sampling(max_tokens: int):
    """What an RL rollout asks for: temperature 1, the sampled token's log-prob, no per-request seed
    (the call seeds the sampler: :func:`_timed_generate`)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True, logprobs=0)


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[float, int]:
    """Seconds and tokens of one generation; ``seed`` seeds vLLM's batched sampler first, as the
    rollout engine does (``quads_seed_sampler``)."""
    import torch
    from vllm import TokensPrompt

    llm.collective_rpc("quads_seed_sampler", args=(seed,))
    _sync(torch)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _sampling(max_tokens), use_tqdm=False)
    _sync(torch)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _calibrate(llm, vocab: int, prompt_len: int) -> dict:
    """RAC channels chosen inside vLLM on one prefill of random prompts; how those tokens spread over
    the experts (per layer: experts reached, busiest expert's tokens over the mean)."""
    from vllm import SamplingParams, TokensPrompt

    prompts = random_prompts(CALIBRATION_PROMPTS, prompt_len, vocab, seed=99)
    llm.collective_rpc("quads_begin_calibration")
    try:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False)
        counts = llm.collective_rpc("quads_routed_token_counts")[0]
    finally:
        tokens = llm.collective_rpc("quads_finish_calibration")[0]
    reached = [sum(1 for c in layer if c) for layer in counts]
    imbalance = [max(layer) / (sum(layer) / len(layer)) for layer in counts]
    return {"routed_tokens": tokens, "experts": len(counts[0]), "experts_reached_min": min(reached),
            "busiest_over_mean_max": round(max(imbalance), 2), "busiest_over_mean_mean": round(sum(imbalance) / len(imbalance), 2)}


def _kernel_class(name: str) -> str:
    """MoE, attention or other, by kernel name (vLLM's and the project's kernels)."""
    lowered = name.lower()
    attention = ("flash", "fmha", "attn", "attention", "reshape_and_cache", "rotary", "rope", "kv_cache")
    moe = ("moe", "expert", "marlin", "topk", "top_k", "grouped", "_ws_kernel", "quantize_rows", "route", "combine",
           "act_and_mul", "silu", "align_block", "rac", "prologue", "count_and_sort", "sorting")
    if any(k in lowered for k in attention):
        return "attention"
    if any(k in lowered for k in moe):
        return "moe"
    return "other"


def _profile(llm, prompts: list[list[int]], steps: int) -> dict:
    """Kernel time per decode step of one generation of ``steps`` tokens, by class and kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _timed_generate(llm, prompts, 2, seed=5)  # warm
    prefill = defaultdict(float)
    with profile(activities=[ProfilerActivity.CUDA]) as prof_prefill:
        _timed_generate(llm, prompts, 1, seed=6)
    for evt in prof_prefill.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            prefill[evt.name] += evt.device_time_total
    totals = defaultdict(float)
    calls = defaultdict(int)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _timed_generate(llm, prompts, steps, seed=7)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name] += evt.device_time_total
            calls[evt.name] += 1
    decode_steps = steps - 1
    per_step = {name: max(0.0, t - prefill.get(name, 0.0)) / decode_steps for name, t in totals.items()}
    split = defaultdict(float)
    for name, t in per_step.items():
        split[_kernel_class(name)] += t
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:20]
    return {"batch": len(prompts), "decode_steps": decode_steps,
            "us_per_step": {k: round(v, 1) for k, v in sorted(split.items())},
            "us_per_step_total": round(sum(split.values()), 1),
            "top_kernels": [{"name": n[:120], "class": _kernel_class(n), "us_per_step": round(t, 1),
                             "calls_per_step": round(calls[n] / max(1, steps), 2)} for n, t in top]}


def engine_settings(args: argparse.Namespace) -> dict:
    """``compilation_config`` of a run: :data:`ENGINE_SETTINGS` with decode graphs captured at exactly the
    batches it times and profiles (vLLM's default captures 51 sizes up to 512; these batches are among
    them, so they run the same graphs)."""
    sizes = sorted({*args.batches, *args.profile_batches, WARM_UP_BATCH})
    return {**ENGINE_SETTINGS, "cudagraph_capture_sizes": sizes}


def run_mode(mode: str, checkpoint: str, args: argparse.Namespace) -> dict:
    """Start vLLM for one mode, calibrate (quads), then time every batch (and profile)."""
    spec = MODES[mode]
    if spec["serve"]:
        os.environ["MEGATRON_QUADS_VLLM_PRECISION"] = spec["serve"]
    if spec.get("x_order_min_rows") is not None:
        from megatron_quads.kernels import dispatch

        dispatch.X_ORDER_MIN_ROWS_PER_EXPERT = spec["x_order_min_rows"]
    if spec.get("ws_config"):
        from megatron_quads.kernels import w4a16_ws

        w4a16_ws.WIDE_K_CONFIG = {**w4a16_ws.WIDE_K_CONFIG, **spec["ws_config"]}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm
    from vllm import LLM

    from megatron_quads.vllm_plugin.engine import WORKER_EXTENSION
    from megatron_quads.vllm_plugin.versions import vllm_capture_sizes, vllm_cudagraph_mode

    shape = bench_shape(args.layers)
    started = time.perf_counter()
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", quantization=spec["quantization"],
              max_model_len=args.prompt_len + args.gen_len + 16, max_num_seqs=max(args.batches),
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False, seed=0,
              logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
              compilation_config=engine_settings(args))
    record: dict = {"mode": mode, "engine_start_s": round(time.perf_counter() - started, 1),
                    "cudagraph_mode": vllm_cudagraph_mode(llm), "capture_sizes": vllm_capture_sizes(llm),
                    "methods": llm.collective_rpc("quads_layer_methods")[0], "vllm": vllm.__version__,
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"}
    if spec["serve"] and spec["serve"].startswith("quads"):
        record["calibration"] = _calibrate(llm, shape.vocab, args.prompt_len)
    _timed_generate(llm, random_prompts(WARM_UP_BATCH, args.prompt_len, shape.vocab, seed=1), 16, seed=1)
    rows = []
    for i, batch in enumerate(args.batches):
        decode = []
        for r in range(args.repeats):  # fresh prompts each time: nothing cached, nothing repeated
            seed = 100 * i + r
            prefill_s, _ = _timed_generate(llm, random_prompts(batch, args.prompt_len, shape.vocab, seed=10_000 + seed), 1,
                                           seed=seed)
            total_s, tokens = _timed_generate(llm, random_prompts(batch, args.prompt_len, shape.vocab, seed=20_000 + seed),
                                              args.gen_len, seed=seed)
            decode.append(total_s - prefill_s)
        decode_s = min(decode)
        rows.append({"batch": batch, "tokens": tokens, "prefill_s": round(prefill_s, 4), "total_s": round(total_s, 3),
                     "decode_s_each": [round(d, 3) for d in decode],
                     "decode_tokens_per_s": round(batch * (args.gen_len - 1) / decode_s, 1),
                     "ms_per_decode_step": round(1000 * decode_s / (args.gen_len - 1), 3)})
        print(f"[bench] {mode} batch {batch}: {rows[-1]['decode_tokens_per_s']} decode tokens/s "
              f"({rows[-1]['ms_per_decode_step']} ms a step)", flush=True)
    record["throughput"] = rows
    if mode in args.profile_modes:
        record["profiles"] = [_profile(llm, random_prompts(batch, args.prompt_len, shape.vocab, seed=3000), args.profile_steps)
                              for batch in args.profile_batches]
    return record


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read plus written per second (median of 20 copies of 2 GiB)."""
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return 2 * src.numel() / sorted(times[3:])[len(times[3:]) // 2]


# ---------------------------------------------------------------------- byte floor (no GPU)
NVFP4_BYTES_PER_PARAM = 0.5 + 1 / 16  # a code nibble and a scale byte per 16


def decode_step_bytes(shape: MoeShape, mode: str, batch: int, context: float) -> float:
    """Fewest bytes one decode step of ``batch`` sequences at mean ``context`` tokens reads: weights
    (routed experts: the expected distinct experts ``batch`` tokens reach under uniform top-k
    routing), router, head, and the KV cache."""
    h, d = shape.hidden, shape.head_dim
    attention_params = h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h
    expert_params = 3 * h * shape.expert_ffn
    reached = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** batch)
    ratio = float(mode.split("-")[1]) if mode.startswith("quads") else 0.0
    if mode == "bf16":
        expert_b, attention_b = 2.0, 2.0
    elif mode == "fp8":
        expert_b, attention_b = 1.0, 1.0
    else:  # NVFP4 experts (+ the RAC tail: ratio of each expert's K, same bytes per element)
        expert_b = NVFP4_BYTES_PER_PARAM * (1 + ratio)
        attention_b = NVFP4_BYTES_PER_PARAM * (1 + ratio) if mode.endswith("-attn") else 2.0
    per_layer = (attention_params * attention_b + reached * expert_params * expert_b + shape.experts * h * 2
                 + batch * context * 2 * shape.kv_heads * d * 2)
    return shape.layers * per_layer + shape.vocab * h * 2 + batch * h * 2


def floors(shape: MoeShape, modes: list[str], batches: list[int], context: float, bandwidth: float) -> list[dict]:
    """Byte floor rows: per mode and batch, GB per step and the decode tokens/s it allows."""
    rows = []
    for mode in modes:
        for batch in batches:
            step = decode_step_bytes(shape, mode, batch, context)
            rows.append({"mode": mode, "batch": batch, "gb_per_step": round(step / 1e9, 3),
                         "floor_tokens_per_s": round(batch * bandwidth / step, 1)})
    return rows


# ---------------------------------------------------------------------- parent
def _child(args: argparse.Namespace, extra: list[str], out: Path, timeout: float) -> dict | None:
    command = [sys.executable, __file__, "--child", "--result", str(out), *extra, *_shared_args(args)]
    print(f"[bench] {' '.join(command)}", flush=True)
    try:
        proc = subprocess.run(command, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"[bench] timed out after {timeout:.0f} s: {' '.join(extra)}", flush=True)
        return None
    if proc.returncode != 0 or not out.is_file():
        print(f"[bench] failed (exit {proc.returncode}): {' '.join(extra)}", flush=True)
        return json.loads(out.read_text()) if out.is_file() else None
    return json.loads(out.read_text())


def _shared_args(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--work", str(args.work), "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--repeats", str(args.repeats), "--batches", *map(str, args.batches),
            "--profile-batches", *map(str, args.profile_batches), "--profile-steps", str(args.profile_steps), "--profile-modes", *args.profile_modes,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The GPU benchmark's arguments (``bench_vllm.py --profile gpu`` passes its own through)."""
    parser = argparse.ArgumentParser(description="vLLM on a GPU: every precision of a Qwen3-30B-A3B-shaped MoE")
    parser.add_argument("--layers", type=int, default=8, help="layers of Qwen3-30B-A3B's 48 to build")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256, 512])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2, help="timed generations per batch (the fastest decode counts)")
    parser.add_argument("--profile-batches", nargs="+", type=int, default=[64])
    parser.add_argument("--profile-steps", type=int, default=33)
    parser.add_argument("--profile-modes", nargs="+", default=["bf16", "fp8", "w4a16", "quads-0.5"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--work", type=Path, default=Path("/tmp/quads_vllm_bench"), help="checkpoints (kept)")
    parser.add_argument("--results-dir", type=Path, default=None, help="also write the modes measured so far here "
                        "(modes_so_far.json, after each mode)")
    parser.add_argument("--mode-timeout", type=float, default=420.0, help="seconds a mode may take")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child_main(args: argparse.Namespace) -> None:
    """One child's job: the checkpoints (``--prepare``) or one mode (``--child-mode``)."""
    try:
        if args.prepare:
            needed = {MODES[m]["checkpoint"] for m in args.modes}
            result = {"checkpoints": prepare_checkpoints(args.work, args.layers, needed),
                      "copy_bandwidth_bytes_per_s": copy_bandwidth()}
        else:
            dirs = json.loads((args.work / f"checkpoints-L{args.layers}.json").read_text())
            result = run_mode(args.child_mode, dirs[MODES[args.child_mode]["checkpoint"]], args)
    except Exception as err:  # the parent records the failure and goes on with the next mode
        result = {"mode": args.child_mode, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        print(result["traceback"], flush=True)
        args.result.write_text(json.dumps(result, indent=1))
        sys.exit(1)
    args.result.write_text(json.dumps(result, indent=1))


def checkpoint_bytes(shape: MoeShape, name: str) -> float:
    """About how many bytes checkpoint ``name`` (``bf16``, ``plain``, ``quads``, with ``-attn``) of
    ``shape`` takes: bf16 tensors, NVFP4 codes and scales in scope (``quads``: the RAC tail of 25%)."""
    h, d = shape.hidden, shape.head_dim
    attention = shape.layers * (h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h)
    experts = shape.layers * shape.experts * 3 * h * shape.expert_ffn
    rest = 2 * shape.vocab * h + shape.layers * shape.experts * h
    if name == "bf16":
        return 2.0 * (attention + experts + rest)
    nvfp4 = NVFP4_BYTES_PER_PARAM * (1.25 if name.startswith("quads") else 1.0)
    return nvfp4 * experts + (nvfp4 if name.endswith("-attn") else 2.0) * attention + 2.0 * rest


def check_free_space(work: Path, layers: int, modes: list[str]) -> None:
    """Refuse, before anything is built, a ``--work`` folder without room for the checkpoints still to write."""
    todo = pending_checkpoints(work, layers, {MODES[m]["checkpoint"] for m in modes})
    need = sum(checkpoint_bytes(bench_shape(layers), n) for n in todo)
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        raise SystemExit(f"--work {work} has {free / 1e9:.1f} GB free; the checkpoints {todo} of {layers} layers need "
                         f"about {need / 1e9:.1f} GB: point --work at a larger filesystem (a RAM disk such as /dev/shm "
                         "where host memory allows), or run fewer --layers or --modes")


def measure(args: argparse.Namespace, command: str) -> dict:
    """Prepare the checkpoints, run every mode in its own process, and return the merged record."""
    args.work.mkdir(parents=True, exist_ok=True)
    check_free_space(args.work, args.layers, args.modes)
    prep = _child(args, ["--prepare", "--modes", *args.modes], args.work / "prepare.json", timeout=900)
    if prep is None or "checkpoints" not in prep:
        raise SystemExit(f"checkpoint preparation failed: {prep}")
    (args.work / f"checkpoints-L{args.layers}.json").write_text(json.dumps(prep["checkpoints"]))
    modes = {}
    for mode in args.modes:
        result = _child(args, ["--child-mode", mode], args.work / f"mode-{mode}.json", timeout=args.mode_timeout)
        modes[mode] = result or {"mode": mode, "error": "no result (timed out or crashed)"}
        if args.results_dir is not None:  # what is done so far, in one file
            args.results_dir.mkdir(parents=True, exist_ok=True)
            (args.results_dir / "modes_so_far.json").write_text(json.dumps(modes, indent=1))
    shape = bench_shape(args.layers)
    bandwidth = prep.get("copy_bandwidth_bytes_per_s", COPY_BANDWIDTH_FALLBACK)
    context = args.prompt_len + args.gen_len / 2
    gpu = next((m["gpu"] for m in modes.values() if "gpu" in m), "GPU")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu, "command": command, "layers": args.layers, "of_layers": QWEN3_30B_A3B.layers,
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "repeats": args.repeats, "engine_settings": engine_settings(args),
        "sampler_seed": "call",
        "copy_bandwidth_tb_per_s": round(bandwidth / 1e12, 2), "modes": modes,
        "floor": floors(shape, args.modes, args.batches, context, bandwidth),
        "floor_48_layers": floors(QWEN3_30B_A3B, args.modes, args.batches, context, bandwidth),
    }


if __name__ == "__main__":
    child_main(parse_args())


# ---------------------------------------------------------------------- Markdown
TARGETS = (("w4a16", "fp8", 1.3, (8, 256)), ("w4a16", "bf16", 1.5, (8, 256)), ("w4a16", "marlin-nvfp4", 1.2, (1, 512)),
           ("quads-0.25", "fp8", 1.16, (8, 256)), ("quads-0.5", "fp8", 1.0, (8, 256)))
"""(mode, against, ratio of decode tokens/s, batches it holds over)."""


def _rates(record: dict) -> dict[str, dict[int, float]]:
    return {mode: {row["batch"]: row["decode_tokens_per_s"] for row in r.get("throughput", [])}
            for mode, r in record["modes"].items()}


RECORD_KEY = "gpu"
"""The key of the GPU record in benchmarks/results/vllm.json; others start with ``gpu_`` (``--key``)."""


def record_keys(records: dict[str, dict]) -> list[str]:
    """The GPU records' keys among ``records``: ``gpu`` first, then every ``gpu_*`` in name order."""
    return sorted((k for k in records if k == RECORD_KEY or k.startswith(RECORD_KEY + "_")), key=lambda k: (k != RECORD_KEY, k))


def markdown_records(records: dict[str, dict]) -> str:
    """vllm_gpu.md: the view of every GPU record (:func:`record_keys`), one after the other."""
    return "\n".join(markdown(records[key]) for key in record_keys(records))


def markdown(record: dict) -> str:
    """The Markdown view of a GPU record."""
    rates = _rates(record)
    modes = [m for m in record["modes"] if rates.get(m)]
    batches = sorted({b for r in rates.values() for b in r})
    seeding = ("the sampler seeded once a call" if record.get("sampler_seed") == "call"
               else "one seed per request, so vLLM drew each sequence's noise separately at every step")
    lines = [f"# vLLM + QUADS plugin on the GPU: {record['layers']} layers ({record['date']}, {record['device']})", "",
             f"Command: `{record['command']}`. A random Qwen3-MoE with Qwen3-30B-A3B's layer shapes, "
             f"{record['layers']} of its {record['of_layers']} layers (hidden 2048, 128 experts top-8, expert FFN 768, "
             f"vocab 151936; weights drawn so tokens spread over the experts: `tests/random_moe.py`). Every mode: "
             f"in-process engine, bf16, `compilation_config={json.dumps(record['engine_settings'])}`, prefix caching off. "
             f"Per batch: prompts of {record['prompt_len']} random tokens, {record['gen_len']} tokens sampled at "
             f"temperature 1 with log-probs (`ignore_eos`; {seeding}); decode tokens/s = batch x (tokens - 1) / (generation time - "
             f"prefill time), the prefill timed alone on other prompts; the fastest of {record.get('repeats', 1)} timing(s) "
             "on fresh prompts.", "",
             "## Decode tokens/s", "", "| batch | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(f"{rates[m].get(b, float('nan')):,.0f}" for m in modes) + " |")
    lines += ["", "## Against the targets", "", "| mode | against | target | " + " | ".join(map(str, batches)) + " | met |",
              "|---|---|---:|" + "---:|" * len(batches) + "---|"]
    for mode, base, target, (lo, hi) in TARGETS:
        if not rates.get(mode) or not rates.get(base):
            continue
        cells, held = [], []
        for b in batches:
            ratio = rates[mode].get(b, float("nan")) / rates[base].get(b, float("nan"))
            cells.append(f"{ratio:.2f}x")
            if lo <= b <= hi:
                held.append(ratio >= target)  # False for a batch either mode lacks (nan)
        met = bool(held) and all(held)
        lines.append(f"| {mode} | {base} | {target}x (batch {lo}-{hi}) | " + " | ".join(cells) + f" | {'yes' if met else 'no'} |")
    lines += ["", "## Engines", "", "| mode | CUDA-graph mode in effect | largest captured batch | start, s | quant methods |",
              "|---|---|---:|---:|---|"]
    for mode, r in record["modes"].items():
        if "error" in r:
            lines.append(f"| {mode} | failed: {r['error'][:160]} | | | |")
            continue
        sizes = r.get("capture_sizes") or []
        methods = ", ".join(f"{k} x{v}" for k, v in sorted(r.get("methods", {}).items()))
        lines.append(f"| {mode} | {r['cudagraph_mode']} | {max(sizes) if sizes else '-'} | {r['engine_start_s']} | {methods} |")
    calibrated = {m: r["calibration"] for m, r in record["modes"].items() if "calibration" in r}
    if calibrated:
        lines += ["", f"RAC calibration inside vLLM ({CALIBRATION_PROMPTS} prompts of {record['prompt_len']} random tokens, "
                  "one prefill), and how those tokens spread over the experts:", "",
                  "| mode | routed tokens | experts | fewest experts reached in a layer | busiest expert / mean, worst layer | mean over layers |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {c['routed_tokens']} | {c['experts']} | {c['experts_reached_min']} | {c['busiest_over_mean_max']} | "
                  f"{c['busiest_over_mean_mean']} |" for m, c in calibrated.items()]
    profiles = [(m, p) for m, r in record["modes"].items() for p in r.get("profiles", [])]
    if profiles:
        lines += ["", "## Where a decode step's time goes (torch profiler, kernel time per decode step, us)", "",
                  "| mode | batch | MoE | attention | other | total | measured step | kernels / step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m, p in profiles:
            split = p["us_per_step"]
            step = next((row["ms_per_decode_step"] for row in record["modes"][m].get("throughput", [])
                         if row["batch"] == p["batch"]), None)
            measured = "- | -" if step is None else f"{1000 * step:,.0f} | {p['us_per_step_total'] / (1000 * step):.0%}"
            lines.append(f"| {m} | {p['batch']} | {split.get('moe', 0):,.0f} | {split.get('attention', 0):,.0f} | "
                         f"{split.get('other', 0):,.0f} | {p['us_per_step_total']:,.0f} | {measured} |")
        lines += ["", "The measured step is the throughput run's at that batch (contexts up to prompt + generation; the "
                  "profile's are the prompt's plus a few tokens). Kernels / step is the share of the measured step the "
                  "GPU spent in kernels: well under 100%, the step waited on the engine's host work (scheduling, "
                  "sampling bookkeeping, output processing), which no kernel speed-up shortens."]
        for m, p in profiles:
            lines += ["", f"Top kernels, {m}, batch {p['batch']}:", "", "| kernel | class | us per step | calls per step |",
                      "|---|---|---:|---:|"]
            lines += [f"| `{k['name']}` | {k['class']} | {k['us_per_step']} | {k['calls_per_step']} |" for k in p["top_kernels"][:10]]
    for key, title in (("floor", f"{record['layers']} layers"), ("floor_48_layers", "all 48 layers")):
        rows = record[key]
        floor_modes = list(dict.fromkeys(r["mode"] for r in rows))
        table = {(r["mode"], r["batch"]): r for r in rows}
        lines += ["", f"## Byte floor of one decode step, {title} (decode tokens/s at {record['copy_bandwidth_tb_per_s']} TB/s)", "",
                  "| batch | " + " | ".join(floor_modes) + " |", "|---:|" + "---:|" * len(floor_modes)]
        for b in sorted({r["batch"] for r in rows}):
            lines.append(f"| {b} | " + " | ".join(f"{table[(m, b)]['floor_tokens_per_s']:,.0f} ({table[(m, b)]['gb_per_step']} GB)"
                                                   for m in floor_modes) + " |")
    lines += ["", "The floor counts the weights read (routed experts: the distinct experts a batch reaches under uniform "
              "top-8 routing), the router, the head, and the KV cache at the run's mean context "
              f"({record['prompt_len']} + {record['gen_len']} / 2 tokens), at the measured device-to-device copy bandwidth."]
    return "\n".join(lines) + "\n"
