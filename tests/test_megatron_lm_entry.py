"""QUADS in Megatron-LM's scripts: the --quads-* flags, the --spec module, the launcher, checkpoint args.

Megatron-LM's training package is not installed here: the arguments are the namespace its parser
would produce (the QUADS flags parsed by :func:`add_quads_args` itself, plus the model flags the spec
reads, under Megatron-LM's attribute names).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_quads.megatron_lm import pretrain_gpt as launcher
from megatron_quads.megatron_lm.args import SPEC, add_quads_args, quads_config_from_args
from megatron_quads.megatron_lm.checkpoint import (
    model_config_from_megatron_lm_args,
    read_megatron_lm_args,
    recorded_rac_ratio,
)
from megatron_quads.megatron_lm.spec import MegatronLMUnavailable, quads_spec_from_args
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig, build_gpt_model, build_transformer_config
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig
from megatron_quads.trainer.specs import apply_quads
from megatron_quads.trainer.te_recipe import ROUTED_EXPERTS_FACTORY

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=32, vocab_size=32)
MODEL_ARGS = dict(  # Megatron-LM's names for TINY (plus its defaults the spec reads)
    num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_experts=4, moe_ffn_hidden_size=32,
    moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm",
    transformer_impl="local", multi_latent_attention=False, qk_l2_norm=False, moe_layer_freq=1, kv_channels=16,
    tensor_model_parallel_size=1, expert_tensor_parallel_size=1, fp4=None, fp8=None, fp4_recipe="nvfp4",
    fp4_quantizer_factory=None, first_last_layers_bf16=False, num_layers_at_start_in_bf16=1,
    num_layers_at_end_in_bf16=1, experimental_attention_variant=None, heterogeneous_layers_config_path=None,
    virtual_pipeline_model_parallel_size=None,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    from megatron_quads.trainer.cpu_compat import init_distributed_cpu

    init_distributed_cpu(world_size=1, rank=0)


def megatron_args(flags: list[str] = (), **model: object) -> argparse.Namespace:
    """What Megatron-LM's parser gives for ``flags`` (the QUADS ones, parsed) and model flags ``model``."""
    parsed = add_quads_args(argparse.ArgumentParser()).parse_args(list(flags))
    return argparse.Namespace(**{**MODEL_ARGS, **model, **vars(parsed)})


def _parse_error(flags: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        add_quads_args(argparse.ArgumentParser()).parse_args(flags)
    return capsys.readouterr().err


def _stock_local(args: argparse.Namespace):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                    qk_layernorm=args.qk_layernorm, normalization="RMSNorm")


# ---- the flags ----


def test_flags_default_to_routed_experts_1x16_enabled() -> None:
    args = megatron_args()
    assert (args.quads, args.quads_scope, args.quads_block_layout, args.quads_rac_ratio) == (True, "routed_experts", "1x16", None)
    assert quads_config_from_args(args) == QuadsTrainerConfig()
    parsed = megatron_args(["--no-quads", "--quads-scope", "all_linears", "--quads-block-layout", "16x16",
                            "--quads-rac-ratio", "0.5"])
    assert quads_config_from_args(parsed) == QuadsTrainerConfig(enabled=False, scope=QuadsScope.ALL_LINEARS, block_2d=True)
    assert parsed.quads_rac_ratio == 0.5


def test_bf16_layers_come_from_megatron_lm_own_flags() -> None:
    args = megatron_args(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert quads_config_from_args(args) == QuadsTrainerConfig(bf16_first_layers=1, bf16_last_layers=2)
    off = megatron_args(first_last_layers_bf16=False, num_layers_at_start_in_bf16=3)
    assert quads_config_from_args(off) == QuadsTrainerConfig()


@pytest.mark.parametrize("value", ["1.5", "-0.1", "abc", "nan", "inf"])
def test_bad_rac_ratio_is_rejected_by_the_parser(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["--quads-rac-ratio", value], capsys)
    assert f"argument --quads-rac-ratio: {value!r} is not a ratio" in err and "a number from 0 to 1" in err


@pytest.mark.parametrize(("flag", "value"), [("--quads-scope", "everything"), ("--quads-block-layout", "2x8")])
def test_bad_choices_are_rejected_by_the_parser(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error([flag, value], capsys)
    assert f"argument {flag}: invalid choice: '{value}'" in err


def test_bad_values_in_a_namespace_built_by_hand_are_rejected() -> None:
    with pytest.raises(ValueError, match="--quads-scope 'dense' is not a QUADS scope; choose one of routed_experts"):
        quads_config_from_args(argparse.Namespace(quads_scope="dense"))
    with pytest.raises(ValueError, match="--quads-block-layout '8x8' is not a block layout"):
        quads_config_from_args(argparse.Namespace(quads_block_layout="8x8"))
    with pytest.raises(ValueError, match="--quads-rac-ratio '2.0' is not a ratio"):
        quads_config_from_args(argparse.Namespace(quads_rac_ratio=2.0))


def test_namespace_without_quads_flags_means_quads_with_defaults() -> None:
    """The unmodified pretrain_gpt.py parses no --quads-* flags: the spec then uses the defaults."""
    assert quads_config_from_args(argparse.Namespace(**MODEL_ARGS)) == QuadsTrainerConfig()


# ---- the spec: equal to apply_quads ----


@pytest.mark.parametrize("scope", [s.value for s in QuadsScope])
@pytest.mark.parametrize("grouped", [False, True])
def test_spec_from_parsed_args_equals_apply_quads(scope: str, grouped: bool) -> None:
    args = megatron_args(["--quads-scope", scope], moe_grouped_gemm=grouped)
    config = build_transformer_config(PolicyModelConfig(**TINY, moe_grouped_gemm=grouped), ParallelConfig())
    _, expected = apply_quads(config, _stock_local(args), QuadsTrainerConfig(scope=QuadsScope(scope)))
    spec = quads_spec_from_args(args)
    assert all(layer == spec for layer in expected.layer_specs), "every layer of apply_quads' block is this spec"
    experts = spec.submodules.mlp.submodules.experts.module.__name__
    assert experts == ("FakeQuantGroupedMLP" if grouped else "FakeQuantSequentialMLP")


def test_spec_with_first_last_bf16_layers_equals_apply_quads_block() -> None:
    args = megatron_args(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    config = build_transformer_config(PolicyModelConfig(**TINY), ParallelConfig())
    _, expected = apply_quads(config, _stock_local(args), QuadsTrainerConfig(bf16_first_layers=1, bf16_last_layers=1))
    spec = quads_spec_from_args(args, config=config)
    assert spec == expected
    kinds = [s.submodules.mlp.submodules.experts.module.__name__ for s in spec.layer_specs]
    assert kinds == ["SequentialMLP", "FakeQuantSequentialMLP", "FakeQuantSequentialMLP", "SequentialMLP"]


def test_bf16_layers_without_a_config_need_megatron_lm() -> None:
    args = megatron_args(first_last_layers_bf16=True)
    with pytest.raises(MegatronLMUnavailable, match="pipeline stage's layer count.*pass config="):
        quads_spec_from_args(args)
    vpp = megatron_args(first_last_layers_bf16=True, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="one --spec for every virtual pipeline stage"):
        quads_spec_from_args(vpp)


def test_no_quads_gives_the_stock_spec() -> None:
    args = megatron_args(["--no-quads"])
    assert quads_spec_from_args(args) == _stock_local(args)


def test_model_from_the_spec_has_the_stock_checkpoint_keys_and_fake_quantizes() -> None:
    cfg = PolicyModelConfig(**TINY, dtype="fp32")
    spec = quads_spec_from_args(megatron_args())
    torch.manual_seed(0)
    stock = build_gpt_model(cfg, ParallelConfig())
    from_spec = build_gpt_model(cfg, ParallelConfig(), layer_spec=spec)
    via_apply_quads = build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig())
    assert list(from_spec.state_dict()) == list(stock.state_dict())
    assert set(from_spec.sharded_state_dict()) == set(stock.sharded_state_dict())
    from_spec.load_state_dict(stock.state_dict(), strict=True)
    via_apply_quads.load_state_dict(stock.state_dict(), strict=True)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(8).expand(2, 8)
    out = from_spec(ids, pos, attention_mask=None)
    assert torch.equal(out, via_apply_quads(ids, pos, attention_mask=None))
    assert not torch.equal(out, stock(ids, pos, attention_mask=None)), "the fake quant must change the output"


@pytest.mark.parametrize(
    ("model", "pattern"),
    [
        (dict(num_experts=None), "--num-experts is not set"),
        (dict(moe_layer_freq=[0, 1, 1, 1]), "every layer must be an MoE layer"),
        (dict(experimental_attention_variant="gated_delta_net"), "--experimental-attention-variant builds its own"),
        (dict(transformer_impl="inference_optimized"), "QUADS builds 'local' or 'transformer_engine'"),
        (dict(fp4="e2m1"), "act only on Transformer Engine modules"),
        (dict(hidden_size=72, num_attention_heads=4, kv_channels=18), "hidden_size 72 .* multiple of 16"),
    ],
)
def test_models_the_spec_cannot_build_are_refused(model: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        quads_spec_from_args(megatron_args(**model))


# ---- the Transformer Engine path (TE is not installed here) ----


def test_transformer_engine_without_te_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="needs Transformer Engine.*--transformer-impl local"):
        quads_spec_from_args(megatron_args(transformer_impl="transformer_engine", moe_grouped_gemm=True))


class TEGroupedMLP(torch.nn.Module):
    """Stands in for Megatron's TEGroupedMLP class in a spec (only its name is read; nothing is built)."""


@pytest.fixture
def te_spec(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Megatron's TE spec function replaced by a recorder returning a local spec with TEGroupedMLP experts."""
    from megatron.core.models.gpt import gpt_layer_specs

    calls: list[dict] = []

    def fake(**kwargs):
        calls.append(kwargs)
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=kwargs["num_experts"], normalization="RMSNorm")
        spec.submodules.mlp.submodules.experts.module = TEGroupedMLP
        return spec

    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", fake)
    return calls


TE_FLAGS = dict(transformer_impl="transformer_engine", moe_grouped_gemm=True, fp4="e2m1", fp4_recipe="custom",
                fp4_quantizer_factory=ROUTED_EXPERTS_FACTORY)


def test_transformer_engine_spec_is_stock_and_the_flags_are_what_apply_quads_sets(te_spec: list[dict]) -> None:
    args = megatron_args(**TE_FLAGS)
    spec = quads_spec_from_args(args)
    assert te_spec[-1]["num_experts"] == 4 and te_spec[-1]["moe_grouped_gemm"] is True
    config = build_transformer_config(PolicyModelConfig(**TINY), ParallelConfig())
    new_config, expected = apply_quads(config, spec, QuadsTrainerConfig())
    assert expected is spec, "apply_quads keeps a TE spec"
    # Megatron-LM copies these arguments into its TransformerConfig: they are apply_quads' overrides
    assert (new_config.fp4, new_config.fp4_recipe, new_config.fp4_quantizer_factory) == (
        args.fp4, args.fp4_recipe, args.fp4_quantizer_factory)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (dict(fp4=None), r"add: --fp4-format e2m1 --fp4-recipe custom --fp4-quantizer-factory "
                         r"megatron_quads\.trainer\.te_recipe\.quads_routed_experts_qfactory \(found --fp4-format=None\)"),
        (dict(fp4_recipe="nvfp4"), "found --fp4-recipe=nvfp4"),
        (dict(fp4_quantizer_factory="mine.factory"), "found --fp4-quantizer-factory=mine.factory"),
        (dict(moe_grouped_gemm=False), "only as TEGroupedMLP: pass --moe-grouped-gemm"),
        (dict(moe_use_legacy_grouped_gemm=True), "without --moe-use-legacy-grouped-gemm"),
    ],
)
def test_transformer_engine_flags_are_checked(te_spec: list[dict], changes: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        quads_spec_from_args(megatron_args(**{**TE_FLAGS, **changes}))


def test_transformer_engine_all_linears_needs_its_factory_and_scopes_te_lacks_are_refused(te_spec: list[dict]) -> None:
    all_linears = megatron_args(["--quads-scope", "all_linears"], **TE_FLAGS)
    with pytest.raises(ValueError, match="quads_all_linears_qfactory"):
        quads_spec_from_args(all_linears)
    with pytest.raises(ValueError, match="'experts' is not available on the Transformer Engine path.*--quads-scope"):
        quads_spec_from_args(megatron_args(["--quads-scope", "experts"], **TE_FLAGS))
    with pytest.raises(ValueError, match="block_2d=True is not available on the TE path"):
        quads_spec_from_args(megatron_args(["--quads-block-layout", "16x16"], **TE_FLAGS))


# ---- the --spec module ----


def test_spec_module_outside_megatron_lm_fails_with_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an ImportError: Megatron-LM's --spec loader would swallow that into a None spec."""
    monkeypatch.delitem(sys.modules, "megatron_quads.megatron_lm.layer_spec", raising=False)
    with pytest.raises(MegatronLMUnavailable, match="needs Megatron-LM's training package") as info:
        importlib.import_module("megatron_quads.megatron_lm.layer_spec")
    assert not isinstance(info.value, ImportError)


def test_spec_module_builds_the_spec_from_get_args(monkeypatch: pytest.MonkeyPatch) -> None:
    args = megatron_args(["--quads-scope", "experts"])
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.delitem(sys.modules, "megatron_quads.megatron_lm.layer_spec", raising=False)
    module = importlib.import_module(SPEC[0])
    monkeypatch.delitem(sys.modules, SPEC[0])
    # what Megatron-LM's gpt_builder does with --spec at core_v0.16.1: import_module(args.spec)
    from megatron.core.transformer.spec_utils import import_module

    assert import_module(SPEC) == getattr(module, SPEC[1]) == quads_spec_from_args(args)


# ---- the launcher ----


def test_launcher_refuses_another_spec_while_quads_is_on() -> None:
    launcher.check_spec_arg(argparse.Namespace(quads=True, spec=list(SPEC)))
    launcher.check_spec_arg(argparse.Namespace(quads=False, spec=["local"]))
    with pytest.raises(ValueError, match="--spec my.mod my_spec replaces the QUADS layer spec.*--no-quads"):
        launcher.check_spec_arg(argparse.Namespace(quads=True, spec=["my.mod", "my_spec"]))


def test_launcher_without_megatron_lm_says_where_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pretrain_gpt", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "pretrain_gpt.py").exists()])
    with pytest.raises(SystemExit, match="cannot import Megatron-LM's pretrain_gpt.py .* root of a Megatron-LM checkout"):
        launcher.main()


def test_launcher_calls_pretrain_as_the_script_does_plus_quads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call pretrain_gpt.py's __main__ makes (core_v0.16.1), with the QUADS provider and --spec default."""
    calls: dict = {}
    script = types.ModuleType("pretrain_gpt")
    script.set_startup_timestamps = lambda **kw: calls.setdefault("timestamps", kw)
    script.train_valid_test_datasets_provider = lambda *a: None
    script.forward_step = object()
    script.get_embedding_ranks = object()
    script.ModelType = types.SimpleNamespace(encoder_or_decoder="encoder_or_decoder")
    script.has_nvidia_modelopt = True
    script.add_modelopt_args = lambda parser: (parser.add_argument("--modelopt-flag"), parser)[1]
    script.gpt_builder = lambda args, *a, **kw: ("built", args.spec)
    script.model_provider = lambda builder, pre_process=True, post_process=True, vp_stage=None, config=None, \
        pg_collection=None: builder(calls["args"], pre_process, post_process, vp_stage, config=config)
    script.pretrain = lambda *a, **kw: calls.update(positional=a, keywords=kw)
    script.inprocess_restart = types.SimpleNamespace(maybe_wrap_for_inprocess_restart=lambda fn: (fn, "store"))
    monkeypatch.setitem(sys.modules, "pretrain_gpt", script)
    launcher.main()
    datasets, model_provider, model_type, forward_step = calls["positional"]
    kw = calls["keywords"]
    assert datasets.is_distributed is True and model_type == "encoder_or_decoder" and forward_step is script.forward_step
    assert kw["args_defaults"] == {"tokenizer_type": "GPT2BPETokenizer", "spec": list(SPEC)}
    assert kw["store"] == "store" and kw["get_embedding_ranks"] is script.get_embedding_ranks
    parsed = kw["extra_args_provider"](argparse.ArgumentParser()).parse_args(["--quads-scope", "experts", "--modelopt-flag", "x"])
    assert (parsed.quads_scope, parsed.modelopt_flag) == ("experts", "x")
    calls["args"] = argparse.Namespace(quads=True, spec=list(SPEC))
    assert model_provider() == ("built", list(SPEC))
    calls["args"] = argparse.Namespace(quads=True, spec=["other", "spec"])
    with pytest.raises(ValueError, match="replaces the QUADS layer spec"):
        model_provider()


# ---- a Megatron-LM checkpoint's recorded arguments ----

LM_ARGS = dict(  # what Megatron-LM records for a Qwen3-MoE-like run of TINY
    num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    kv_channels=16, ffn_hidden_size=256, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
    moe_shared_expert_intermediate_size=None, padded_vocab_size=32, max_position_embeddings=64, qk_layernorm=True,
    rotary_base=10000, norm_epsilon=1e-6, moe_router_pre_softmax=False, untie_embeddings_and_output_weights=True,
    bf16=False, fp16=False, init_method_std=0.02, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
    add_qkv_bias=False, position_embedding_type="rope", rotary_percent=1.0, use_rope_scaling=False,
    rotary_interleaved=False, multi_latent_attention=False, qk_l2_norm=False, apply_layernorm_1p=False,
    moe_layer_freq=1, moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
    moe_router_topk_scaling_factor=None, moe_router_num_groups=None, mtp_num_layers=None,
    params_dtype=torch.float32, quads=True, quads_scope="routed_experts", quads_block_layout="1x16",
    quads_rac_ratio=0.25,
)


def test_model_config_from_recorded_args() -> None:
    model = model_config_from_megatron_lm_args(argparse.Namespace(**LM_ARGS))
    assert model == PolicyModelConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256, num_experts=4,
        moe_ffn_hidden_size=32, moe_router_topk=2, vocab_size=32, max_sequence_length=64, rms_norm_eps=1e-6,
        untie_embeddings=True, dtype="fp32",
    )
    assert model_config_from_megatron_lm_args(argparse.Namespace(**{**LM_ARGS, "moe_router_pre_softmax": True,
                                                                     "bf16": True})).norm_topk_prob is False


def test_recorded_args_without_a_qwen3_moe_counterpart_are_refused() -> None:
    bad = argparse.Namespace(**{**LM_ARGS, "swiglu": False, "add_bias_linear": True, "moe_layer_freq": [0, 1, 1, 1],
                                "moe_router_score_function": "sigmoid"})
    with pytest.raises(ValueError, match=r"no Qwen3-MoE counterpart.*no --swiglu.*linear biases.*--moe-layer-freq "
                                         r"\[0, 1, 1, 1\].*--moe-router-score-function sigmoid"):
        model_config_from_megatron_lm_args(bad)


def _save_megatron_lm_checkpoint(directory: Path, args: argparse.Namespace) -> torch.nn.Module:
    """A dist checkpoint laid out as Megatron-LM's torch_dist save writes it: the model's sharded state
    dict under 'model', the arguments, version and iteration as common state."""
    from megatron.core import dist_checkpointing

    model = build_gpt_model(model_config_from_megatron_lm_args(args), ParallelConfig(),
                            layer_spec=quads_spec_from_args(megatron_args(**MODEL_ARGS)))
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 2}
    directory.mkdir()
    dist_checkpointing.save(state, str(directory))
    return model


def test_megatron_lm_checkpoint_converts_without_model_config(tmp_path: Path) -> None:
    from megatron_quads.convert.commands import megatron_to_hf
    from megatron_quads.convert.to_quads import to_quads
    from megatron_quads.trainer.hf_export import export_hf_weights

    args = argparse.Namespace(**LM_ARGS)
    ckpt = tmp_path / "iter_0000002"
    model = _save_megatron_lm_checkpoint(ckpt, args)
    assert not (ckpt / "model_config.json").exists()
    assert vars(read_megatron_lm_args(ckpt)) == vars(args) and recorded_rac_ratio(ckpt) == 0.25

    from safetensors.torch import load_file

    hf = megatron_to_hf(ckpt, tmp_path / "hf", progress=False)
    exported = load_file(str(next(hf.glob("*.safetensors"))))
    for name, tensor in export_hf_weights(model):
        assert torch.equal(exported[name], tensor), name

    out = to_quads(ckpt, tmp_path / "quads", None, calibration_prompts=4, tokenizer="char", progress=False)
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quads"]["ratio"] == 0.25, "the ratio the run recorded (--quads-rac-ratio)"


def test_a_megatron_lm_checkpoint_whose_pickles_would_run_code_is_refused(tmp_path: Path) -> None:
    """Its recorded arguments (``common.pt``) and its ``.metadata`` are both read through the audit:
    neither runs, and the refusal names the file."""
    from megatron.core import dist_checkpointing

    from megatron_quads.convert.to_quads import to_quads
    from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError
    from pickle_payloads import OpensAFile, poison_dcp_metadata

    marker = tmp_path / "ran"
    ckpt = tmp_path / "iter_0000002"
    _save_megatron_lm_checkpoint(ckpt, argparse.Namespace(**LM_ARGS))
    metadata = poison_dcp_metadata(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"{metadata}: its metadata pickle"):
        to_quads(ckpt, tmp_path / "out", None, tokenizer="char", progress=False)
    evil = tmp_path / "evil_args"
    evil.mkdir()
    dist_checkpointing.save({"args": argparse.Namespace(**LM_ARGS, hook=OpensAFile(marker))}, str(evil))
    with pytest.raises(UnsafeCheckpointError, match=r"evil_args/common\.pt: Megatron-LM's common state is not plain data"):
        read_megatron_lm_args(evil)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_to_quads_without_ratio_needs_a_recorded_one(tmp_path: Path) -> None:
    from megatron_quads.convert.to_quads import to_quads

    args = argparse.Namespace(**{**LM_ARGS, "quads_rac_ratio": None})
    _save_megatron_lm_checkpoint(tmp_path / "ckpt", args)
    with pytest.raises(ValueError, match="--ratio is required: .* records no --quads-rac-ratio"):
        to_quads(tmp_path / "ckpt", tmp_path / "out", None, tokenizer="char", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_to_quads_without_ratio_on_a_source_without_one_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_quads.cli import main

    assert main(["convert", "to-quads", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert "--ratio is required" in capsys.readouterr().err
