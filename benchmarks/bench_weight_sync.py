"""What a weight sync's export costs against the floor: a BF16 copy of the same expert tensors.

    python benchmarks/bench_weight_sync.py --profile gpu   # Qwen3-30B-A3B-shaped experts on one GPU
    python benchmarks/bench_weight_sync.py --profile cpu   # a small expert set on CPU

A synthetic routed-expert set (per layer: ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` in bf16, on
the device) is timed these ways:

- ``bf16 copy, stacked``: one ``copy_`` per stacked tensor (the floor: the bytes a BF16 sync moves);
- ``bf16 copy, per tensor``: one ``copy_`` per expert linear (what a per-tensor export launches);
- ``per-expert amax`` and ``quantize (amax given)``: the two passes over the bf16 experts, apart;
- ``amax, then quantize``: the two passes one after the other (no residual);
- ``amax + quantize, paired``: ``StackQuantizer``, what the export runs (on a GPU each stack is
  quantized in the same launch that takes the next stack's amax, so the memory-bound amax runs
  beside the compute-bound quantization; elsewhere the two passes): the least an NVFP4 export does;
- ``export, bf16`` / ``export, nvfp4`` / ``export, nvfp4 + residual``: the weight sync's export
  (``rollout.wire.encode_wire``: per-expert amax with gate and up sharing it, quantization, sorted
  random channel sets of ``--ratio`` of each projection's inputs, one value check for the whole set);
- ``decode, nvfp4 + residual``: the receiver's ``decode_wire`` of that payload (its value checks and
  ``W_S`` re-blocked from ``q(W)`` and the channels, on the receiver's device);
- ``quantize_hf_weights``: the per-linear path, tensor by tensor, on ``--path-layers`` layers
  (scaled to the whole set: it is linear in the layers).

Then a whole trainer -> engine sync of a synthetic Qwen3-MoE (the profile's ``sync`` model: on the
GPU profile 2.4 B parameters): the export, buckets, and the built-in engine receiving, decoding and
loading them in another process (CUDA IPC on a GPU, the object store's byte buffers on CPU), once
in BF16 (a bf16 engine) and once in NVFP4 + residual (a quads engine), with the payload bytes.

The record replaces the profile's older one in ``benchmarks/results/weight_sync.json`` (``--out``)
and is written as Markdown beside it (``weight_sync_<profile>.md``; ``--render`` rewrites every
profile's from the JSON alone).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_device import record_stamp, synchronize
from results_io import load_records, profile_markdown_path, publish, write_text_atomic

PROFILES = {
    "gpu": dict(layers=48, experts=128, hidden=2048, ffn=768, path_layers=2, repeats=3,
                sync=dict(layers=4, experts=128, hidden=2048, ffn=768, heads=32, kv_heads=4, vocab=32768, repeats=3)),
    "cpu": dict(layers=4, experts=16, hidden=256, ffn=128, path_layers=1, repeats=3,
                sync=dict(layers=2, experts=16, hidden=256, ffn=128, heads=4, kv_heads=2, vocab=1024, repeats=3)),
}
RESULTS = Path(__file__).parent / "results" / "weight_sync.json"


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one warm-up call)."""
    fn()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _expert_set(p: dict, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = p["experts"], p["hidden"], p["ffn"]
    return [(torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
             torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
            for _ in range(p["layers"])]


def _channel_sets(p: dict, ratio: float, device: torch.device) -> dict[str, torch.Tensor]:
    """Sorted random channel sets, ``ratio`` of each projection's inputs (a multiple of 16) per expert."""
    from megatron_quads.rollout.wire import channels_key

    gen = torch.Generator(device="cpu").manual_seed(1)
    out = {}
    for layer in range(p["layers"]):
        for projection, k in (("gate_up_proj", p["hidden"]), ("down_proj", p["ffn"])):
            count = int(k * ratio) // 16 * 16
            rows = [torch.randperm(k, generator=gen)[:count].sort().values for _ in range(p["experts"])]
            out[channels_key(layer, projection)] = torch.stack(rows).to(device=device, dtype=torch.int32)
    return out


def _stack_pairs(layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One layer's experts under the weight sync's stack names (what the trainer's export yields)."""
    from megatron_quads.rollout.wire import stack_module

    n = gate_up.shape[0]
    return [(f"{stack_module(layer, 0, n, 'gate_up_proj')}.weight", gate_up),
            (f"{stack_module(layer, 0, n, 'down_proj')}.weight", down)]


def _hf_tensors(layer: int, gate_up: torch.Tensor, down: torch.Tensor):
    """One layer's experts as Hugging Face ``(name, [N, K])`` pairs."""
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        base = f"model.layers.{layer}.mlp.experts.{e}"
        yield f"{base}.gate_proj.weight", gate_up[e, :inter]
        yield f"{base}.up_proj.weight", gate_up[e, inter:]
        yield f"{base}.down_proj.weight", down[e]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(p: dict, ratio: float) -> dict:
    """Seconds of each way over the whole expert set, and its bytes."""
    from megatron_quads.nvfp4.stacked import quantize_experts
    from megatron_quads.rollout.expert_stacks import StackQuantizer, expert_amax
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.scopes import routed_expert_scope
    from megatron_quads.rollout.wire import decode_wire, encode_wire

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts = _expert_set(p, device)
    bf16_bytes = _nbytes(t for pair in experts for t in pair)
    out = {"bf16_bytes": bf16_bytes, "linears": 3 * p["experts"] * p["layers"], "ratio": ratio}

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

    weights = [w for pair in experts for w in pair]
    amaxes = [expert_amax(w) for w in weights]
    out["amax_s"] = _best_seconds(lambda: [expert_amax(w) for w in weights], p["repeats"])
    out["quantize_s"] = _best_seconds(lambda: [quantize_experts(w, a) for w, a in zip(weights, amaxes)], p["repeats"])
    out["amax_then_quantize_s"] = _best_seconds(lambda: [quantize_experts(w, expert_amax(w)) for w in weights], p["repeats"])

    def quantize_in_order() -> None:
        quantizer = StackQuantizer()
        for w in weights:
            quantizer.add(w)
        quantizer.finish()

    out["amax_quantize_s"] = _best_seconds(quantize_in_order, p["repeats"])
    del amaxes
    stacks = [pair for layer, (a, b) in enumerate(experts) for pair in _stack_pairs(layer, a, b)]
    channels = _channel_sets(p, ratio, device)
    ways = {"export_bf16": dict(quantized=False), "export_nvfp4": dict(quantized=True),
            "export_nvfp4_residual": dict(quantized=True, residual_channels=channels)}
    for key, kwargs in ways.items():
        out[f"{key}_s"] = _best_seconds(lambda kwargs=kwargs: encode_wire(stacks, dtype=torch.bfloat16, **kwargs),
                                        p["repeats"])
        out[f"{key}_bytes"] = _nbytes(encode_wire(stacks, dtype=torch.bfloat16, **kwargs).values())
    payload = encode_wire(stacks, dtype=torch.bfloat16, **ways["export_nvfp4_residual"])
    out["decode_nvfp4_residual_s"] = _best_seconds(lambda: decode_wire(payload, True, 0), p["repeats"])
    del payload

    scope = routed_expert_scope()
    layers = p["path_layers"]

    def per_linear() -> None:
        for layer, (a, b) in enumerate(experts[:layers]):
            quantize_hf_weights(_hf_tensors(layer, a, b), scope)

    out["quantize_hf_weights_s"] = _best_seconds(per_linear, 1) * p["layers"] / layers
    out["quantize_hf_weights_measured_layers"] = layers
    return out


# ------------------------------------------------------------------------------ trainer -> engine sync


def _sync_config(q: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=q["vocab"], hidden_size=q["hidden"], intermediate_size=4 * q["hidden"], moe_intermediate_size=q["ffn"],
        num_hidden_layers=q["layers"], num_attention_heads=q["heads"], num_key_value_heads=q["kv_heads"],
        head_dim=q["hidden"] // q["heads"], num_experts=q["experts"], num_experts_per_tok=8, norm_topk_prob=True,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
    )


def _trainer_parts(q: dict, device: torch.device) -> list:
    """A synthetic trainer's export: every non-expert tensor by HF name, each layer's experts as a stack."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        shapes = {n: t.shape for n, t in Qwen3MoeForCausalLM(_sync_config(q)).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(2)
    parts: list = [(n, torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
                   for n, shape in shapes.items() if ".mlp.experts." not in n and "rotary" not in n]
    e, h, i = q["experts"], q["hidden"], q["ffn"]
    for layer in range(q["layers"]):
        parts += _stack_pairs(layer, torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
                              torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
    return parts


def _engine_process(q: dict, precision: str, device: str, requests, replies) -> None:
    """The rollout side: receive bucket sets, decode and load them, acknowledge each (after a device sync)."""
    from megatron_quads.controller.weight_sync import from_buckets
    from megatron_quads.precision import Precision
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine
    from megatron_quads.rollout.wire import decode_wire

    engine = TorchRolloutEngine(_sync_config(q), precision=Precision.parse(precision, q["ratio"]), device=device, dtype=torch.bfloat16)
    replies.put("ready")
    while (buckets := requests.get()) is not None:
        start = time.perf_counter()
        tensors, quantized, version = from_buckets(buckets, device=device)
        engine.load_weights(decode_wire(tensors, quantized, version), version)
        del tensors
        synchronize()
        replies.put((version, time.perf_counter() - start))


def measure_sync(q: dict) -> dict:
    """Seconds of a whole trainer -> engine sync (export, buckets, the engine's receive and load) in
    BF16 and in NVFP4 + residual, the engine in another process (CUDA IPC on a GPU, the object store's
    byte buffers on CPU), and the payload bytes."""
    import torch.multiprocessing as mp

    from megatron_quads.controller.weight_sync import BufferKeeper, buckets_bytes, to_buckets
    from megatron_quads.rollout.wire import encode_wire, is_stack_name

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transport = "cuda_ipc" if device.type == "cuda" else "object_store"
    parts = _trainer_parts(q, device)
    channels = _channel_sets(dict(layers=q["layers"], experts=q["experts"], hidden=q["hidden"], ffn=q["ffn"]),
                             q["ratio"], device)
    out = {"parameters": sum(t.numel() for _, t in parts),
           "expert_parameters": sum(t.numel() for n, t in parts if is_stack_name(n)), "transport": transport}
    context = mp.get_context("spawn")
    for precision, quantized in (("bf16", False), ("quads", True)):
        requests, replies = context.Queue(), context.Queue()
        child = context.Process(target=_engine_process, args=(q, precision, device.type, requests, replies), daemon=True)
        child.start()
        assert replies.get(timeout=600) == "ready"
        best, load = float("inf"), float("inf")
        for version in range(q["repeats"] + 1):  # the first is a warm-up
            keeper = BufferKeeper() if transport == "cuda_ipc" else None
            start = time.perf_counter()
            payload = encode_wire(parts, quantized, torch.bfloat16, channels if quantized else None)
            buckets = to_buckets(payload, version, quantized=quantized, transport=transport, keep_alive=keeper)
            requests.put(buckets)
            got, load_s = replies.get(timeout=600)
            seconds = time.perf_counter() - start
            if keeper is not None:
                keeper.release()
            if got != version:
                raise RuntimeError(f"the engine acknowledged version {got}, expected {version}")
            if version:
                best, load = min(best, seconds), min(load, load_s)
            out[f"{precision}_bytes"] = buckets_bytes(buckets)
            del payload, buckets
        requests.put(None)
        child.join(timeout=120)
        out[f"{precision}_sync_s"], out[f"{precision}_receive_load_s"] = best, load
    return out


def markdown(record: dict) -> str:
    """The record as a Markdown table (seconds, the ratio to the floor, bytes)."""
    r = record["results"]
    copy = r["bf16_copy_stacked_s"]
    mb = lambda key: f"{r[key] / 1e6:.1f}"  # noqa: E731
    rows = [
        ("bf16 copy, stacked (floor)", r["bf16_copy_stacked_s"], mb("bf16_bytes")),
        ("bf16 copy, per tensor", r["bf16_copy_per_tensor_s"], mb("bf16_bytes")),
        ("per-expert amax, stacked", r.get("amax_s"), ""),
        ("quantize, stacked (amax given)", r.get("quantize_s"), ""),
        ("amax, then quantize", r.get("amax_then_quantize_s"), ""),
        ("amax + quantize, paired" if "amax_then_quantize_s" in r else "amax + quantize, stacked", r["amax_quantize_s"], ""),
        ("export, bf16", r["export_bf16_s"], mb("export_bf16_bytes")),
        ("export, nvfp4", r["export_nvfp4_s"], mb("export_nvfp4_bytes")),
        (f"export, nvfp4 + residual (ratio {r['ratio']})", r["export_nvfp4_residual_s"], mb("export_nvfp4_residual_bytes")),
        ("decode, nvfp4 + residual (receiver: checks, W_S)", r["decode_nvfp4_residual_s"], ""),
        (f"quantize_hf_weights (measured on {r['quantize_hf_weights_measured_layers']} layers, scaled)",
         r["quantize_hf_weights_s"], ""),
    ]
    p = record["profile"]
    lines = [
        f"# Weight-sync export vs a BF16 copy ({record['date']}, {record['device']})", "",
        f"Command: `{record['command']}`. {p['layers']} layers x {p['experts']} experts, hidden {p['hidden']}, "
        f"ffn {p['ffn']}: {r['linears']} expert linears. Best of {p['repeats']} after a warm-up, except "
        "quantize_hf_weights (one timed call).", "",
        "| way | seconds | vs the floor | payload MB |", "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {seconds:.4f} | {seconds / copy:.2f}x | {size} |" for name, seconds, size in rows
              if seconds is not None]  # rows a record does not hold are left out
    if "sync" in record:
        q, y = p["sync"], record["sync"]
        lines += [
            "", f"## Trainer -> engine sync ({y['transport']}, engine in another process)", "",
            f"Synthetic Qwen3-MoE: {q['layers']} layers x {q['experts']} experts, hidden {q['hidden']}, ffn {q['ffn']}, "
            f"vocab {q['vocab']}: {y['parameters'] / 1e6:.1f} M parameters ({y['expert_parameters'] / 1e6:.1f} M in routed "
            f"experts). Export (`encode_wire`), buckets, the engine's receive, decode and load; residual channels "
            f"at ratio {q['ratio']} on the wire; RAC calibration not included. Best of {q['repeats']} after a warm-up.", "",
            "| payload | sync seconds | engine receive + load | payload MB | vs bf16 |", "|---|---:|---:|---:|---:|",
            f"| bf16 | {y['bf16_sync_s']:.4f} | {y['bf16_receive_load_s']:.4f} | {y['bf16_bytes'] / 1e6:.1f} | 1.00x |",
            f"| nvfp4 + residual | {y['quads_sync_s']:.4f} | {y['quads_receive_load_s']:.4f} | {y['quads_bytes'] / 1e6:.1f} "
            f"| {y['quads_sync_s'] / y['bf16_sync_s']:.2f}x |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure the profile and store its record (or, with ``--render``, rewrite the Markdown views)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ratio", type=float, default=0.5, help="RAC ratio of the residual export")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown tables from the JSON file")
    args = parser.parse_args()
    if args.render:
        for profile, record in load_records(args.out).items():
            write_text_atomic(profile_markdown_path(args.out, profile), markdown(record))
        return
    p = PROFILES[args.profile]
    record = {
        **record_stamp(),
        "profile": dict(p),
        "results": measure(p, args.ratio),
    }
    record["profile"]["sync"] = {**p["sync"], "ratio": args.ratio}
    record["sync"] = measure_sync(record["profile"]["sync"])
    publish(args.out, args.profile, record, markdown(record))


if __name__ == "__main__":
    main()
