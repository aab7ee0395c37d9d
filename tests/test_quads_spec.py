"""QUADS layer specs on Megatron-Core (one process, gloo, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_quads.nvfp4 import quantize_dequantize
from megatron_quads.trainer.expert_linears import (
    FakeQuantColumnParallelLinear,
    FakeQuantRowParallelLinear,
)
from megatron_quads.trainer.fake_quant import invalidate_fake_quant_caches
from megatron_quads.trainer.model import (
    ParallelConfig,
    PolicyModelConfig,
    build_gpt_model,
    stock_layer_spec,
)
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig
from megatron_quads.trainer.specs import UnsupportedForQuads, quads_layer_spec

TINY = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=32, vocab_size=96)
SEQ = 12


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    from megatron_quads.trainer.cpu_compat import init_distributed_cpu

    init_distributed_cpu(world_size=1, rank=0)


def _tokens(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY["vocab_size"], (batch, SEQ), generator=gen)
    return ids, torch.arange(SEQ).expand(batch, SEQ)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    ids, pos = _tokens()
    return model(ids, pos, attention_mask=None)


def _load_as_grouped(grouped: torch.nn.Module, state: dict) -> None:
    """Load a SequentialMLP model's ``state`` into a legacy GroupedMLP model: per expert fc1 [2F, H] ->
    weight1 [H, E*2F] (Megatron views it as [E, H, 2F]), fc2 [H, F] -> weight2 [E*F, H]."""
    for layer in range(TINY["num_layers"]):
        p = f"decoder.layers.{layer}.mlp.experts"
        fc1 = [state.pop(f"{p}.local_experts.{e}.linear_fc1.weight") for e in range(TINY["num_experts"])]
        fc2 = [state.pop(f"{p}.local_experts.{e}.linear_fc2.weight") for e in range(TINY["num_experts"])]
        state[f"{p}.weight1"] = torch.stack([w.t() for w in fc1]).reshape(TINY["hidden_size"], -1)
        state[f"{p}.weight2"] = torch.stack([w.t() for w in fc2]).reshape(-1, TINY["hidden_size"])
    grouped.load_state_dict(state, strict=False)


def _is_routed_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("weight")


def _reference_model(stock_state: dict, model_cfg: PolicyModelConfig, fake_quant: callable) -> torch.nn.Module:
    ref = build_gpt_model(model_cfg, ParallelConfig())
    ref.load_state_dict({k: fake_quant(k, v) for k, v in stock_state.items()})
    return ref


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_and_grads_equal_stock_model_with_quantized_expert_weights(dtype: str) -> None:
    cfg = PolicyModelConfig(**TINY, dtype=dtype)
    torch.manual_seed(0)
    stock = build_gpt_model(cfg, ParallelConfig())
    quads = build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig())
    state = stock.state_dict()
    quads.load_state_dict(state, strict=True)  # same keys, same shapes
    ref = _reference_model(state, cfg, lambda k, v: quantize_dequantize(v) if _is_routed_expert_weight(k) else v)

    out, out_ref, out_stock = _forward(quads), _forward(ref), _forward(stock)
    assert torch.equal(out, out_ref), "QUADS forward must equal stock forward on dequantize(quantize(W_expert))"
    assert not torch.equal(out, out_stock), "the fake quant must change the output"

    out.float().square().mean().backward()
    out_ref.float().square().mean().backward()
    for (name, p), (_, p_ref) in zip(quads.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {name}"
        # straight-through: d loss / d W equals the reference model's d loss / d dequant(quant(W))
        assert torch.equal(p.grad, p_ref.grad), name


def test_only_routed_experts_change_by_default() -> None:
    model = build_gpt_model(PolicyModelConfig(**TINY, moe_shared_expert_size=32), ParallelConfig(), QuadsTrainerConfig())
    for name, module in model.named_modules():
        fake = isinstance(module, (FakeQuantColumnParallelLinear, FakeQuantRowParallelLinear))
        assert fake == (".mlp.experts.local_experts." in name and name.endswith(("linear_fc1", "linear_fc2"))), name


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (QuadsScope.EXPERTS, ("experts.local_experts", "shared_experts")),
        (QuadsScope.EXPERTS_AND_ATTENTION, ("experts.local_experts", "shared_experts", "self_attention")),
    ],
)
def test_scopes(scope: QuadsScope, expected: tuple[str, ...]) -> None:
    model = build_gpt_model(
        PolicyModelConfig(**TINY, moe_shared_expert_size=32), ParallelConfig(), QuadsTrainerConfig(scope=scope)
    )
    fake = [n for n, m in model.named_modules() if isinstance(m, (FakeQuantColumnParallelLinear, FakeQuantRowParallelLinear))]
    for part in expected:
        assert any(part in n for n in fake), f"{part} not fake-quantized under {scope}"
    assert not any(n.startswith(("embedding", "output_layer")) or "router" in n for n in fake)


def test_first_and_last_layers_stay_bf16() -> None:
    model = build_gpt_model(
        PolicyModelConfig(**TINY), ParallelConfig(), QuadsTrainerConfig(bf16_first_layers=1, bf16_last_layers=1)
    )
    layers = model.decoder.layers
    kinds = [type(layer.mlp.experts.local_experts[0].linear_fc1).__name__ for layer in layers]
    assert kinds == ["ColumnParallelLinear", "FakeQuantColumnParallelLinear", "ColumnParallelLinear"]


def test_checkpoint_keys_equal_stock_and_load_both_ways() -> None:
    cfg = PolicyModelConfig(**TINY, dtype="fp32")
    stock = build_gpt_model(cfg, ParallelConfig())
    quads = build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig())
    assert list(stock.state_dict()) == list(quads.state_dict())
    assert set(stock.sharded_state_dict()) == set(quads.sharded_state_dict())
    quads.load_state_dict(stock.state_dict(), strict=True)
    stock.load_state_dict(quads.state_dict(), strict=True)


def test_quantized_weight_is_built_once_per_optimizer_step() -> None:
    cfg = PolicyModelConfig(**TINY, dtype="fp32")
    model = build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig())
    linear = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1
    cache = model.decoder.layers[0].mlp.experts.fake_quant_caches()[0].cache  # all experts' fc1, one batched build
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches, forward and backward
        _forward(model).float().square().mean().backward()
    assert cache.rebuilds == 1
    before = linear.quantized_weight().clone()
    optimizer.step()
    assert invalidate_fake_quant_caches(model) == 2 * TINY["num_layers"]  # fc1 and fc2 group per layer
    _forward(model)
    assert cache.rebuilds == 2
    assert not torch.equal(before, linear.quantized_weight())
    assert torch.equal(linear.quantized_weight(), quantize_dequantize(linear.weight.detach()))


def test_in_place_weight_change_rebuilds_without_explicit_invalidation() -> None:
    model = build_gpt_model(PolicyModelConfig(**TINY, dtype="fp32"), ParallelConfig(), QuadsTrainerConfig())
    linear = model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc2
    first = linear.quantized_weight().clone()
    with torch.no_grad():
        linear.weight.mul_(2.0)
    assert torch.equal(linear.quantized_weight(), quantize_dequantize(linear.weight.detach()))
    assert not torch.equal(first, linear.quantized_weight())


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (dict(hidden_size=72, num_attention_heads=4), r"hidden_size 72 .* multiple of 16"),
        (dict(moe_ffn_hidden_size=40), r"moe_ffn_hidden_size 40 .* multiple of 16"),
    ],
)
def test_sizes_not_divisible_by_16_fail_at_build(overrides: dict, pattern: str) -> None:
    cfg = PolicyModelConfig(**{**TINY, **overrides})
    with pytest.raises(ValueError, match=pattern):
        build_gpt_model(cfg, ParallelConfig(), QuadsTrainerConfig())
    build_gpt_model(cfg, ParallelConfig())  # the stock model builds fine: the check is QUADS's


def test_all_layers_bf16_is_rejected() -> None:
    with pytest.raises(ValueError, match="leave none of the 3 layers quantized"):
        build_gpt_model(PolicyModelConfig(**TINY), ParallelConfig(), QuadsTrainerConfig(bf16_first_layers=2, bf16_last_layers=1))


def test_unsupported_expert_class_fails_with_guidance() -> None:
    spec = copy.deepcopy(stock_layer_spec(PolicyModelConfig(**TINY)))
    TEGroupedMLP = type("TEGroupedMLP", (torch.nn.Module,), {})
    spec.submodules.mlp.submodules.experts.module = TEGroupedMLP
    with pytest.raises(UnsupportedForQuads, match="TEGroupedMLP.*custom FP4 recipe.*apply_quads"):
        quads_layer_spec(spec, QuadsTrainerConfig())
    spec.submodules.mlp.submodules.experts.module = torch.nn.Linear
    with pytest.raises(UnsupportedForQuads, match="unsupported expert class Linear"):
        quads_layer_spec(spec, QuadsTrainerConfig())


def test_te_linear_in_local_path_fails_with_guidance() -> None:
    spec = copy.deepcopy(stock_layer_spec(PolicyModelConfig(**TINY)))
    TEColumnParallelLinear = type("TEColumnParallelLinear", (torch.nn.Module,), {})
    spec.submodules.mlp.submodules.experts.submodules.linear_fc1 = TEColumnParallelLinear
    with pytest.raises(UnsupportedForQuads, match="local_experts.linear_fc1.*TEColumnParallelLinear.*custom FP4 recipe"):
        quads_layer_spec(spec, QuadsTrainerConfig())


def test_gradient_accumulation_fusion_is_rejected() -> None:
    from megatron_quads.trainer import model as model_module

    cfg = PolicyModelConfig(**TINY)
    config = model_module.build_transformer_config(cfg, ParallelConfig())
    config.gradient_accumulation_fusion = True
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        FakeQuantColumnParallelLinear(
            64, 64, config=config, init_method=config.init_method, bias=False, gather_output=False, is_expert=True
        )


def test_stock_spec_is_not_mutated() -> None:
    spec = stock_layer_spec(PolicyModelConfig(**TINY))
    before = copy.deepcopy(spec)
    quads_layer_spec(spec, QuadsTrainerConfig(scope=QuadsScope.ALL_LINEARS))
    assert repr(spec) == repr(before)


def test_grouped_mlp_experts_equal_sequential_mlp_with_quads() -> None:
    """Legacy GroupedMLP (bf16 only in Megatron) fake-quantizes each expert like SequentialMLP does."""
    seq_cfg = PolicyModelConfig(**TINY, dtype="bf16")
    grouped_cfg = PolicyModelConfig(**TINY, dtype="bf16", moe_grouped_gemm=True)
    torch.manual_seed(0)
    sequential = build_gpt_model(seq_cfg, ParallelConfig(), QuadsTrainerConfig())
    grouped = build_gpt_model(grouped_cfg, ParallelConfig(), QuadsTrainerConfig())
    assert type(grouped.decoder.layers[0].mlp.experts).__name__ == "FakeQuantGroupedMLP"
    _load_as_grouped(grouped, sequential.state_dict())
    experts = grouped.decoder.layers[1].mlp.experts
    q1, _ = experts.quantized_weights()
    seq_fc1 = sequential.decoder.layers[1].mlp.experts.local_experts[2].linear_fc1.quantized_weight()
    assert torch.equal(q1.view(TINY["num_experts"], TINY["hidden_size"], -1)[2].t(), seq_fc1)
    out_seq, out_grouped = _forward(sequential), _forward(grouped)
    assert (out_seq.float() - out_grouped.float()).abs().max() < 0.05  # bf16 matmul order differs
    out_grouped.float().square().mean().backward()
    assert experts.weight1.grad is not None and experts.weight1.grad.abs().sum() > 0


def test_grouped_mlp_exports_the_hf_weights_sequential_mlp_does() -> None:
    """What the rollout engine is sent does not depend on the experts' module (GroupedMLP views its
    weight1 / weight2 as per-expert [in, out] blocks; SequentialMLP holds [out, in] linears)."""
    from megatron_quads.trainer.hf_export import export_hf_weights

    torch.manual_seed(0)
    sequential = build_gpt_model(PolicyModelConfig(**TINY, dtype="bf16"), ParallelConfig(), QuadsTrainerConfig())
    grouped = build_gpt_model(PolicyModelConfig(**TINY, dtype="bf16", moe_grouped_gemm=True), ParallelConfig(),
                              QuadsTrainerConfig())
    _load_as_grouped(grouped, sequential.state_dict())
    from_sequential, from_grouped = dict(export_hf_weights(sequential)), dict(export_hf_weights(grouped))
    assert from_sequential.keys() == from_grouped.keys()
    assert any(".mlp.experts.3.down_proj." in name for name in from_grouped)
    for name, tensor in from_sequential.items():
        assert torch.equal(tensor, from_grouped[name]), name
