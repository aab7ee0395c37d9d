"""The built-in rollout engine against the Megatron trainer (CPU, fp32 unless stated)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.rollout.torch_engine import TorchRolloutEngine
from megatron_quads.rollout.weights import quantize_hf_weights
from megatron_quads.trainer.hf_export import export_hf_weights, qwen3_moe_config
from megatron_quads.trainer.model import (
    ParallelConfig,
    PolicyModelConfig,
    build_gpt_model,
)
from megatron_quads.trainer.quads_config import QuadsTrainerConfig

pytest.importorskip("transformers")

CFG = PolicyModelConfig(dtype="fp32", init_method_std=0.05)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
LOGPROB_TOL = 1e-5  # fp32: the engine's and Megatron's matmuls differ only in summation order


@pytest.fixture(scope="module")
def trainers() -> dict[str, torch.nn.Module]:
    from megatron_quads.trainer.distributed import init_trainer_distributed

    init_trainer_distributed(1, 0, ParallelConfig())
    torch.manual_seed(0)
    bf16 = build_gpt_model(CFG, ParallelConfig()).eval()
    aqat = build_gpt_model(CFG, ParallelConfig(), QuadsTrainerConfig()).eval()
    aqat.load_state_dict(bf16.state_dict())
    return {"bf16": bf16, "aqat": aqat}


def _engine(trainers, precision: str, quantized: bool = False, ratio: float = 0.25) -> TorchRolloutEngine:
    weights = dict(export_hf_weights(trainers["bf16"]))
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=precision, ratio=ratio, dtype=torch.float32)
    if quantized:
        in_scope = lambda m: bool(EXPERT.match(m))  # noqa: E731
        engine.load_weights(quantize_hf_weights(weights.items(), in_scope, unquantized_dtype=torch.float32), version=1)
    else:
        engine.load_weights(weights, version=1)
    return engine


def _trainer_logprobs(model: torch.nn.Module, generation) -> torch.Tensor:
    seq = torch.tensor([generation.prompt_ids + generation.token_ids])
    with torch.no_grad():
        logits = model(seq, torch.arange(seq.shape[1])[None], None)
    logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
    return logp[len(generation.prompt_ids) - 1 :]


def _gap(trainer: torch.nn.Module, generations) -> float:
    deltas = [(_trainer_logprobs(trainer, g) - torch.tensor(g.logprobs)).abs() for g in generations]
    return float(torch.cat(deltas).mean())


def test_bf16_engine_logprobs_match_the_megatron_policy(trainers) -> None:
    engine = _engine(trainers, "bf16")
    for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1)):
        assert len(g.token_ids) == 8 == len(g.logprobs)
        assert torch.allclose(_trainer_logprobs(trainers["bf16"], g), torch.tensor(g.logprobs), atol=LOGPROB_TOL)


def test_w4a16_engine_from_quantized_weights_matches_the_aqat_trainer(trainers) -> None:
    engine = _engine(trainers, "w4a16", quantized=True)
    for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=2)):
        assert torch.allclose(_trainer_logprobs(trainers["aqat"], g), torch.tensor(g.logprobs), atol=LOGPROB_TOL)


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_quads_gap_is_smaller_than_naive_w4a4_gap_on_the_embedded_model(trainers, ratio: float) -> None:
    """The warm-started embedded model with an AQAT trainer, on arithmetic prompts, fixed seeds."""
    from megatron.core import dist_checkpointing

    from megatron_quads import embedded
    from megatron_quads.tasks import encode_prompt

    cfg = PolicyModelConfig(**embedded.model_config_fields())
    aqat = build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig()).eval()
    path = str(embedded.ASSET_DIR / "checkpoint")
    aqat.load_state_dict(dist_checkpointing.load({"model": aqat.sharded_state_dict()}, path)["model"])
    weights = quantize_hf_weights(export_hf_weights(aqat), lambda m: bool(EXPERT.match(m)), unquantized_dtype=torch.float32)
    tok = embedded.tokenizer()
    prompts = [encode_prompt(tok, p.text) for p in embedded.task().sample_prompts(32, seed=5)]
    params = SamplingParams(max_new_tokens=6, seed=4, stop_token_ids=(tok.eos_id,))
    gaps = {}
    for precision in ("w4a4", "quads"):
        engine = TorchRolloutEngine(qwen3_moe_config(cfg), precision=precision, ratio=ratio, dtype=torch.float32)
        engine.load_weights(weights, version=1)
        if precision == "quads":
            engine.calibrate(prompts)
        gaps[precision] = _gap(aqat, engine.generate(prompts, params))
    assert 0 < gaps["quads"] < gaps["w4a4"]


def test_greedy_is_deterministic_and_sampling_follows_the_seed(trainers) -> None:
    engine = _engine(trainers, "w4a4")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert [g.token_ids for g in engine.generate(PROMPTS, greedy)] == [g.token_ids for g in engine.generate(PROMPTS, greedy)]
    a = [g.token_ids for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=7, top_p=0.9))]
    b = [g.token_ids for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=7, top_p=0.9))]
    c = [g.token_ids for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=8, top_p=0.9))]
    assert a == b and a != c


def test_stop_tokens_end_a_sequence(trainers) -> None:
    engine = _engine(trainers, "bf16")
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    stop_at = free[0].token_ids[2]  # the third greedy token of prompt 0 becomes a stop token
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop_at,)))
    first = free[0].token_ids.index(stop_at)
    assert stopped[0].token_ids == free[0].token_ids[: first + 1] and stopped[0].finish_reason == "stop"
    for f, s in zip(free[1:], stopped[1:], strict=True):
        cut = f.token_ids.index(stop_at) + 1 if stop_at in f.token_ids else len(f.token_ids)
        assert s.token_ids == f.token_ids[:cut]


def test_top_p_keeps_only_the_nucleus() -> None:
    from megatron_quads.rollout.torch_engine import _sample_top_p

    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(_sample_top_p(logp, 0.7, gen)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; the rest are cut


def test_bad_requests_fail_clearly(trainers) -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        TorchRolloutEngine(qwen3_moe_config(CFG), precision="fp8")
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision="bf16", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="load_weights first"):
        engine.generate(PROMPTS, SamplingParams())
    with pytest.raises(ValueError, match="no empty prompt"):
        _engine(trainers, "bf16").generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_checkpoint_weights_of_a_transformers_model_load_into_the_engine() -> None:
    from transformers import Qwen3MoeForCausalLM

    from megatron_quads.rollout.hf_experts import checkpoint_weights

    torch.manual_seed(1)
    reference = Qwen3MoeForCausalLM(qwen3_moe_config(CFG)).eval()
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision="bf16", dtype=torch.float32)
    engine.load_weights(checkpoint_weights(reference), version=3)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.allclose(engine.model(ids).logits, reference(ids).logits, atol=1e-5)
    assert engine.weight_version == 3


@pytest.mark.parametrize("precision", ["w4a16", "w4a4", "quads"])
def test_grouped_experts_give_the_per_expert_loops_results(trainers, precision: str) -> None:
    """The grouped forward (one grouped NVFP4 call per projection) against the per-expert loop with
    output hooks: the same tokens and log-probs, bit for bit, in every NVFP4 precision (quads after
    calibration, so the residual channels are in use)."""
    weights = quantize_hf_weights(export_hf_weights(trainers["bf16"]), lambda m: bool(EXPERT.match(m)),
                                  unquantized_dtype=torch.float32)
    runs = {}
    for grouped in (True, False):
        engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=precision, ratio=0.25, dtype=torch.float32, grouped=grouped)
        engine.load_weights(weights, version=1)
        if precision == "quads":
            engine.calibrate(PROMPTS)
        assert len(engine._grouped_layers) == (CFG.num_layers if grouped else 0)
        runs[grouped] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    for g, ref in zip(runs[True], runs[False], strict=True):
        assert g.token_ids == ref.token_ids and g.logprobs == ref.logprobs


def test_a_layer_whose_channel_counts_differ_keeps_the_per_expert_loop(trainers) -> None:
    """RAC channel sets of different sizes cannot be stacked: that layer falls back to hooks."""
    engine = _engine(trainers, "quads", quantized=True)
    engine.calibrate(PROMPTS)
    name = next(n for n in engine.states if n.endswith("down.0"))
    state = engine.states[name]
    assert state.channels[engine.ratio].numel() == 16  # 25% of 64
    state.channels[engine.ratio] = state.channels[engine.ratio][:0]  # this expert: plain W4A4
    state.residual[engine.ratio] = None
    engine._install_hooks()
    assert len(engine._grouped_layers) == CFG.num_layers - 1 and engine._hooks
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=3))
    assert all(len(g.token_ids) == 3 for g in out)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["w4a16", "w4a4", "quads"])
def test_grouped_experts_on_cuda_agree_with_the_per_expert_loop(trainers, precision: str) -> None:
    """On CUDA the grouped layers run the grouped Triton kernels, the per-expert loop the dense ones
    (fp32 activations: W4A16 takes its reference path): the same tokens, log-probs within 1e-4."""
    weights = quantize_hf_weights(export_hf_weights(trainers["bf16"]), lambda m: bool(EXPERT.match(m)),
                                  unquantized_dtype=torch.float32)
    runs = {}
    for grouped in (True, False):
        engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=precision, ratio=0.25, dtype=torch.float32,
                                    device="cuda", grouped=grouped)
        engine.load_weights(weights, version=1)
        if precision == "quads":
            engine.calibrate(PROMPTS)
        runs[grouped] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    for g, ref in zip(runs[True], runs[False], strict=True):
        assert g.token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(ref.logprobs), atol=1e-4)


def test_to_device_moves_the_grouped_stacks_and_keeps_the_states_viewing_them(trainers) -> None:
    """Sleep / wake moves each layer's stacks once; the experts' states stay views of them."""
    engine = _engine(trainers, "quads", quantized=True)
    engine.calibrate(PROMPTS)
    layer = engine._grouped_layers[0]
    for projection in (layer.grouped.gate_up, layer.grouped.down):
        for state in projection.states:
            assert state.quantized.codes.untyped_storage().data_ptr() == projection.weight.codes.untyped_storage().data_ptr()
            residual = state.residual[engine.ratio]
            assert residual.codes.untyped_storage().data_ptr() == projection.residual.codes.untyped_storage().data_ptr()
    engine.to_device("meta")  # a device move without a GPU (the values are gone afterwards)
    for grouped_layer in engine._grouped_layers:
        projection = grouped_layer.grouped.down
        assert projection.weight.codes.is_meta and projection.residual.codes.is_meta and projection.channels.is_meta
        assert all(s.quantized.codes.is_meta and s.residual[engine.ratio].scales.is_meta for s in grouped_layer.grouped.states)
    assert all(s.weight.is_meta for s in engine.states.values())
