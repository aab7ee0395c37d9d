"""The built-in rollout engine against the Megatron trainer (CPU, fp32 unless stated)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_quads.precision import Precision
from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.torch_engine import TorchRolloutEngine
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
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision.parse(precision, ratio), dtype=torch.float32)
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
        engine = TorchRolloutEngine(qwen3_moe_config(cfg), precision=Precision.parse(precision, ratio), dtype=torch.float32)
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
    with pytest.raises(ValueError, match="unknown rollout precision 'fp8'"):
        TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision("fp8"))
    with pytest.raises(TypeError, match="must be a megatron_quads.precision.Precision"):
        TorchRolloutEngine(qwen3_moe_config(CFG), precision="quads")
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision("bf16"), dtype=torch.float32)
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
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision("bf16"), dtype=torch.float32)
    engine.load_weights(checkpoint_weights(reference), version=3)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.allclose(engine.model(ids).logits, reference(ids).logits, atol=1e-5)
    assert engine.weight_version == 3


@pytest.mark.parametrize("precision", ["w4a16", "w4a4", "quads"])
def test_grouped_experts_give_the_per_expert_loops_results(trainers, precision: str) -> None:
    """The grouped forward (one grouped NVFP4 call per projection) against the per-expert loop (each
    expert linear computing under the precision): the same tokens and log-probs, bit for bit, in
    every NVFP4 precision (quads after calibration, so the residual channels are in use)."""
    weights = quantize_hf_weights(export_hf_weights(trainers["bf16"]), lambda m: bool(EXPERT.match(m)),
                                  unquantized_dtype=torch.float32)
    runs = {}
    for grouped in (True, False):
        engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision.parse(precision, 0.25), dtype=torch.float32, grouped=grouped)
        engine.load_weights(weights, version=1)
        if precision == "quads":
            engine.calibrate(PROMPTS)
        assert len(engine._grouped_layers) == (CFG.num_layers if grouped else 0)
        runs[grouped] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    for g, ref in zip(runs[True], runs[False], strict=True):
        assert g.token_ids == ref.token_ids and g.logprobs == ref.logprobs


def test_weights_that_arrive_stacked_load_without_restacking_and_compute_the_same(trainers) -> None:
    """The weight sync's stacks (``decode_wire``, with RAC tails) become the grouped layers as they
    are, the states viewing them; generations equal those of the per-linear weights, before and after
    calibration, grouped or not."""
    from megatron_quads.rollout.wire import channels_key, decode_wire, encode_wire
    from megatron_quads.controller.rollout_export import export_rollout_tensors

    payload = export_rollout_tensors(trainers["bf16"], "nvfp4", torch.float32)
    stacked = decode_wire(payload, quantized=True, weight_version=1)
    per_linear = quantize_hf_weights(export_hf_weights(trainers["bf16"]), lambda m: bool(EXPERT.match(m)),
                                     unquantized_dtype=torch.float32)
    params = SamplingParams(max_new_tokens=4, seed=3)
    for grouped in (True, False):
        engines = []
        for weights in (stacked, per_linear):
            engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision("quads", 0.25), dtype=torch.float32,
                                        grouped=grouped)
            engine.load_weights(weights, version=1)
            engines.append(engine)
        if grouped:
            gate_up = engines[0]._grouped_layers[0].grouped.gate_up
            arrived = stacked.expert_stacks[channels_key(0, "gate_up_proj")].weight
            assert gate_up.weight.codes.data_ptr() == arrived.data_ptr()  # not re-stacked
        runs = [e.generate(PROMPTS, params) for e in engines]
        assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]
        assert [g.logprobs for g in runs[0]] == [g.logprobs for g in runs[1]]
    # tails that arrive with the stacks, then calibration
    channels = {channels_key(layer, p): torch.arange(16, dtype=torch.int32).repeat(CFG.num_experts, 1)
                for layer in range(CFG.num_layers) for p in ("gate_up_proj", "down_proj")}
    with_tails = decode_wire(encode_wire(_stack_parts(trainers["bf16"]), True, torch.float32, channels), True, 2)
    engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision("quads", 0.25), dtype=torch.float32)
    engine.load_weights(with_tails, version=2)
    assert engine._grouped_layers[0].grouped.down.num_channels == 16
    tails = engine.generate(PROMPTS, params)
    engine.calibrate(PROMPTS)
    engines[1].calibrate(PROMPTS)
    calibrated = [e.generate(PROMPTS, params) for e in (engine, engines[1])]
    assert [g.logprobs for g in calibrated[0]] == [g.logprobs for g in calibrated[1]]
    assert [g.logprobs for g in tails] != [g.logprobs for g in calibrated[0]]


def _stack_parts(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    from megatron_quads.trainer.hf_export import export_rollout_parts

    return list(export_rollout_parts(model))


def test_a_layer_whose_channel_counts_differ_keeps_the_per_expert_loop(trainers) -> None:
    """RAC channel sets of different sizes cannot be stacked: that layer computes expert by expert,
    each expert linear under the engine's precision."""
    engine = _engine(trainers, "quads", quantized=True)
    engine.calibrate(PROMPTS)
    name = next(n for n in engine.states if n.endswith("down.0"))
    state = engine.states[name]
    assert state.channels[engine.ratio].numel() == 16  # 25% of 64
    state.channels[engine.ratio] = state.channels[engine.ratio][:0]  # this expert: plain W4A4
    state.residual[engine.ratio] = None
    engine._prepare_experts()
    assert len(engine._grouped_layers) == CFG.num_layers - 1
    layer = engine.model.get_submodule(name.rsplit(".", 2)[0])
    assert layer.grouped is None and all(m.precision == Precision("quads", engine.ratio) for m in layer.down)
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
        engine = TorchRolloutEngine(qwen3_moe_config(CFG), precision=Precision.parse(precision, 0.25), dtype=torch.float32,
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
    assert all(s.quantized.codes.is_meta for s in engine.states.values())


def _held_expert_tensors(engine: TorchRolloutEngine) -> list[torch.Tensor]:
    """Every tensor the engine holds for its routed experts: the expert modules' parameters and
    buffers, the experts' states and the grouped layers' stacks."""
    import dataclasses

    held: list[torch.Tensor] = []

    def add(obj) -> None:
        if isinstance(obj, torch.Tensor):
            held.append(obj)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                add(getattr(obj, f.name))
        elif isinstance(obj, dict):
            for value in obj.values():
                add(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                add(value)

    for module in engine.experts.values():
        add([*module.parameters(), *module.buffers()])
    add(list(engine.states.values()))
    for layer in engine._grouped_layers:
        for projection in (layer.grouped.gate_up, layer.grouped.down):
            add([projection.weight, projection.channels, projection.residual])
    return held


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one stack count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize(("precision", "quantized"), [("w4a16", True), ("w4a4", False), ("quads", True), ("quads", False)])
def test_nvfp4_modes_hold_the_experts_as_nvfp4_only(trainers, precision: str, quantized: bool) -> None:
    """In an NVFP4 mode the experts are held as codes, block scales, decode scales and (quads) RAC
    tails, nothing else: the expert modules have no parameters, no floating tensor larger than one
    decode scale an expert is held, and the bytes are exactly the NVFP4 sizes of the experts' shapes
    (against fp32 weights in the bf16 mode)."""
    from megatron_quads.rollout.rac import num_residual_channels

    hf = qwen3_moe_config(CFG)
    e, h, i, layers = hf.num_experts, hf.hidden_size, hf.moe_intermediate_size, hf.num_hidden_layers
    engine = _engine(trainers, precision, quantized=quantized)
    if precision == "quads":
        engine.calibrate(PROMPTS)
    assert len(engine._grouped_layers) == layers
    assert not any(True for m in engine.experts.values() for _ in m.parameters())
    assert not [k for k in engine.model.state_dict() if ".mlp.experts." in k]
    held = _held_expert_tensors(engine)
    assert all(t.numel() <= e for t in held if t.dtype in (torch.float32, torch.bfloat16, torch.float16))

    def nvfp4_bytes(n: int, k: int) -> int:  # E stacked [N, K] weights: codes, scales, E decode scales
        return e * (n * k // 2 + n * k // 16 + 4)

    expected = layers * (nvfp4_bytes(2 * i, h) + nvfp4_bytes(h, i))
    if precision == "quads":
        s_gate_up, s_down = num_residual_channels(h, engine.ratio), num_residual_channels(i, engine.ratio)
        expected += layers * (nvfp4_bytes(2 * i, s_gate_up) + nvfp4_bytes(h, s_down) + 4 * e * (s_gate_up + s_down))
    assert _storage_bytes(held) == expected == engine.expert_weight_bytes()
    bf16 = _engine(trainers, "bf16")
    dense = _storage_bytes(_held_expert_tensors(bf16))
    assert dense == bf16.expert_weight_bytes()
    assert dense == layers * e * 3 * h * i * 4 and expected < dense / 5


def test_calibration_records_the_experts_inputs_under_w4a16(trainers) -> None:
    """Calibration's forward runs expert by expert with every expert linear in W4A16 (``w4a16``) over
    the NVFP4 weights; afterwards the experts compute under quads again, grouped."""
    engine = _engine(trainers, "quads", quantized=True)
    seen = set()
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.add(mod.precision)) for m in engine.experts.values()]
    engine.calibrate(PROMPTS)
    assert seen == {Precision("w4a16")}
    for handle in handles:
        handle.remove()
    assert {m.precision for m in engine.experts.values()} == {Precision("quads", engine.ratio)}
    assert len(engine._grouped_layers) == CFG.num_layers


WIDE_CFG = PolicyModelConfig(dtype="fp32", num_layers=1, num_experts=4, moe_ffn_hidden_size=768)
"""Experts whose down projection (K 768) takes a widened RAC tail where the warp-specialized
kernel runs: 96 channels at ratio 0.125 become 256 (growth 1.19); gate/up (K 128) keeps its 16."""


def _wide_tail_weights() -> tuple[object, dict[int, torch.Tensor]]:
    """Random :data:`WIDE_CFG` weights quantized with fixed RAC channels (ratio 0.125), and the
    channels by K."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_quads.rollout.hf_experts import checkpoint_weights

    torch.manual_seed(2)
    tensors = checkpoint_weights(Qwen3MoeForCausalLM(qwen3_moe_config(WIDE_CFG)))
    g = torch.Generator().manual_seed(3)
    experts = [n.removesuffix(".weight") for n in tensors if EXPERT.match(n.removesuffix(".weight"))]
    picked = {k: torch.randperm(k, generator=g)[: k // 8].sort().values for k in (128, 768)}
    channels = {m: picked[768] if m.endswith("down_proj") else picked[128] for m in experts}
    weights = quantize_hf_weights(tensors.items(), lambda m: bool(EXPERT.match(m)), channels, 0.125,
                                  unquantized_dtype=torch.float32)
    return weights, picked


def _tails(layer) -> list[torch.Tensor]:
    return [t for p in (layer.gate_up, layer.down) for t in (p.channels, p.residual.codes, p.residual.scales)]


def _gluon_ws_importable() -> bool:
    """Whether Triton and its Gluon warp-specialized grouped kernel import here (no GPU needed)."""
    from megatron_quads.kernels import dispatch

    return dispatch.gluon_module("w4a16_ws") is not None


@pytest.mark.skipif(not _gluon_ws_importable(), reason="needs Triton with Gluon warp specialization (pip install triton)")
def test_grouped_tails_are_prepared_at_load_and_a_forward_builds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the dispatch rule widens a tail (faked here: the warp-specialized kernel "runs" on this
    device), the grouped projections hold it widened once the weights load: the down projection's
    96 channels (K 768) as 256, the gate/up's 16 (K 128, too much growth) as given; the experts'
    states keep the chosen channels. The reference forward takes the widened tail (the same tokens
    as without widening), builds no tail, and a move to a device the rule does not widen for gives
    back the chosen width."""
    import megatron_quads.kernels.w4a4 as w4a4_kernels
    import megatron_quads.rollout.grouped as grouped_module
    from megatron_quads.kernels import dispatch

    weights, picked = _wide_tail_weights()

    def load(widen: bool) -> TorchRolloutEngine:
        engine = TorchRolloutEngine(qwen3_moe_config(WIDE_CFG), precision=Precision("quads", 0.125), dtype=torch.float32)
        with monkeypatch.context() as m:
            if widen:
                m.setattr(dispatch, "device_arch", lambda device: dispatch.SM90)
                m.setattr(grouped_module, "use_kernels", lambda *tensors: True)  # preparation only: no forward runs here
            engine.load_weights(weights, version=1)
        return engine

    engine, plain = load(widen=True), load(widen=False)
    layer = engine._grouped_layers[0].grouped
    assert layer.down.channels.shape == (4, 256) and layer.down.num_channels == 96
    assert torch.equal(layer.down.channels[:, :96], picked[768].to(torch.int32).expand(4, -1))
    assert tuple(layer.down.residual.shape) == (4, 128, 256) and not layer.down.residual.codes[..., 48:].any()
    assert layer.gate_up.channels.shape == (4, 16)
    assert plain._grouped_layers[0].grouped.down.channels.shape == (4, 96)
    for state in layer.down.states:
        assert state.channels[0.125].numel() == 96 and tuple(state.residual[0.125].shape) == (128, 96)
    tails = _tails(layer)
    built = []
    monkeypatch.setattr(w4a4_kernels, "padded_tail", lambda *args: built.append(args))
    params = SamplingParams(max_new_tokens=4, seed=5)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert not built and all(a is b for a, b in zip(tails, _tails(layer), strict=True))
    engine.to_device("meta")
    assert layer.down.channels.shape == (4, 96) and tuple(layer.down.residual.shape) == (4, 128, 96)


def _ws_grouped_runs_on_cuda() -> bool:
    """Whether the grouped dispatch hands K-768 calls to the warp-specialized kernel (an sm_90 GPU)."""
    if not torch.cuda.is_available():
        return False
    from megatron_quads.kernels import dispatch

    return dispatch.warp_specialized_grouped(torch.device("cuda"), 768) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _ws_grouped_runs_on_cuda(), reason="the warp-specialized grouped kernel runs on sm_90 GPUs only")
def test_quads_engine_on_sm90_widens_tails_when_weights_load_or_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an sm_90 GPU the down projection's tail is widened when the weights load there and again
    after a sleep / wake (narrow on the CPU), a forward builds none, and the grouped layer (the
    warp-specialized kernel over the widened tail) gives the per-expert loop's greedy tokens (the
    dense kernels over the narrow tail), log-probs within 1e-4."""
    import megatron_quads.kernels.w4a4 as w4a4_kernels

    weights, _ = _wide_tail_weights()
    runs, built = {}, []
    for grouped in (True, False):
        engine = TorchRolloutEngine(qwen3_moe_config(WIDE_CFG), precision=Precision("quads", 0.125), dtype=torch.float32,
                                    device="cuda", grouped=grouped)
        engine.load_weights(weights, version=1)
        if grouped:
            down = engine._grouped_layers[0].grouped.down
            assert down.channels.shape == (4, 256) and down.channels.is_cuda
            engine.to_device("cpu")
            assert down.channels.shape == (4, 96) and not down.residual.codes.is_cuda
            engine.to_device("cuda")
            assert down.channels.shape == (4, 256) and down.residual.codes.is_cuda
            layer = engine._grouped_layers[0].grouped
            tails = _tails(layer)
            monkeypatch.setattr(w4a4_kernels, "padded_tail", lambda *args: built.append(args))
        runs[grouped] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert not built and all(a is b for a, b in zip(tails, _tails(layer), strict=True))
    for g, ref in zip(runs[True], runs[False], strict=True):
        assert g.token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
