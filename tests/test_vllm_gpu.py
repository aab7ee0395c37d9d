"""vLLM with the QUADS plugin on a GPU (vLLM 0.26, the machine's CUDA build), against the built-in
engine on the same GPU.

A random 2-layer Qwen3-MoE (``tests/random_moe.py``: 16 experts top-4, head_dim 128) in bf16. Both
engines compute the routed experts with the project's kernels; they differ in everything around them
(vLLM's FlashAttention, fused norms and RoPE against transformers' attention in bf16), so their
log-probs agree to bf16 noise, not bit for bit. The comparison is teacher-forced: vLLM generates
greedily, the built-in engine scores vLLM's tokens, and

- every log-prob of vLLM's is within ``LOGPROB_MAX_GAP`` of the built-in engine's for the same token
  (mean within ``LOGPROB_MEAN_GAP``);
- every greedy token vLLM chose is the built-in engine's argmax or within ``LOGPROB_MAX_GAP`` of it
  (a near tie can break either way under that noise).

Why these bounds: bf16 rounds every activation to 2^-8 relative, so two bf16 implementations of the
same network differ by a few 1e-3 in a log-prob. Measured on an H200 (vLLM 0.26.0), 8 prompts x 16
tokens: vLLM bf16 against the built-in bf16 (the floor) max 0.0080, mean 0.0012; w4a16, w4a4 and
quads the same (max 0.0078-0.0079, mean 0.0012-0.0013); 127 of 128 greedy tokens the built-in
engine's argmax, the other within 0.0078. The bounds are about five times that. A wrong scale, a
wrong channel set, a stale weight or a kernel reading the wrong expert moves log-probs by 0.1 to
several units.

Run on the GPU machine: ``pytest -m gpu tests/test_vllm_gpu.py`` (needs vLLM 0.26 and Triton).
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

from megatron_quads.precision import Precision
from megatron_quads.rollout.engine import Generation, SamplingParams  # noqa: E402
from megatron_quads.rollout.quantize_model import quantize_hf_weights  # noqa: E402
from megatron_quads.rollout.scopes import experts_and_attention_scope, routed_expert_scope  # noqa: E402
from megatron_quads.rollout.torch_engine import TorchRolloutEngine  # noqa: E402
from megatron_quads.vllm_plugin.engine import VllmOptions, VllmRolloutEngine  # noqa: E402
from random_moe import MoeShape, random_prompts, random_weights  # noqa: E402

SHAPE = MoeShape(layers=2, hidden=512, heads=8, kv_heads=2, head_dim=128, experts=16, top_k=4, expert_ffn=256,
                 vocab=2048, max_positions=512)
RATIO = 0.25
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
LOGPROB_MAX_GAP = 0.04
LOGPROB_MEAN_GAP = 0.006
KV_CACHE_GB = 0.25
"""Each engine's KV cache, sized rather than profiled: a profile of the free memory fails while other
engines on the GPU start or sleep (e.g. GRPO runs the tests share it with)."""
GRAPHS = VllmOptions(enforce_eager=False, cudagraph_mode="FULL_DECODE_ONLY", compilation_mode=0,
                     gpu_memory_utilization=0.08, max_num_seqs=16, max_model_len=256, gpu_kv_cache_gb=KV_CACHE_GB)
EAGER = VllmOptions(enforce_eager=True, gpu_memory_utilization=0.08, max_num_seqs=16, max_model_len=256,
                    gpu_kv_cache_gb=KV_CACHE_GB)


def _quantized(weights: dict[str, torch.Tensor], version: int = 1, attention: bool = False):
    scope = experts_and_attention_scope() if attention else routed_expert_scope()
    return quantize_hf_weights(weights.items(), scope, ratio=RATIO, weight_version=version)


@pytest.fixture(scope="module")
def model() -> dict:
    weights = {name: t for name, t in random_weights(SHAPE, seed=0, device="cuda")}
    update = {name: t + 0.3 * t.float().std().to(t.dtype) * torch.randn_like(t) if t.ndim == 2 else t
              for name, t in random_weights(SHAPE, seed=0, device="cuda")}
    return {"weights": weights, "update": update, "config": SHAPE.config_json(), "hf_config": SHAPE.transformers_config(),
            "prompts": random_prompts(8, 24, SHAPE.vocab, seed=1), "calibration": random_prompts(16, 32, SHAPE.vocab, seed=2)}


def _engine(model: dict, precision: str, options: VllmOptions = GRAPHS) -> VllmRolloutEngine:
    return VllmRolloutEngine(model["config"], precision=Precision.parse(precision, RATIO), dtype=torch.bfloat16, options=options)


def _close(engine: VllmRolloutEngine) -> None:
    engine.close()
    gc.collect()
    torch.cuda.empty_cache()


def _builtin(model: dict, precision: str, weights) -> TorchRolloutEngine:
    engine = TorchRolloutEngine(model["hf_config"], precision=Precision.parse(precision, RATIO), device="cuda", dtype=torch.bfloat16)
    engine.load_weights(weights, version=1)
    return engine


@torch.no_grad()
def _teacher_forced(engine: TorchRolloutEngine, generations: list[Generation]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per generation, the built-in engine's log-probs of the generated tokens and of its own argmax."""
    out = []
    for g in generations:
        ids = torch.tensor([g.prompt_ids + g.token_ids], device="cuda")
        logits = engine.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device="cuda")[None]).logits[0].float()
        logp = torch.log_softmax(logits[len(g.prompt_ids) - 1: -1], dim=-1)
        tokens = torch.tensor(g.token_ids, device="cuda")
        out.append((logp.gather(-1, tokens[:, None])[:, 0].cpu(), logp.max(-1).values.cpu()))
    return out


def _agreement(served: list[Generation], reference: TorchRolloutEngine) -> dict[str, float]:
    """How far vLLM's greedy generations are from the built-in engine's scoring of them."""
    gaps, margins, exact = [], [], 0
    for g, (logp, best) in zip(served, _teacher_forced(reference, served), strict=True):
        gaps.append((torch.tensor(g.logprobs) - logp).abs())
        margins.append(best - logp)
        exact += int((best - logp == 0).sum())
    gap, margin = torch.cat(gaps), torch.cat(margins)
    return {"max_gap": float(gap.max()), "mean_gap": float(gap.mean()), "max_margin": float(margin.max()),
            "argmax_agreement": exact / gap.numel()}


def _assert_agrees(result: dict[str, float]) -> None:
    assert result["max_gap"] <= LOGPROB_MAX_GAP, result
    assert result["mean_gap"] <= LOGPROB_MEAN_GAP, result
    assert result["max_margin"] <= LOGPROB_MAX_GAP, result


@pytest.mark.parametrize("precision", ["bf16", "w4a16", "w4a4", "quads"])
def test_vllm_with_cuda_graphs_serves_what_the_builtin_engine_computes(model: dict, precision: str) -> None:
    weights = model["weights"] if precision == "bf16" else _quantized(model["weights"])
    engine = _engine(model, precision)
    try:
        engine.load_weights(weights, version=1)
        mode, methods = engine.cudagraph_mode(), engine.llm.collective_rpc("quads_layer_methods")[0]
        served = engine.generate(model["prompts"], GREEDY)
    finally:
        _close(engine)
    result = _agreement(served, _builtin(model, precision, weights))
    print(f"\n[vllm-gpu] {precision}: {result}")
    assert mode == "FULL_DECODE_ONLY"
    if precision != "bf16":  # every routed-expert layer is the plugin's
        assert methods.get("QuadsFusedMoEMethod") == SHAPE.layers, methods
    assert all(len(g.token_ids) == GREEDY.max_new_tokens or g.finish_reason == "stop" for g in served)
    _assert_agrees(result)


def test_cuda_graphs_give_the_eager_engines_outputs(model: dict) -> None:
    weights = _quantized(model["weights"])
    served = {}
    for name, options in (("graphs", GRAPHS), ("eager", EAGER)):
        engine = _engine(model, "w4a4", options)
        try:
            engine.load_weights(weights, version=1)
            served[name] = (engine.cudagraph_mode(), engine.generate(model["prompts"], GREEDY))
        finally:
            _close(engine)
    assert served["graphs"][0] == "FULL_DECODE_ONLY" and served["eager"][0] == "NONE"
    graphs, eager = served["graphs"][1], served["eager"][1]
    gap = max(abs(a - b) for x, y in zip(graphs, eager) for a, b in zip(x.logprobs, y.logprobs))
    same = sum(x.token_ids == y.token_ids for x, y in zip(graphs, eager))
    print(f"\n[vllm-gpu] graphs vs eager: {same}/{len(graphs)} identical sequences, max gap {gap:.4g}")
    # the graphs replay the eager kernels on the same rows (padded batches add rows of their own), so
    # the outputs are the same bits (measured: 8 of 8 sequences, gap 0)
    assert same == len(graphs) and gap == 0.0


def test_a_sized_kv_cache_serves_what_a_profiled_one_does(model: dict) -> None:
    """``gpu_kv_cache_gb`` (several runs sharing a GPU): vLLM takes that size instead of profiling the free
    memory (a cache far smaller than the profiled share of ``gpu_memory_utilization``) and serves the
    same greedy tokens."""
    weights = _quantized(model["weights"])
    served = {}
    for name, options in (("profiled", replace(GRAPHS, gpu_kv_cache_gb=None)), ("sized", GRAPHS)):
        engine = _engine(model, "quads", options)
        try:
            engine.load_weights(weights, version=1)
            cache = engine.llm.llm_engine.vllm_config.cache_config
            served[name] = (cache.kv_cache_memory_bytes, cache.num_gpu_blocks, engine.generate(model["prompts"], GREEDY))
        finally:
            _close(engine)
    (_, profiled_blocks, profiled), (sized_bytes, sized_blocks, sized) = served["profiled"], served["sized"]
    print(f"\n[vllm-gpu] KV blocks: profiled {profiled_blocks}, sized to {KV_CACHE_GB} GiB {sized_blocks}")
    assert sized_bytes == int(KV_CACHE_GB * 2**30) and 0 < 10 * sized_blocks < profiled_blocks
    assert [g.token_ids for g in sized] == [g.token_ids for g in profiled]


@pytest.mark.parametrize("precision", ["w4a16", "quads"])
def test_attention_in_scope_runs_under_cuda_graphs_as_it_does_eagerly(model: dict, precision: str) -> None:
    """Attention q/k/v/o in NVFP4 too (the plugin's dense linear method): the decode graphs capture it
    and replay what the eager engine computes (quads: channels calibrated inside vLLM, on the same prompts)."""
    weights = _quantized(model["weights"], attention=True)
    served = {}
    for name, options in (("graphs", GRAPHS), ("eager", EAGER)):
        engine = _engine(model, precision, options)
        try:
            engine.load_weights(weights, version=1)
            if precision == "quads":
                engine.calibrate(model["calibration"])
            methods = engine.llm.collective_rpc("quads_layer_methods")[0]
            served[name] = (engine.cudagraph_mode(), methods, engine.generate(model["prompts"], GREEDY))
        finally:
            _close(engine)
    assert served["graphs"][0] == "FULL_DECODE_ONLY"
    assert served["graphs"][1].get("QuadsLinearMethod") == 2 * SHAPE.layers  # qkv_proj and o_proj
    graphs, eager = served["graphs"][2], served["eager"][2]
    gap = max(abs(a - b) for x, y in zip(graphs, eager) for a, b in zip(x.logprobs, y.logprobs))
    print(f"\n[vllm-gpu] attention in scope, {precision}, graphs vs eager: max gap {gap:.4g}")
    assert [g.token_ids for g in graphs] == [g.token_ids for g in eager] and gap <= LOGPROB_MAX_GAP


def test_an_in_place_update_under_cuda_graphs_keeps_the_storage_and_equals_a_fresh_engine(model: dict) -> None:
    """quads: new weights and new channels (calibrated inside vLLM after the update) reach the
    captured graphs; a fresh engine given the same weights and calibration serves the same."""
    first, new = _quantized(model["weights"]), _quantized(model["update"], version=2)
    engine = _engine(model, "quads")
    try:
        engine.load_weights(first, version=1)
        engine.calibrate(model["calibration"])
        before = engine.generate(model["prompts"], GREEDY)
        storage = engine.parameter_storage()
        engine.load_weights(new, version=2)
        engine.calibrate(model["calibration"])
        assert engine.parameter_storage() == storage
        updated = engine.generate(model["prompts"], GREEDY)
    finally:
        _close(engine)
    fresh = _engine(model, "quads")
    try:
        fresh.load_weights(new, version=2)
        fresh.calibrate(model["calibration"])
        restarted = fresh.generate(model["prompts"], GREEDY)
    finally:
        _close(fresh)
    assert [g.token_ids for g in updated] != [g.token_ids for g in before]
    assert [g.token_ids for g in updated] == [g.token_ids for g in restarted]
    assert max(abs(a - b) for x, y in zip(updated, restarted) for a, b in zip(x.logprobs, y.logprobs)) == 0.0


def test_rac_calibration_inside_vllm_chooses_the_builtin_engines_channels(model: dict) -> None:
    """Both record each expert's inputs on the same prompts under W4A16 and choose by the same rule;
    their inputs differ by bf16 noise, which swaps channels whose statistics nearly tie at the cut
    (measured on an H200: 0.956 of the channels shared on average, 0.89 in the worst linear)."""
    weights = _quantized(model["weights"])
    reference = _builtin(model, "quads", weights)
    reference.calibrate(model["calibration"])
    expected = reference.residual_channels()
    engine = _engine(model, "quads")
    try:
        engine.load_weights(weights, version=1)
        tokens = engine.calibrate(model["calibration"])
        chosen = engine.llm.collective_rpc("quads_residual_channels")[0]
        served = engine.generate(model["prompts"], GREEDY)
    finally:
        _close(engine)
    assert tokens == SHAPE.layers * SHAPE.top_k * sum(len(p) for p in model["calibration"])
    assert chosen.keys() == expected.keys()
    overlap = [len(set(chosen[m].tolist()) & set(expected[m].tolist())) / len(expected[m]) for m in expected]
    print(f"\n[vllm-gpu] calibration: channel overlap mean {sum(overlap) / len(overlap):.4f}, min {min(overlap):.4f}")
    assert sum(overlap) / len(overlap) >= 0.9 and min(overlap) >= 0.75
    _assert_agrees(_agreement(served, reference))


def test_vllm_captures_the_routed_experts_the_builtin_engine_computes(model: dict) -> None:
    weights = _quantized(model["weights"])
    params = SamplingParams(max_new_tokens=8, temperature=0.0, return_routed_experts=True)
    engine = _engine(model, "quads", replace(EAGER, routed_experts=True))
    try:
        engine.load_weights(weights, version=1)
        served = engine.generate(model["prompts"], params)
    finally:
        _close(engine)
    reference = _builtin(model, "quads", weights)
    rows = agree = 0
    for g in served:  # the built-in engine fed the same tokens (vLLM's) records its own routing
        want = reference.generate([g.prompt_ids + g.token_ids[:-1]], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                                                   return_routed_experts=True))[0]
        got = g.routed_experts
        assert got.shape == (len(g.prompt_ids) + len(g.token_ids) - 1, SHAPE.layers, SHAPE.top_k)
        expected = want.routed_experts[: got.shape[0]]
        same = (got.sort(-1).values == expected.sort(-1).values).all(-1)
        rows, agree = rows + same.numel(), agree + int(same.sum())
    print(f"\n[vllm-gpu] routing: {agree}/{rows} (token, layer) expert sets identical")
    # bf16 noise in the router's input flips near-tied k-th choices (measured on an H200: 494 of 496 equal)
    assert agree >= 0.98 * rows
