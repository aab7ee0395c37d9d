"""The NVFP4-plus-residual weight representation: in memory, on disk, and as ModelOpt reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_quads.nvfp4 import (
    compute_global_amax,
    decode_scale_from_amax,
    dequantize,
    quantize,
)
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quant_config import make_quant_config
from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.quantized_checkpoint import (
    load_quantized_weights,
    require_finite_unquantized_files,
    save_quantized_weights,
)
from megatron_quads.rollout.quantized_linear import QuantizedLinearWeight, reblocking_error
from megatron_quads.rollout.scopes import routed_expert_scope

H, I, E, LAYERS = 64, 32, 3, 3  # hidden, expert ffn, experts per layer, layers (layer 0 stays bf16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _random_channels(k: int, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(k, generator=g)[:count].sort().values.to(torch.int32)


def _hf_tensors(attention_in_scope: bool = False) -> list[tuple[str, torch.Tensor]]:
    """A tiny Qwen3-MoE-named model: embeddings, attention, router, experts, norms, lm_head."""
    g = torch.Generator().manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    out = [("model.embed_tokens.weight", rnd(96, H))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)),
            (f"{p}.self_attn.q_proj.weight", rnd(H, H)),
            (f"{p}.self_attn.k_proj.weight", rnd(H // 2, H, scale=2.0)),
            (f"{p}.self_attn.v_proj.weight", rnd(H // 2, H, scale=0.5)),
            (f"{p}.self_attn.o_proj.weight", rnd(H, H)),
            (f"{p}.post_attention_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)),
            (f"{p}.mlp.gate.weight", rnd(E, H)),
        ]
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            out += [
                (f"{q}.gate_proj.weight", rnd(I, H)),
                (f"{q}.up_proj.weight", rnd(I, H, scale=3.0)),  # a different amax than gate
                (f"{q}.down_proj.weight", rnd(H, I)),
            ]
    out += [("model.norm.weight", torch.ones(H, dtype=torch.bfloat16)), ("lm_head.weight", rnd(96, H))]
    return out


def _scope(attention: bool = False):
    experts = routed_expert_scope(bf16_layers=[0])
    if not attention:
        return experts
    return lambda m: experts(m) or (".self_attn." in m and not m.startswith("model.layers.0."))


def _model(static_input_scales: bool = True) -> QuantizedModelWeights:
    tensors = _hf_tensors()
    scope = _scope()
    modules = [n[: -len(".weight")] for n, _ in tensors if n.endswith(".weight") and scope(n[: -len(".weight")])]
    channels = {}
    for i, m in enumerate(modules):
        k = H if not m.endswith("down_proj") else I
        count = [0, 16, k // 2, k][i % 4]  # empty, one block, half, all
        channels[m] = _random_channels(k, count, seed=i)
    amax = {m: 1.0 + i for i, m in enumerate(modules)} if static_input_scales else None
    return quantize_hf_weights(tensors, scope, channels, 0.25, input_amax=amax, weight_version=7)


@pytest.fixture(scope="module")
def model() -> QuantizedModelWeights:
    return _model()


# --------------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("max_shard_bytes", [fmt.DEFAULT_MAX_SHARD_BYTES, 3000])
def test_round_trip_is_byte_exact(model: QuantizedModelWeights, tmp_path: Path, max_shard_bytes: int) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt", max_shard_bytes, model_config={"model_type": "qwen3_moe"})
    sharded = max_shard_bytes < fmt.DEFAULT_MAX_SHARD_BYTES
    assert (out / fmt.INDEX_FILE).is_file() == sharded
    assert (out / fmt.SINGLE_FILE).is_file() == (not sharded)
    if sharded:
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"

    loaded = load_quantized_weights(out, verify_residual=True)
    before, after = model.state_dict(), loaded.state_dict()
    assert list(before) == list(after) or set(before) == set(after)
    for name, t in before.items():
        assert _same(t, after[name]), name
    assert loaded.config == model.config
    assert loaded.config["weight_version"] == 7 and loaded.config["residual_ratio"] == 0.25

    cfg = json.loads((out / fmt.MODEL_CONFIG_FILE).read_text())
    block = cfg["quantization_config"]
    assert cfg["model_type"] == "qwen3_moe"
    assert (block["quant_method"], block["quant_algo"], block["group_size"]) == ("modelopt", "NVFP4", 16)
    assert block["quads"]["residual_channels_key"] == "residual_channels" and block["quads"]["version"] == 1
    assert "model.layers.0.mlp.experts" in block["exclude_modules"] and "lm_head" in block["ignore"]


def test_exclude_modules_cover_everything_unquantized(model: QuantizedModelWeights) -> None:
    excl = model.config["exclude_modules"]
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.experts", "model.layers.1.mlp.gate"} <= set(excl)
    assert "model.layers.1.self_attn.q_proj" in excl
    assert not any(".experts." in e for e in excl)  # one entry per fused MoE layer, not per expert
    assert all(m.startswith(("model.layers.1.", "model.layers.2.")) for m in model.quantized)
    assert len(model.quantized) == 2 * E * 3


def test_overwrite_and_no_partial_files(model: QuantizedModelWeights, tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "ckpt"
    save_quantized_weights(model, target, 3000)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_quantized_weights(model, target)

    calls = {"n": 0}
    real_save = fmt.save_file

    def crash_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(fmt, "save_file", crash_on_third)
    with pytest.raises(OSError, match="simulated"):
        save_quantized_weights(model, target, 3000, overwrite=True)
    calls["n"] = 0
    with pytest.raises(OSError, match="simulated"):
        save_quantized_weights(model, tmp_path / "fresh", 3000)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or half-written directory
    monkeypatch.undo()
    load_quantized_weights(target)  # the previous checkpoint is intact

    smaller = QuantizedModelWeights(quantized={}, unquantized={"x.weight": torch.ones(2, 2, dtype=torch.bfloat16)})
    save_quantized_weights(smaller, target, overwrite=True)
    assert set(load_quantized_weights(target).state_dict()) == {"x.weight"}
    assert sorted(p.name for p in target.iterdir()) == [fmt.QUANT_CONFIG_FILE, fmt.SINGLE_FILE]


def test_finish_runs_on_the_complete_directory_before_it_appears(model: QuantizedModelWeights, tmp_path: Path) -> None:
    seen = []

    def finish(tmp: Path) -> None:
        assert not (tmp_path / "ckpt").exists()
        seen.append(sorted(p.name for p in tmp.iterdir()))
        (tmp / "extra.txt").write_text("added before the rename")

    save_quantized_weights(model, tmp_path / "ckpt", finish=finish)
    assert seen == [[fmt.QUANT_CONFIG_FILE, fmt.SINGLE_FILE]]
    assert (tmp_path / "ckpt" / "extra.txt").read_text() == "added before the rename"

    def fail(tmp: Path) -> None:
        raise OSError("finish failed (simulated)")

    with pytest.raises(OSError, match="simulated"):
        save_quantized_weights(model, tmp_path / "other", finish=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_with_input_amax_sets_or_drops_static_scales(model: QuantizedModelWeights) -> None:
    amax = {m: 2688.0 * (i + 1) for i, m in enumerate(model.quantized)}
    scaled = model.with_input_amax(amax)
    assert [float(lin.input_scale) for lin in scaled.quantized.values()] == [float(i + 1) for i in range(len(amax))]
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(scaled.quantized.values(), model.quantized.values()))
    assert not model.with_input_amax(None).input_scales
    first = next(iter(model.quantized))
    with pytest.raises(ValueError, match="input_amax has no entry for quantized module"):
        model.with_input_amax({first: 1.0})
    with pytest.raises(ValueError, match=f"{first}: activation amax must be one finite value > 0"):
        model.with_input_amax({**amax, first: 0.0})


# --------------------------------------------------------------------------------------------------
# damaged checkpoints


def _file_of(directory: Path, name: str) -> Path:
    index = directory / fmt.INDEX_FILE
    if index.is_file():
        return directory / json.loads(index.read_text())["weight_map"][name]
    return directory / fmt.SINGLE_FILE


def _rewrite(directory: Path, name: str, new: torch.Tensor | None) -> None:
    """Replace (or, with None, delete) one tensor inside its safetensors file."""
    path = _file_of(directory, name)
    tensors = load_file(str(path))
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new
    save_file(tensors, str(path), metadata={"format": "pt"})


EXPERT = "model.layers.1.mlp.experts.0.up_proj"  # second in scope order: 16 residual channels


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    "leaf, make_bad",
    [
        ("weight_scale", lambda t: t[:, :-1].contiguous()),
        ("weight", lambda t: t[:-1].contiguous()),
        ("residual_weight", lambda t: t[:, :-1].contiguous()),
        ("residual_weight_scale", lambda t: torch.cat([t, t], dim=1)),
        ("residual_channels", lambda t: t[:-1].contiguous()),
        ("weight_scale_2", lambda t: t.reshape(1)),
        ("input_scale", lambda t: t.to(torch.float16)),
        ("weight_scale", lambda t: t.view(torch.uint8)),
    ],
)
def test_wrong_shape_or_dtype_names_the_tensor(model, tmp_path: Path, sharded: bool, leaf: str, make_bad) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt", 3000 if sharded else fmt.DEFAULT_MAX_SHARD_BYTES)
    name = f"{EXPERT}.{leaf}"
    _rewrite(out, name, make_bad(model.state_dict()[name]))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_quantized_weights(out)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("leaf", ["weight", "weight_scale", "weight_scale_2", "input_scale", "residual_weight_scale"])
def test_missing_tensor_names_it(model, tmp_path: Path, sharded: bool, leaf: str) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt", 3000 if sharded else fmt.DEFAULT_MAX_SHARD_BYTES)
    name = f"{EXPERT}.{leaf}"
    _rewrite(out, name, None)
    if sharded:  # the index still lists it
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            load_quantized_weights(out)
        index = json.loads((out / fmt.INDEX_FILE).read_text())
        del index["weight_map"][name]
        (out / fmt.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_quantized_weights(out)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_an_unquantized_tensor_names_it_and_its_file(model, tmp_path: Path, sharded: bool, bad: float) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt", 3000 if sharded else fmt.DEFAULT_MAX_SHARD_BYTES)
    name = next(n for n in model.unquantized if n.endswith("norm.weight"))
    damaged = model.state_dict()[name].clone()
    damaged[1] = bad
    _rewrite(out, name, damaged)
    file = _file_of(out, name)
    with pytest.raises(ValueError, match=rf"'{name}' in {file} holds 1 NaN or Inf".replace(".", r"\.")):
        load_quantized_weights(out)


def test_missing_module_unknown_dtype_and_bad_config(model, tmp_path: Path) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt")
    for leaf in (*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES):
        _rewrite(out, f"{EXPERT}.{leaf}", None)
    with pytest.raises(ValueError, match="num_quantized_modules"):
        load_quantized_weights(out)

    out = save_quantized_weights(model, tmp_path / "ckpt2")
    _rewrite(out, "model.norm.weight", torch.ones(H, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*int64"):
        load_quantized_weights(out)

    out = save_quantized_weights(model, tmp_path / "ckpt3")
    doc = json.loads((out / fmt.QUANT_CONFIG_FILE).read_text())
    doc["quads"]["version"] = 99
    (out / fmt.QUANT_CONFIG_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="quads.version"):
        load_quantized_weights(out)
    del doc["quantization"]["group_size"]
    (out / fmt.QUANT_CONFIG_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="group_size"):
        load_quantized_weights(out)


def test_a_zero_weight_scale_2_beside_non_zero_block_scales_fails_to_load(model, tmp_path: Path) -> None:
    """It would decode the weight to zeros; an all-zero weight (block scales all 0) keeps its 0."""
    out = save_quantized_weights(model, tmp_path / "ckpt")
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_2"
    _rewrite(out, name, torch.zeros((), dtype=torch.float32))
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale_2 is 0 but .*down_proj\.weight_scale holds non-zero"):
        load_quantized_weights(out)
    zero = QuantizedLinearWeight.from_weight(torch.zeros(16, 32))
    assert float(zero.weight_scale_2) == 0.0 and not zero.weight_scale.view(torch.uint8).any()


def test_config_json_that_contradicts_hf_quant_config_fails_to_load(model, tmp_path: Path) -> None:
    for key, value, message in (("quant_algo", "FP8", r"quant_algo = 'FP8' but .*quant_algo = 'NVFP4'"),
                                ("exclude_modules", ["lm_head"], r"quantization_config\.exclude_modules = \['lm_head'\]")):
        out = save_quantized_weights(model, tmp_path / key, model_config={"model_type": "qwen3_moe"})
        doc = json.loads((out / fmt.MODEL_CONFIG_FILE).read_text())
        doc["quantization_config"][key] = value
        (out / fmt.MODEL_CONFIG_FILE).write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=rf"{out / fmt.MODEL_CONFIG_FILE} says .*{message}.*re-export"):
            load_quantized_weights(out)


def test_the_unquantized_tensors_of_the_files_are_checked_one_at_a_time(model, tmp_path: Path) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt", 3000)
    assert require_finite_unquantized_files(out) == len(model.unquantized)
    name = next(n for n in model.unquantized if n.endswith("embed_tokens.weight"))
    damaged = model.state_dict()[name].clone()
    damaged[2, 3] = float("-inf")
    _rewrite(out, name, damaged)
    with pytest.raises(ValueError, match=rf"'{name}' in {_file_of(out, name)} holds 1 NaN or Inf".replace(".", r"\.")):
        require_finite_unquantized_files(out)


def test_gate_up_with_different_weight_scale_2_fails_to_load(model, tmp_path: Path) -> None:
    out = save_quantized_weights(model, tmp_path / "ckpt")
    name = "model.layers.2.mlp.experts.0.up_proj.weight_scale_2"
    _rewrite(out, name, model.state_dict()[name] * 2)
    with pytest.raises(ValueError, match="weight_scale_2.*one global_amax"):
        load_quantized_weights(out)


# --------------------------------------------------------------------------------------------------
# the residual weight W_S


def test_w_s_equals_q_w_at_full_ratio() -> None:
    w = torch.randn(48, 128, dtype=torch.bfloat16)
    for amax in (None, 3 * float(w.abs().max())):
        q = quantize(w, global_amax=amax)
        lin = QuantizedLinearWeight.from_weight(w, torch.arange(128), global_amax=amax)
        assert _same(lin.weight, q.codes) and _same(lin.weight_scale, q.scales)
        assert _same(lin.residual_weight, lin.weight) and _same(lin.residual_weight_scale, lin.weight_scale)
        assert reblocking_error(lin) == 0.0


def test_whole_blocks_are_copied_even_where_requantizing_would_change_them() -> None:
    # a block with a subnormal e4m3 scale (2 * 2^-9): its largest code is 4, and quantizing its own
    # dequantized values again picks scale 2^-9 and saturates the 8 * 2^-9 entries to 6 * 2^-9
    w = torch.zeros(1, 48)
    w[0, 0] = 2688.0  # amax 2688: weight_scale_2 = 1
    w[0, 16:32] = torch.linspace(-1, 1, 16) * 0.01875
    lin = QuantizedLinearWeight.from_weight(w, torch.arange(16, 48))
    dq = lin.dequantized_weight(torch.float32)
    assert not torch.equal(dequantize(quantize(dq[:, 16:32], global_amax=2688.0), torch.float32), dq[:, 16:32])
    assert torch.equal(lin.dequantized_residual_weight(torch.float32), dq[:, 16:48])
    assert _same(lin.residual_weight, lin.weight[:, 8:24])


def test_unaligned_blocks_are_requantized_with_the_weight_global_scale() -> None:
    w = torch.randn(32, 256)
    rest = 16 + _random_channels(240, 48, 3)  # unaligned channels from the other 15 blocks
    channels = torch.cat([torch.arange(16, dtype=torch.int32), rest])
    lin = QuantizedLinearWeight.from_weight(w, channels)
    gathered = lin.dequantized_weight(torch.float32)[:, channels.long()]
    expected = dequantize(quantize(gathered, global_amax=compute_global_amax(w)), torch.float32)
    got = lin.dequantized_residual_weight(torch.float32)
    assert torch.equal(got[:, :16], gathered[:, :16])  # channels 0..15: a whole block, copied
    assert torch.equal(got, expected)  # the rest is nvfp4.quantize of the gathered columns
    assert 0.0 < reblocking_error(lin) < 0.2
    assert torch.equal(lin.to_nvfp4().weight_scale_2, lin.residual_to_nvfp4().weight_scale_2)


def test_with_residual_channels_keeps_main_codes_and_matches_from_weight() -> None:
    w = torch.randn(40, 128, dtype=torch.bfloat16)
    lin = QuantizedLinearWeight.from_weight(w, None, input_scale=0.5)
    assert lin.residual_to_nvfp4() is None and lin.dequantized_residual_weight().shape == (40, 0)
    channels = _random_channels(128, 32, 0)
    updated = lin.with_residual_channels(channels)
    for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        assert _same(getattr(updated, leaf), getattr(lin, leaf)), leaf
    fresh = QuantizedLinearWeight.from_weight(w, channels, input_scale=0.5)
    assert _same(updated.residual_weight, fresh.residual_weight)
    assert _same(updated.residual_weight_scale, fresh.residual_weight_scale)
    assert _same(updated.with_residual_channels(None).residual_channels, torch.zeros(0, dtype=torch.int32))


def test_model_with_residual_channels_refreshes_only_named_modules(model: QuantizedModelWeights) -> None:
    module = EXPERT
    k = model.quantized[module].in_features
    refreshed = model.with_residual_channels({module: _random_channels(k, 32, 9)}, weight_version=8)
    assert refreshed.config["weight_version"] == 8 and model.config["weight_version"] == 7
    assert refreshed.quantized[module].num_residual_channels == 32
    assert _same(refreshed.quantized[module].weight, model.quantized[module].weight)
    other = next(m for m in model.quantized if m != module)
    assert refreshed.quantized[other] is model.quantized[other]
    with pytest.raises(ValueError, match="not quantized"):
        model.with_residual_channels({"model.layers.0.mlp.experts.0.up_proj": []})


# --------------------------------------------------------------------------------------------------
# shared global scales


def test_gate_up_and_qkv_share_weight_scale_2() -> None:
    tensors = dict(_hf_tensors())
    weights = quantize_hf_weights(_hf_tensors(), _scope(attention=True), None, 0.0)
    for layer in (1, 2):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            gate, up = tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"]
            amax = torch.maximum(compute_global_amax(gate), compute_global_amax(up))
            g, u = weights.quantized[f"{p}.gate_proj"], weights.quantized[f"{p}.up_proj"]
            assert _same(g.weight_scale_2, u.weight_scale_2)
            assert torch.equal(g.weight_scale_2, decode_scale_from_amax(amax))
            # quantizing each half with the shared amax is quantizing the fused w13
            fused = quantize(torch.cat([gate, up]))
            assert _same(torch.cat([g.weight, u.weight]), fused.codes)
            assert _same(torch.cat([g.weight_scale, u.weight_scale]), fused.scales)
            assert not torch.equal(weights.quantized[f"{p}.down_proj"].weight_scale_2, g.weight_scale_2)
        a = f"model.layers.{layer}.self_attn"
        scales = [weights.quantized[f"{a}.{x}_proj"].weight_scale_2 for x in "qkv"]
        assert all(_same(s, scales[0]) for s in scales)
        assert not torch.equal(weights.quantized[f"{a}.o_proj"].weight_scale_2, scales[0])
    assert "model.layers.1.self_attn.q_proj" not in weights.config["exclude_modules"]


def test_scope_must_keep_fused_siblings_and_experts_together() -> None:
    with pytest.raises(ValueError, match="fused sibling"):
        quantize_hf_weights(_hf_tensors(), lambda m: m.endswith("experts.0.gate_proj"), None)
    with pytest.raises(ValueError, match="same MoE layer"):
        quantize_hf_weights(_hf_tensors(), lambda m: m.endswith("experts.0.down_proj"), None)
    with pytest.raises(ValueError, match="not a 2-D floating-point linear weight"):
        quantize_hf_weights(_hf_tensors(), lambda m: m.endswith("layernorm"), None)
    modules = {"model.layers.1.mlp.experts.0.down_proj": None}
    with pytest.raises(ValueError, match="no entry for quantized module"):
        quantize_hf_weights(_hf_tensors(), routed_expert_scope([0]), modules)


# --------------------------------------------------------------------------------------------------
# an independent reader: ModelOpt


def test_modelopt_dequantizes_the_modelopt_named_subset(model, tmp_path: Path) -> None:
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    out = save_quantized_weights(model, tmp_path / "plain", include_residual=False)
    with safe_open(str(out / fmt.SINGLE_FILE), framework="pt") as f:
        names = list(f.keys())
        assert not [n for n in names if fmt.split_tensor_name(n)[1] in fmt.RESIDUAL_LEAVES]
        tensors = {n: f.get_tensor(n) for n in names}
    checked = 0
    for module, lin in model.quantized.items():
        codes, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
        scale_2, input_scale = tensors[f"{module}.weight_scale_2"], tensors[f"{module}.input_scale"]
        n, k = lin.out_features, lin.in_features
        assert (codes.dtype, tuple(codes.shape)) == (torch.uint8, (n, k // 2))
        assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (n, k // 16))
        assert (scale_2.dtype, scale_2.shape, input_scale.dtype, input_scale.shape) == (
            torch.float32, torch.Size([]), torch.float32, torch.Size([]))
        qtensor = nvfp4_tensor.NVFP4QTensor(torch.Size((n, k)), torch.float32, codes)
        theirs = qtensor.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
        assert torch.allclose(theirs, lin.dequantized_weight(torch.float32), rtol=2**-22, atol=0), module
        if lin.num_residual_channels:  # W_S is a plain NVFP4 tensor too
            rq = nvfp4_tensor.NVFP4QTensor(torch.Size((n, lin.num_residual_channels)), torch.float32, lin.residual_weight)
            theirs = rq.dequantize(dtype=torch.float32, scale=lin.residual_weight_scale, double_scale=scale_2, block_sizes={-1: 16})
            assert torch.allclose(theirs, lin.dequantized_residual_weight(torch.float32), rtol=2**-22, atol=0)
        checked += 1
    assert checked == len(model.quantized)
    loaded = load_quantized_weights(out)
    assert all(lin.num_residual_channels == 0 for lin in loaded.quantized.values())


# --------------------------------------------------------------------------------------------------
# invalid inputs


@pytest.mark.parametrize(
    "channels, message",
    [
        ([*range(15), 20, 17, *range(21, 36)], "not sorted ascending: channel 17 at position 16 follows 20"),
        ([*range(15), 14, *range(16, 32)], "repeats channel 14"),
        ([*range(16, 31), 64], r"\[15\] = 64 is outside \[0, K=64\)"),
        ([-1, *range(1, 16)], r"\[0\] = -1 is outside"),
        (list(range(20)), "holds 20 channels; the count must be a multiple of 16"),
        (torch.arange(16, dtype=torch.float32), "integer tensor"),
        (torch.arange(32).reshape(2, 16), "1-D"),
    ],
)
def test_invalid_residual_channels_raise(channels, message: str) -> None:
    lin = QuantizedLinearWeight.from_weight(torch.randn(8, 64))
    with pytest.raises(ValueError, match=message):
        lin.with_residual_channels(channels)
    with pytest.raises(ValueError, match=message):
        QuantizedLinearWeight.from_weight(torch.randn(8, 64), channels)


def test_inconsistent_fields_raise_naming_field_and_shapes() -> None:
    lin = QuantizedLinearWeight.from_weight(torch.randn(8, 64), torch.arange(16))
    fields = {k: getattr(lin, k) for k in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    fields |= {k: getattr(lin, k) for k in ("residual_channels", "residual_weight", "residual_weight_scale")}
    cases = {
        "weight_scale": (lin.weight_scale[:, :3], r"weight_scale has shape \(8, 3\); expected \(8, 4\)"),
        "residual_weight": (lin.residual_weight[:4], r"residual_weight has shape \(4, 8\); expected \(8, 8\)"),
        "residual_weight_scale": (lin.residual_weight_scale.float(), "residual_weight_scale has dtype torch.float32"),
        "residual_channels": (lin.residual_channels.long(), "residual_channels has dtype torch.int64"),
        "weight_scale_2": (torch.tensor([1.0]), r"weight_scale_2 has shape \(1,\)"),
        "input_scale": (torch.tensor(-1.0), "input_scale is -1.0; expected a finite value > 0"),
        "weight": (lin.weight[:, :5], r"weight has shape \(8, 5\)"),
    }
    for key, (bad, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            QuantizedLinearWeight(**{**fields, key: bad})
    nan_scale = lin.weight_scale.view(torch.uint8).clone()
    nan_scale[0, 0] = 0x7F
    with pytest.raises(ValueError, match="weight_scale holds 1 negative or NaN"):
        QuantizedLinearWeight(**{**fields, "weight_scale": nan_scale.view(torch.float8_e4m3fn)})


def test_container_rejects_bad_config_names_and_mixed_input_scales() -> None:
    a = QuantizedLinearWeight.from_weight(torch.randn(8, 64), input_scale=1.0)
    b = QuantizedLinearWeight.from_weight(torch.randn(8, 64))
    with pytest.raises(ValueError, match="has an input_scale but"):
        QuantizedModelWeights(quantized={"m.a": a, "m.b": b})
    with pytest.raises(ValueError, match="unknown keys"):
        QuantizedModelWeights(quantized={"m.b": b}, config={**make_quant_config(), "ratio": 0.5})
    with pytest.raises(ValueError, match="residual_ratio"):
        make_quant_config(residual_ratio=1.5)
    with pytest.raises(ValueError, match="exclude_modules entry 'm'"):
        QuantizedModelWeights(quantized={"m.b": b}, config=make_quant_config(exclude_modules=["m"]))
    with pytest.raises(ValueError, match="collides"):
        QuantizedModelWeights(quantized={"m.b": b}, unquantized={"m.b.weight": torch.ones(2, dtype=torch.bfloat16)})
