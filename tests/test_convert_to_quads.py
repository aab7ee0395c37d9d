"""``convert to-quads`` on the embedded model (HF export and Megatron dist checkpoint, fp32, char tokenizer).

Checked: the RAC channels are the built-in engine's choice on the same prompts; static input scales
are the calibration amaxes / 2688 (absent when dynamic); experts_and_attention gives q/k/v one
channel set and one scale; a Megatron source and its HF export give identical tensors; a calibration
file, or the source's HF tokenizer, gives the same output as the same prompts sampled; long prompts
are truncated; the manifest lists every file; errors name
the problem; ModelOpt decodes every NVFP4 tensor to the project's values; vLLM serves the output as
the built-in engine does; ``analyze`` runs on it; the exports carry the character tokenizer's files,
so vLLM tokenizes text prompts and stops on ``<eos>`` by itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_quads.precision import Precision
from megatron_quads import embedded
from megatron_quads.convert.commands import megatron_to_hf
from megatron_quads.convert.to_quads import to_quads
from megatron_quads.manifest import MANIFEST, verify_manifest
from megatron_quads.nvfp4 import NVFP4Tensor, dequantize
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.quantized_checkpoint import load_quantized_weights
from megatron_quads.rollout.quantized_linear import input_scale_from_amax
from megatron_quads.rollout.rac import num_residual_channels
from megatron_quads.tasks import encode_prompt

RATIO = 0.25
PROMPTS, SEED = 16, 3
CALIBRATION = {"calibration_prompts": PROMPTS, "seed": SEED, "progress": False}


def _prompt_texts() -> list[str]:
    return [p.text for p in embedded.task(split="eval").sample_prompts(PROMPTS, seed=SEED)]


def _prompt_ids() -> list[list[int]]:
    tok = embedded.tokenizer()
    return [encode_prompt(tok, text) for text in _prompt_texts()]


def _engine_config(directory: Path):
    from transformers import Qwen3MoeConfig

    doc = json.loads((directory / fmt.MODEL_CONFIG_FILE).read_text())
    doc.pop("quantization_config")
    return Qwen3MoeConfig(**doc)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / fmt.SINGLE_FILE), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("to_quads")


@pytest.fixture(scope="module")
def hf_dir(root: Path) -> Path:
    return megatron_to_hf(embedded.ASSET_DIR / "checkpoint", root / "hf", progress=False)


@pytest.fixture(scope="module")
def static_out(hf_dir: Path, root: Path) -> Path:
    return to_quads(hf_dir, root / "static", RATIO, input_scales="static", **CALIBRATION)


@pytest.fixture(scope="module")
def attention_out(hf_dir: Path, root: Path) -> Path:
    return to_quads(hf_dir, root / "attention", RATIO, scope="routed_experts_and_attention", **CALIBRATION)


def test_channels_are_what_the_builtin_engine_chooses_on_the_same_prompts(static_out: Path) -> None:
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine

    weights = load_quantized_weights(static_out, verify_residual=True)
    assert len(weights.quantized) == 4 * 8 * 3 and weights.residual_fraction == pytest.approx(RATIO)
    engine = TorchRolloutEngine(_engine_config(static_out), precision=Precision("quads", RATIO), dtype=torch.float32)
    engine.load_weights(weights.with_residual_channels(dict.fromkeys(weights.quantized)), version=0)
    engine.calibrate(_prompt_ids())
    expected = engine.residual_channels()
    assert expected.keys() == weights.quantized.keys()
    for module, lin in weights.quantized.items():
        assert torch.equal(lin.residual_channels, expected[module]), module
        assert lin.num_residual_channels == num_residual_channels(lin.in_features, RATIO)
    chosen = {tuple(lin.residual_channels.tolist()) for lin in weights.quantized.values()}
    assert len(chosen) > 10  # per-expert choices, not one fixed set


def test_static_input_scales_are_the_calibration_amax(static_out: Path, attention_out: Path) -> None:
    """Layer 0's MoE input does not depend on any quantized linear, so an independent forward
    gives it exactly: the largest gate/up input scale of the layer is its max |x| / 2688."""
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine

    weights = load_quantized_weights(static_out)
    for module, lin in weights.quantized.items():
        assert lin.input_scale is not None and 0 < float(lin.input_scale) < float("inf"), module
        if module.endswith("gate_proj"):
            up = weights.quantized[module.replace("gate_proj", "up_proj")]
            assert torch.equal(lin.input_scale, up.input_scale)
    engine = TorchRolloutEngine(_engine_config(static_out), precision=Precision("w4a16"), dtype=torch.float32)
    engine.load_weights(weights, version=0)
    seen = []
    hook = engine.model.model.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().amax()))
    by_length: dict[int, list[list[int]]] = {}
    for ids in _prompt_ids():  # batched as calibration batches them: by length, no padding
        by_length.setdefault(len(ids), []).append(ids)
    with torch.no_grad():
        for group in by_length.values():
            engine.model(**engine._batch(group))
    hook.remove()
    layer0 = [lin.input_scale for m, lin in weights.quantized.items() if m.startswith("model.layers.0.") and "gate_proj" in m]
    assert torch.equal(torch.stack(layer0).amax(), input_scale_from_amax(torch.stack(seen).amax()))

    dynamic = _tensors(attention_out)
    assert not [n for n in dynamic if n.endswith(".input_scale")]
    assert json.loads((attention_out / fmt.QUANT_CONFIG_FILE).read_text())["quads"]["input_scales"] is False


def test_experts_and_attention_gives_q_k_v_one_channel_set_and_one_scale(attention_out: Path) -> None:
    weights = load_quantized_weights(attention_out, verify_residual=True)
    assert len(weights.quantized) == 4 * (8 * 3 + 4)
    exclude = json.loads((attention_out / fmt.QUANT_CONFIG_FILE).read_text())["quantization"]["exclude_modules"]
    assert not [e for e in exclude if "self_attn" in e or "experts" in e]
    for layer in range(4):
        q, k, v, o = (weights.quantized[f"model.layers.{layer}.self_attn.{p}_proj"] for p in "qkvo")
        assert q.num_residual_channels == num_residual_channels(q.in_features, RATIO) > 0
        assert torch.equal(q.residual_channels, k.residual_channels) and torch.equal(q.residual_channels, v.residual_channels)
        assert torch.equal(q.weight_scale_2, k.weight_scale_2) and torch.equal(q.weight_scale_2, v.weight_scale_2)
        assert o.num_residual_channels == num_residual_channels(o.in_features, RATIO)
        assert not torch.equal(q.residual_channels, torch.arange(q.num_residual_channels, dtype=torch.int32))


def test_a_megatron_source_gives_the_tensors_of_its_hf_export(static_out: Path, root: Path) -> None:
    out = to_quads(embedded.ASSET_DIR / "checkpoint", root / "from_megatron", RATIO, input_scales="static", **CALIBRATION)
    ours, theirs = _tensors(out), _tensors(static_out)
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert _same_bytes(t, theirs[name]), name
    assert (out / fmt.MODEL_CONFIG_FILE).read_text() == (static_out / fmt.MODEL_CONFIG_FILE).read_text()
    assert json.loads((out / MANIFEST).read_text())["source_kind"] == "megatron-dist"


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_calibration_file_gives_what_the_same_prompts_sampled_give(hf_dir: Path, static_out: Path, root: Path,
                                                                    suffix: str) -> None:
    texts = _prompt_texts()
    lines = [json.dumps({"prompt": t} if i % 2 else {"text": t}) for i, t in enumerate(texts)] if suffix == ".jsonl" else texts
    path = root / f"prompts{suffix}"
    path.write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")  # a blank line is skipped
    out = to_quads(hf_dir, root / f"from_file{suffix}", RATIO, input_scales="static", calibration_file=path,
                   progress=False)
    ours, theirs = _tensors(out), _tensors(static_out)
    assert ours.keys() == theirs.keys() and all(_same_bytes(t, theirs[n]) for n, t in ours.items())
    assert json.loads((out / MANIFEST).read_text())["quads"]["calibration"]["source"] == f"file {path.resolve()}"


def test_a_prompt_longer_than_the_model_is_truncated(hf_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_text("1+2=" * 30 + "\n3+4=\n")  # 121 tokens with <bos>; max_position_embeddings is 64
    out = to_quads(hf_dir, tmp_path / "out", RATIO, calibration_file=path, progress=False)
    calibration = json.loads((out / MANIFEST).read_text())["quads"]["calibration"]
    assert (calibration["prompts"], calibration["tokens"], calibration["truncated_prompts"]) == (2, 64 + 5, 1)


def _char_level_hf_tokenizer(directory: Path) -> None:
    """An HF tokenizer (tokenizer.json + tokenizer_config.json) with the char tokenizer's ids."""
    from tokenizers import Regex, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    char = embedded.tokenizer()
    tok = Tokenizer(WordLevel({char.decode([i], skip_special_tokens=False): i for i in range(char.vocab_size)}, unk_token="<pad>"))
    tok.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_the_sources_tokenizer_is_used_and_copied(hf_dir: Path, static_out: Path, tmp_path: Path) -> None:
    source = tmp_path / "hf_with_tokenizer"
    shutil.copytree(hf_dir, source)
    _char_level_hf_tokenizer(source)
    out = to_quads(source, tmp_path / "out", RATIO, input_scales="static", **CALIBRATION)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    manifest = verify_manifest(out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    assert manifest["quads"]["calibration"]["tokenizer"] == str(source)
    ours, theirs = _tensors(out), _tensors(static_out)  # the same token ids as the char tokenizer's
    assert ours.keys() == theirs.keys() and all(_same_bytes(t, theirs[n]) for n, t in ours.items())


def test_the_manifest_lists_every_file_with_its_checksum(static_out: Path) -> None:
    doc = verify_manifest(static_out)
    files = sorted(p.relative_to(static_out).as_posix() for p in static_out.rglob("*") if p.is_file())
    assert sorted(doc["files"]) == [f for f in files if f != MANIFEST]
    assert {"config.json", "hf_quant_config.json", "model.safetensors"} <= set(doc["files"])
    quads = doc["quads"]
    assert (quads["ratio"], quads["scope"], quads["input_scales"]) == (RATIO, "routed_experts", "static")
    assert quads["calibration"]["tokens"] == sum(map(len, _prompt_ids())) and quads["calibration"]["prompts"] == PROMPTS
    assert quads["calibration"]["tokenizer"] == "char"
    assert not [p for p in static_out.parent.iterdir() if ".tmp-" in p.name]


def test_errors_name_the_problem(hf_dir: Path, static_out: Path, tmp_path: Path) -> None:
    from megatron_quads.cli import main
    from megatron_quads.trainer.hf_config import UnsupportedModelError

    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        to_quads(hf_dir, static_out, RATIO, progress=False)
    assert main(["convert", "to-quads", str(hf_dir), str(static_out), "--ratio", "0.25"]) == 2
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"--ratio must be a fraction of input channels in \[0, 1\]"):
            to_quads(hf_dir, tmp_path / "out", bad, progress=False)
    for wider, narrower in (("experts", "routed_experts"), ("experts_and_attention", "routed_experts_and_attention")):
        with pytest.raises(ValueError, match=f"--scope {wider} includes shared experts.*use --scope {narrower}$"):
            to_quads(hf_dir, tmp_path / "out", RATIO, scope=wider, progress=False)
    assert not (tmp_path / "out").exists()
    files = {"empty.txt": "\n  \n", "no_field.jsonl": '{"prompt": "1+2="}\n{"question": "3+4="}\n',
             "not_json.jsonl": '{"prompt": "1+2="}\nnot json\n', "alphabet.txt": "1+2=\n1+x=\n"}
    messages = {"empty.txt": "holds no prompts", "no_field.jsonl": r'no_field\.jsonl:2 has no non-empty "prompt" or "text"',
                "not_json.jsonl": r"not_json\.jsonl:2 is not a JSON object", "alphabet.txt": r"alphabet\.txt:2: character 'x'"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=messages[name]):
            to_quads(hf_dir, tmp_path / "out", RATIO, calibration_file=tmp_path / name, progress=False)
    llama = tmp_path / "llama"
    shutil.copytree(hf_dir, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="llama.*unsupported architecture"):
        to_quads(llama, tmp_path / "out", RATIO, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_non_finite_source_tensor_and_a_binary_calibration_file_are_named(hf_dir: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file, save_file

    from megatron_quads.cli import main

    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"1+2=\n3+4=\n\xff\xfe\x00\x01\n")
    assert main(["convert", "to-quads", str(hf_dir), str(tmp_path / "out"), "--ratio", "0.25", "--calibration",
                 str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"{binary}:3 is not UTF-8 text (byte 0xff at offset 10)" in err and "codec" not in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    damaged = Path(shutil.copytree(hf_dir, tmp_path / "damaged"))
    tensors = load_file(damaged / fmt.SINGLE_FILE)
    tensors["model.embed_tokens.weight"][3, 5] = float("inf")
    save_file(tensors, damaged / fmt.SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor 'model\.embed_tokens\.weight' in {damaged / fmt.SINGLE_FILE} holds "
                                         r"1 NaN or Inf values"):
        to_quads(damaged, tmp_path / "out", RATIO, **CALIBRATION)
    assert not (tmp_path / "out").exists()


def test_modelopt_decodes_every_nvfp4_tensor_to_the_projects_values(static_out: Path, attention_out: Path) -> None:
    """ModelOpt's NVFP4QTensor.dequantize evaluated in float64 is the exact product
    ``e2m1 * scale * weight_scale_2``; the project's float32 dequantize rounds that product once, so
    the two agree bit for bit after one rounding to float32 (ModelOpt's own float32 path multiplies
    in another order and may differ by one ulp). The one other difference is the sign of zero:
    ModelOpt decodes E2M1 code 8 (-0) as +0."""
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    checked = 0
    for directory in (static_out, attention_out):
        tensors = _tensors(directory)
        for name in [n for n in tensors if n.endswith(".weight_scale_2")]:
            module = name.removesuffix(".weight_scale_2")
            scale_2 = tensors[name]
            for codes, scale in ((tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]),
                                 (tensors[f"{module}.residual_weight"], tensors[f"{module}.residual_weight_scale"])):
                shape = torch.Size((codes.shape[0], 2 * codes.shape[1]))
                theirs = nvfp4_tensor.NVFP4QTensor(shape, torch.float64, codes).dequantize(
                    dtype=torch.float64, scale=scale.to(torch.float64), double_scale=scale_2.double(), block_sizes={-1: 16})
                ours = dequantize(NVFP4Tensor(codes=codes, scales=scale, weight_scale_2=scale_2, shape=shape, dtype=torch.float32))
                theirs = theirs.to(torch.float32)
                assert torch.equal(theirs, ours), module  # -0.0 == 0.0
                nonzero = ours != 0
                assert torch.equal(theirs[nonzero].view(torch.int32), ours[nonzero].view(torch.int32)), module
                checked += 1
    assert checked == 2 * (96 + 112)


def test_analyze_runs_on_the_output_from_its_nvfp4_weights(attention_out: Path, tmp_path: Path) -> None:
    from megatron_quads.cli import main

    args = ["analyze", "--hf-model", str(attention_out), "--out", str(tmp_path), "--sequences", "2", "--seq-len", "8",
            "--ratios", "0.25", "--statistics", "output_error"]
    assert main(args) == 0
    report = json.loads((tmp_path / "analysis.json").read_text())
    assert str(attention_out) in report["model"] and report["tokens"] == 16
    # it starts from the NVFP4 weights: quantizing them again gives them back, so W4A16 has no weight error
    assert max(layer["weight_rel"] for layer in report["pairs"]["bf16 vs w4a16"]["layers"].values()) < 1e-6
    assert report["pairs"]["aqat vs w4a4"]["gap"]["mean_abs"] > 0


def test_vllm_serves_the_output_as_the_builtin_engine_does(static_out: Path) -> None:
    pytest.importorskip("vllm")
    from megatron_quads.rollout.engine import SamplingParams
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine
    from megatron_quads.vllm_plugin.engine import VllmRolloutEngine
    from vllm_support import max_logprob_gap, task_prompts

    prompts, greedy = task_prompts(12, seed=5), SamplingParams(max_new_tokens=8, temperature=0.0)
    reference = TorchRolloutEngine(_engine_config(static_out), precision=Precision("quads", RATIO), dtype=torch.float32)
    reference.load_weights(load_quantized_weights(static_out), version=0)
    expected = reference.generate(prompts, greedy)
    config = json.loads((static_out / fmt.MODEL_CONFIG_FILE).read_text())
    engine = VllmRolloutEngine(config, precision=Precision("quads", RATIO), dtype=torch.float32, checkpoint=static_out)
    try:
        served = engine.generate(prompts, greedy)
    finally:
        engine.close()
    assert [g.token_ids for g in served] == [g.token_ids for g in expected]
    assert max_logprob_gap(served, expected) < 5e-5  # fp32 both sides; tests/test_vllm_engine.py's tolerance


def test_the_embedded_model_s_exports_carry_its_character_tokenizer(hf_dir: Path, static_out: Path) -> None:
    from megatron_quads.tasks.char_tokenizer import HF_TOKENIZER_FILES

    for out in (hf_dir, static_out):
        listed = verify_manifest(out)["files"]
        for name in HF_TOKENIZER_FILES:
            assert (out / name).read_bytes() == (embedded.TOKENIZER_DIR / name).read_bytes(), (out, name)
            assert name in listed
    assert json.loads((static_out / MANIFEST).read_text())["quads"]["calibration"]["tokenizer"] == "char"


def test_vllm_stops_on_the_embedded_tokenizer_s_eos_by_itself(static_out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text prompts and no stop tokens: vLLM reads the shipped tokenizer files, puts <bos> first and ends
    each answer at <eos>, as the built-in engine does when told to stop there."""
    pytest.importorskip("vllm")
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    from megatron_quads.rollout.engine import SamplingParams
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    texts, tok = _prompt_texts()[:6], embedded.tokenizer()
    reference = TorchRolloutEngine(_engine_config(static_out), precision=Precision("quads", RATIO), dtype=torch.float32)
    reference.load_weights(load_quantized_weights(static_out), version=0)
    expected = reference.generate([encode_prompt(tok, t) for t in texts],
                                  SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(tok.eos_id,)))
    llm = LLM(model=str(static_out), dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
    try:
        served = llm.generate(texts, VllmSamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    finally:
        del llm
    assert [o.prompt_token_ids for o in served] == [encode_prompt(tok, t) for t in texts]
    assert all(o.outputs[0].finish_reason == "stop" for o in served)
    assert [list(o.outputs[0].token_ids) for o in served] == [g.token_ids for g in expected]
    assert all(g.token_ids[-1] == tok.eos_id for g in expected)
    assert [o.outputs[0].text for o in served] == [tok.decode(g.token_ids) for g in expected]


def test_vllm_calibrating_the_attention_output_again_chooses_the_same_channels(attention_out: Path) -> None:
    """The plugin calibrates every quantized linear (experts, qkv_proj, o_proj) inside vLLM, from
    its own W4A16 forward: on the same prompts it picks the attention channels to-quads wrote, and
    serving both gives the same log-probs."""
    pytest.importorskip("vllm")
    from megatron_quads.rollout.engine import SamplingParams
    from megatron_quads.vllm_plugin.engine import VllmRolloutEngine
    from vllm_support import max_logprob_gap, task_prompts

    prompts, greedy = task_prompts(12, seed=5), SamplingParams(max_new_tokens=8, temperature=0.0)
    weights = load_quantized_weights(attention_out)
    config = json.loads((attention_out / fmt.MODEL_CONFIG_FILE).read_text())
    engine = VllmRolloutEngine(config, precision=Precision("quads", RATIO), dtype=torch.float32, checkpoint=attention_out)
    try:
        served = engine.generate(prompts, greedy)
        engine.calibrate(_prompt_ids())
        recalibrated = engine.generate(prompts, greedy)
        layers = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model().model.layers
        for i, layer in enumerate(layers):
            for leaf, module in (("q_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)):
                ours = weights.quantized[f"model.layers.{i}.self_attn.{leaf}"].residual_channels
                assert torch.equal(module.residual_channels[0].cpu(), ours), f"layer {i} {leaf}"
    finally:
        engine.close()
    assert [g.token_ids for g in served] == [g.token_ids for g in recalibrated]
    assert max_logprob_gap(served, recalibrated) < 5e-5
