"""The parts of the Transformer Engine QUADS recipe that run without TE (TE needs CUDA libraries)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megatron_quads.nvfp4 import quantize_dequantize
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig
from megatron_quads.trainer.te_recipe import (
    ALL_LINEARS_FACTORY,
    ROUTED_EXPERTS_FACTORY,
    fake_quant_for_role,
    te_recipe_config_overrides,
    weight_slot_is_fake_quantized,
)


@dataclass(frozen=True)
class Role:  # the fields of TE's QuantizerRole
    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


@pytest.mark.parametrize(
    ("role", "routed", "all_linears"),
    [
        (Role("grouped_linear", "weight", "fc1"), True, True),
        (Role("grouped_linear", "input", "fc1"), False, False),
        (Role("grouped_linear", "grad_output", "fc2"), False, False),
        (Role("linear", "weight", "qkv"), False, True),
        (Role("linear", "input", "qkv"), False, False),
        (Role("dpa", "weight"), False, False),
        (None, False, False),
        (Role(), False, False),
    ],
)
def test_only_weight_slots_in_scope_are_fake_quantized(role: Role | None, routed: bool, all_linears: bool) -> None:
    assert weight_slot_is_fake_quantized(role, QuadsScope.ROUTED_EXPERTS) is routed
    assert weight_slot_is_fake_quantized(role, QuadsScope.ALL_LINEARS) is all_linears


def test_scopes_te_cannot_tell_apart_are_rejected() -> None:
    with pytest.raises(ValueError, match="'experts' is not available on the Transformer Engine path"):
        weight_slot_is_fake_quantized(Role("linear", "weight"), QuadsScope.EXPERTS)
    with pytest.raises(ValueError, match="experts_and_attention"):
        te_recipe_config_overrides(QuadsTrainerConfig(scope=QuadsScope.EXPERTS_AND_ATTENTION))


def test_fake_quant_for_role_is_the_shared_numerics_path() -> None:
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    assert torch.equal(fake_quant_for_role(w, Role("grouped_linear", "weight")), quantize_dequantize(w))


def test_config_overrides_select_custom_fp4_recipe_and_bf16_layers() -> None:
    overrides = te_recipe_config_overrides(QuadsTrainerConfig(bf16_first_layers=1, bf16_last_layers=2))
    assert overrides == {
        "fp4": "e2m1",
        "fp4_recipe": "custom",
        "fp4_quantizer_factory": ROUTED_EXPERTS_FACTORY,
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    assert te_recipe_config_overrides(QuadsTrainerConfig(scope=QuadsScope.ALL_LINEARS))["fp4_quantizer_factory"] == ALL_LINEARS_FACTORY


def test_factory_paths_resolve_to_callables() -> None:
    import importlib

    for path in (ROUTED_EXPERTS_FACTORY, ALL_LINEARS_FACTORY):
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name))


def test_megatron_accepts_the_overrides() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        **te_recipe_config_overrides(QuadsTrainerConfig(bf16_last_layers=1)),
    )
    assert config.fp4_recipe == "custom" and config.fp4_quantizer_factory == ROUTED_EXPERTS_FACTORY



# ---- the policy worker's Transformer Engine path (parallel.transformer_impl) ----
# TE is not installed here: the selection is tested with Megatron's TE spec function replaced by a
# recorder; no TE module is built or run.

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=32)


def test_transformer_impl_key_defaults_to_local_and_is_validated() -> None:
    from pydantic import ValidationError

    from megatron_quads.trainer.settings import ParallelConfig

    assert ParallelConfig().transformer_impl == "local"
    assert ParallelConfig(transformer_impl="transformer_engine").transformer_impl == "transformer_engine"
    with pytest.raises(ValidationError, match="transformer_impl"):
        ParallelConfig(transformer_impl="te")


@pytest.mark.parametrize(
    ("model", "quads", "pattern"),
    [
        (dict(moe_grouped_gemm=True), {}, "model.moe_grouped_gemm=true selects the local spec's legacy GroupedMLP"),
        ({}, dict(scope=QuadsScope.EXPERTS), "QUADS scope 'experts' is not available with parallel.transformer_impl"),
        ({}, dict(block_2d=True), "quads.block_2d is not available with parallel.transformer_impl=transformer_engine"),
    ],
)
def test_worker_config_refuses_what_the_te_path_cannot_build(model: dict, quads: dict, pattern: str) -> None:
    from pydantic import ValidationError

    from megatron_quads.trainer.settings import ParallelConfig, PolicyModelConfig, PolicyWorkerConfig

    te = ParallelConfig(transformer_impl="transformer_engine")
    with pytest.raises(ValidationError, match=pattern):
        PolicyWorkerConfig(model=PolicyModelConfig(**TINY, **model), parallel=te, quads=QuadsTrainerConfig(**quads))
    PolicyWorkerConfig(model=PolicyModelConfig(**TINY, **model), parallel=ParallelConfig(), quads=QuadsTrainerConfig(**quads))
    PolicyWorkerConfig(model=PolicyModelConfig(**TINY), parallel=te, quads=QuadsTrainerConfig(scope=QuadsScope.ALL_LINEARS))


def test_run_config_refuses_te_with_legacy_grouped_gemm_at_start() -> None:
    from megatron_quads.controller.config import RunConfig

    model = {"embedded_default": False, "architecture": {**TINY, "moe_grouped_gemm": True}}
    with pytest.raises(ValueError, match="model.moe_grouped_gemm=false"):
        RunConfig(model=model, parallel={"transformer_impl": "transformer_engine"})


def test_worker_without_te_fails_naming_the_key_and_the_fix() -> None:
    from megatron_quads.trainer.model import (
        ParallelConfig,
        PolicyModelConfig,
        TransformerEngineUnavailable,
        build_gpt_model,
    )

    with pytest.raises(TransformerEngineUnavailable, match=r"parallel\.transformer_impl=transformer_engine needs "
                                                          r"Transformer Engine.*set parallel\.transformer_impl=local"):
        build_gpt_model(PolicyModelConfig(**TINY), ParallelConfig(transformer_impl="transformer_engine"), QuadsTrainerConfig())


def test_worker_selects_the_te_spec_with_te_grouped_experts_and_the_quads_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_quads.trainer import model as model_module
    from megatron_quads.trainer.specs import apply_quads

    calls = []
    te_spec = object()
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: calls.append(kw) or te_spec)
    cfg = model_module.PolicyModelConfig(**TINY)
    parallel = model_module.ParallelConfig(transformer_impl="transformer_engine")
    assert model_module.stock_layer_spec(cfg, parallel.transformer_impl) is te_spec
    assert calls == [dict(num_experts=4, moe_grouped_gemm=True, qk_layernorm=True, moe_use_legacy_grouped_gemm=False)]
    config = model_module.build_transformer_config(cfg, parallel)
    assert (config.transformer_impl, config.moe_grouped_gemm, config.moe_use_legacy_grouped_gemm) == (
        "transformer_engine", True, False)
    local = model_module.build_transformer_config(cfg, model_module.ParallelConfig())
    assert (local.transformer_impl, local.moe_grouped_gemm) == ("local", False)
    assert type(model_module.stock_layer_spec(cfg)).__name__ == "ModuleSpec" and len(calls) == 1

    # a TE spec (TEGroupedMLP experts) gets the QUADS custom recipe in its config, the spec unchanged
    spec = model_module.gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    spec.submodules.mlp.submodules.experts.module = type("TEGroupedMLP", (torch.nn.Module,), {})
    quads_config, quads_spec = apply_quads(config, spec, QuadsTrainerConfig(bf16_last_layers=1))
    assert quads_spec is spec
    assert (quads_config.fp4, quads_config.fp4_recipe, quads_config.fp4_quantizer_factory) == (
        "e2m1", "custom", ROUTED_EXPERTS_FACTORY)
    assert (quads_config.first_last_layers_bf16, quads_config.num_layers_at_end_in_bf16) == (True, 1)


def test_export_maps_te_parameter_names() -> None:
    from megatron_quads.trainer import hf_export

    weight = torch.randn(64, 16)
    assert list(hf_export._local_expert_shards("mlp.experts.linear_fc1.weight3", weight, None, 4)) == [(3, "1", weight)]
    assert hf_export._is_expert_param("mlp.experts.linear_fc2.weight0")
    assert not hf_export._is_expert_param("mlp.linear_fc2.weight")
    assert hf_export._LAYER_NAMES["self_attention.linear_qkv.layer_norm_weight"] == "input_layernorm.weight"


# ---- the factory against Transformer Engine's published quantizer API ----


@pytest.fixture
def te_identity_quantizer(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in for ``transformer_engine.pytorch.tensor.identity_tensor.IdentityQuantizer`` with the
    interface TE publishes (TE main, 2.20.0.dev0, commit d0067d0): keyword-only ``dtype``, ``rowwise``,
    ``columnwise``; ``rowwise_usage`` / ``columnwise_usage`` / ``internal`` / ``optimize_for_gemm``
    attributes; ``copy()``; ``_maybe_cast(tensor)`` returning the detached tensor in ``dtype``. It is
    not TE: it checks the factory's use of that interface, nothing of TE's kernels or modules."""
    import sys
    import types

    from megatron_quads.trainer import te_recipe

    class IdentityQuantizer:
        def __init__(self, *, dtype=None, rowwise=True, columnwise=True) -> None:
            self.dtype, self.rowwise_usage, self.columnwise_usage = dtype, rowwise, columnwise
            self.internal, self.optimize_for_gemm = False, False

        def copy(self):
            raise AssertionError("the subclass must override copy()")

        def _maybe_cast(self, tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.detach()
            return out.to(self.dtype) if self.dtype is not None and out.dtype != self.dtype else out

    module = types.ModuleType("transformer_engine.pytorch.tensor.identity_tensor")
    module.IdentityQuantizer = IdentityQuantizer
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.tensor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    te_recipe._quantizer_class.cache_clear()
    yield IdentityQuantizer
    te_recipe._quantizer_class.cache_clear()


def test_factory_returns_fake_quant_quantizers_for_weights_in_scope(te_identity_quantizer: type) -> None:
    from megatron_quads.trainer.te_recipe import quads_all_linears_qfactory, quads_routed_experts_qfactory

    weight = quads_routed_experts_qfactory(Role("grouped_linear", "weight", "fc1"))
    assert isinstance(weight, te_identity_quantizer) and type(weight).__name__ == "NVFP4FakeQuantQuantizer"
    for role in (Role("grouped_linear", "input", "fc1"), Role("grouped_linear", "grad_output"), Role("linear", "weight")):
        assert type(quads_routed_experts_qfactory(role)) is te_identity_quantizer, role
    assert type(quads_all_linears_qfactory(Role("linear", "weight", "qkv"))).__name__ == "NVFP4FakeQuantQuantizer"

    w = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    held = weight._maybe_cast(w)
    assert torch.equal(held, quantize_dequantize(w.detach())) and not held.requires_grad
    assert not torch.equal(held, w.detach())
    weight.internal, weight.optimize_for_gemm = True, True
    twin = weight.copy()
    assert type(twin) is type(weight) and twin.quads_role == weight.quads_role
    assert (twin.internal, twin.optimize_for_gemm, twin.rowwise_usage, twin.columnwise_usage) == (True, True, True, True)
    assert torch.equal(twin._maybe_cast(w), held)
