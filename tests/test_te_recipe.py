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

