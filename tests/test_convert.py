"""``megatron-quads convert hf-to-megatron / megatron-to-hf / reshard`` on tiny Qwen3-MoE models made with
transformers: bit-identical round trips through several TP/EP layouts, Megatron logits equal to
transformers', and clear errors for bad input.

Conversions that start Megatron ranks run in one fresh process per test module (through the CLI), so
the ranks fork from a process without a torch.distributed group of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_quads.convert.commands import hf_to_megatron, megatron_to_hf
from megatron_quads.manifest import sha256, verify_manifest
from megatron_quads.rollout.checkpoint_format import read_checkpoint_tensors
from megatron_quads.trainer.model import ParallelConfig, load_model_config

transformers = pytest.importorskip("transformers")

SHAPES = {
    # GQA, head_dim != hidden / heads, untied, unnormalised top-k, fp32
    "gqa_untied": dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, dtype=torch.float32),
    # MHA, tied embeddings, normalised top-k, a large epsilon (so the logits check sees it), bf16
    "mha_tied_bf16": dict(vocab_size=64, hidden_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                          rms_norm_eps=0.1, tie_word_embeddings=True, dtype=torch.bfloat16),
}
LAYOUTS = {"tp2_ep2": (2, 2), "tp1_ep1": (1, 1), "tp2_ep1": (2, 1), "tp1_ep2": (1, 2)}


def _make_hf_model(directory: Path, shape: dict, seed: int) -> Path:
    fields = dict(shape)
    dtype = fields.pop("dtype")
    config = transformers.Qwen3MoeConfig(intermediate_size=64, max_position_embeddings=64, rope_theta=5000.0, **fields)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.1)  # norms near 1
    model.to(dtype).save_pretrained(directory)
    return directory


def _convert_in_fresh_process(commands: list[list[str]]) -> None:
    code = "import json, sys\nfrom megatron_quads.cli import main\nfor argv in json.loads(sys.argv[1]):\n" \
           "    code = main(argv)\n    assert code == 0, (argv, code)\n"
    subprocess.run([sys.executable, "-c", code, json.dumps(commands)], check=True, timeout=600)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every HF model and each of its Megatron conversions: ``{"<shape>": hf dir, "<shape>/<layout>": ckpt}``."""
    root = tmp_path_factory.mktemp("convert")
    paths: dict[str, Path] = {}
    commands = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        paths[name] = _make_hf_model(root / name / "hf", shape, seed=i)
        layouts = LAYOUTS if name == "gqa_untied" else {"tp2_ep2": LAYOUTS["tp2_ep2"]}
        for layout, (tp, ep) in layouts.items():
            paths[f"{name}/{layout}"] = root / name / layout
            commands.append(["convert", "hf-to-megatron", str(paths[name]), str(paths[f"{name}/{layout}"]),
                             "--tp", str(tp), "--ep", str(ep)])
    _convert_in_fresh_process(commands)
    return paths


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint_tensors(directory)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_to_megatron_tp2_ep2_and_back_is_bit_identical(converted: dict[str, Path], shape: str, tmp_path: Path) -> None:
    ckpt = converted[f"{shape}/tp2_ep2"]
    assert load_model_config(ckpt).rms_norm_eps == SHAPES[shape]["rms_norm_eps"]
    verify_manifest(ckpt)
    out = megatron_to_hf(ckpt, tmp_path / "hf", progress=False)
    source, exported = _tensors(converted[shape]), _tensors(out)
    if SHAPES[shape]["tie_word_embeddings"]:
        source.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoConfig.from_pretrained(out)
    original = transformers.AutoConfig.from_pretrained(converted[shape])
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "norm_topk_prob", "tie_word_embeddings",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size"):
        assert getattr(reloaded, key) == getattr(original, key), key
    assert reloaded.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
    # config.json comes back in the source's (transformers 5) form, key for key
    written, source_config = (json.loads((d / "config.json").read_text()) for d in (out, converted[shape]))
    assert "num_local_experts" in source_config and "rope_parameters" in source_config
    assert written == source_config and list(written) == list(source_config)
    verify_manifest(out)


def test_megatron_to_hf_gives_identical_files_from_every_layout(converted: dict[str, Path], tmp_path: Path) -> None:
    digests = {}
    for layout in LAYOUTS:
        out = megatron_to_hf(converted[f"gqa_untied/{layout}"], tmp_path / layout, progress=False)
        digests[layout] = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.name != "manifest.json"}
    assert len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1, digests
    assert "model.safetensors" in digests["tp1_ep1"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_megatron_logits_equal_transformers_logits(converted: dict[str, Path], shape: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import build_gpt_model

    ckpt = converted[f"{shape}/tp2_ep2"]
    init_trainer_distributed(1, 0, ParallelConfig())
    cfg = load_model_config(ckpt).model_copy(update={"dtype": "fp32"})
    model = build_gpt_model(cfg, ParallelConfig(), initialize=False)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
    model.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in state.items()})
    reference = transformers.AutoModelForCausalLM.from_pretrained(converted[shape], dtype=torch.float32).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU host Megatron makes its RoPE tables there
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        megatron_logits = model.to(device).eval()(ids, torch.arange(12, device=device).expand(2, 12), attention_mask=None)
        hf_logits = reference.to(device)(ids).logits
    # fp32 on both sides; what differs is summation order
    assert (megatron_logits - hf_logits).abs().max() < 1e-4
    assert hf_logits.abs().max() > 0.1


def test_reshard_keeps_the_weights_and_changes_the_layout(converted: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "tp1_ep4"
    _convert_in_fresh_process([["convert", "reshard", str(converted["mha_tied_bf16/tp2_ep2"]), str(target),
                                "--tp", "1", "--ep", "4"]])
    manifest = verify_manifest(target)
    assert manifest["layout"] == {"tensor_parallel": 1, "expert_parallel": 4, "expert_tensor_parallel": 1}
    assert {p.name.split("_")[2] for p in target.glob("*.distcp")} == {"0", "1", "2", "3"}  # __<rank>_<bucket>.distcp
    a = megatron_to_hf(target, tmp_path / "a", progress=False)
    b = megatron_to_hf(converted["mha_tied_bf16/tp2_ep2"], tmp_path / "b", progress=False)
    assert sha256(a / "model.safetensors") == sha256(b / "model.safetensors")


def test_shards_are_bounded_and_indexed(converted: dict[str, Path], tmp_path: Path) -> None:
    out = megatron_to_hf(converted["gqa_untied/tp1_ep1"], tmp_path / "sharded", max_shard_bytes=60_000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 4  # embedding, layer 0, layer 1, head (each above the bound on its own)
    assert {n for f in files for n in load_file(out / f)} == set(index["weight_map"])
    source = _tensors(converted["gqa_untied"])
    assert all(torch.equal(t, source[n]) for n, t in _tensors(out).items())


# ---------------------------------------------------------------------------------------------- errors


def _copy_hf(converted: dict[str, Path], tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(converted["gqa_untied"], tmp_path / "edited"))


def test_an_unsupported_architecture_is_refused(converted: dict[str, Path], tmp_path: Path) -> None:
    hf = _copy_hf(converted, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        hf_to_megatron(hf, tmp_path / "out", ParallelConfig(), progress=False)
    (hf / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf_to_megatron(hf, tmp_path / "out", ParallelConfig(), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_missing_or_misshapen_tensor_is_named(converted: dict[str, Path], tmp_path: Path) -> None:
    hf = _copy_hf(converted, tmp_path)
    tensors = load_file(hf / "model.safetensors")
    victim = "model.layers.1.mlp.experts.3.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != victim}, hf / "model.safetensors")
    with pytest.raises(ValueError, match=victim):
        hf_to_megatron(hf, tmp_path / "out", ParallelConfig(), progress=False)
    bad = dict(tensors)
    bad[victim] = bad[victim][:, :-1].contiguous()
    save_file(bad, hf / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{victim}.*shape \[32, 63\].*\[32, 64\]"):
        hf_to_megatron(hf, tmp_path / "out", ParallelConfig(), progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


_CLI_CALLS = """import contextlib, io, json, sys
from megatron_quads.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print("RESULTS " + json.dumps(results))
"""


def _cli_in_fresh_process(commands: list[list[str]]) -> list[tuple[int, str]]:
    """``(exit code, stderr)`` of each command, run one after the other in one fresh process."""
    done = subprocess.run([sys.executable, "-c", _CLI_CALLS, json.dumps(commands)], capture_output=True, text=True,
                          check=True, timeout=600)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    return [tuple(r) for r in json.loads(line[len("RESULTS "):])]


def test_non_finite_weights_are_refused_naming_the_tensor_unless_allowed(converted: dict[str, Path], tmp_path: Path) -> None:
    """hf-to-megatron, reshard and megatron-to-hf stop at a NaN or Inf and name the tensor (exit code
    2, one line); with --allow-nonfinite they copy it where it was."""
    hf = _copy_hf(converted, tmp_path)
    tensors = load_file(hf / "model.safetensors")
    victim = "model.layers.1.mlp.experts.2.down_proj.weight"
    tensors[victim][5, 3] = float("nan")
    tensors["model.norm.weight"][7] = float("-inf")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    ckpt = tmp_path / "megatron"
    results = _cli_in_fresh_process([
        ["convert", "hf-to-megatron", str(hf), str(tmp_path / "refused"), "--ep", "2"],
        ["convert", "hf-to-megatron", str(hf), str(ckpt), "--ep", "2", "--allow-nonfinite"],
        ["convert", "reshard", str(ckpt), str(tmp_path / "resharded"), "--ep", "1"],
    ])
    (refused, err), (allowed, _), (resharded, reshard_err) = results
    assert refused == 2 and allowed == 0 and resharded == 2, results
    # the ranks' logs share stderr: the command's message is the line it prints
    message = next(line for line in err.splitlines() if line.startswith("convert hf-to-megatron: "))
    assert re.search(r"tensor 'model\.(norm|layers\.1\.mlp\.experts\.2\.down_proj)\.weight' in .*edited/model\.safetensors "
                     r"holds 1 NaN or Inf values.*--allow-nonfinite\)$", message), message
    assert "Traceback" not in err
    message = next(line for line in reshard_err.splitlines() if line.startswith("convert reshard: "))
    assert re.search(rf"tensor '.*' in {ckpt} holds 1 NaN or Inf values", message), message
    assert not (tmp_path / "refused").exists() and not (tmp_path / "resharded").exists()

    with pytest.raises(ValueError, match=rf"tensor '{victim}' in {ckpt} \(Megatron tensor 'decoder\.layers\..*fc2.*'\) "
                                         r"holds 1 NaN or Inf values"):
        megatron_to_hf(ckpt, tmp_path / "hf_refused", progress=False)
    out = megatron_to_hf(ckpt, tmp_path / "hf_copied", progress=False, allow_nonfinite=True)
    copied = _tensors(out)
    assert torch.isnan(copied[victim][5, 3]) and int(torch.isnan(copied[victim]).sum()) == 1
    assert copied["model.norm.weight"][7] == float("-inf")
    assert all(torch.equal(t, tensors[n]) for n, t in copied.items() if n not in (victim, "model.norm.weight"))


def test_an_existing_target_needs_overwrite(converted: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "exists"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        megatron_to_hf(converted["gqa_untied/tp1_ep1"], target, progress=False)
    assert (target / "keep.txt").read_text() == "mine"
    megatron_to_hf(converted["gqa_untied/tp1_ep1"], target, overwrite=True, progress=False)
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").is_file()


def test_a_layout_that_does_not_divide_the_model_is_refused(converted: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_experts = 4 is not divisible by --ep 3"):
        hf_to_megatron(converted["gqa_untied"], tmp_path / "out", ParallelConfig(expert_parallel=3), progress=False)


def test_a_checkpoint_without_its_architecture_asks_for_model_config(converted: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    ckpt = Path(shutil.copytree(converted["gqa_untied/tp1_ep1"], tmp_path / "ckpt"))
    (ckpt / "model_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="--model-config"):
        megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    wrong = load_model_config(converted["mha_tied_bf16/tp2_ep2"])
    with pytest.raises(ValueError, match="does not describe this checkpoint"):
        megatron_to_hf(ckpt, tmp_path / "out", model=wrong, progress=False)


def test_a_grpo_runs_step_directory_converts_as_its_trainer_checkpoint(converted: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from megatron_quads.convert.megatron_source import is_dist_checkpoint
    from megatron_quads.trainer.settings import dist_checkpoint_dir

    step = tmp_path / "run" / "checkpoints" / "step_20"  # what the GRPO controller writes: the trainer's part in trainer/
    shutil.copytree(converted["gqa_untied/tp1_ep1"], step / "trainer")
    (step / "controller.json").write_text("{}")
    assert dist_checkpoint_dir(step) == step / "trainer" and is_dist_checkpoint(step)
    assert dist_checkpoint_dir(step / "trainer") == step / "trainer" and not is_dist_checkpoint(tmp_path / "run")
    a = megatron_to_hf(step, tmp_path / "from_step", progress=False)
    b = megatron_to_hf(converted["gqa_untied/tp1_ep1"], tmp_path / "direct", progress=False)
    assert sha256(a / "model.safetensors") == sha256(b / "model.safetensors")
