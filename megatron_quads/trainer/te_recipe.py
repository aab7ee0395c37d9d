"""QUADS through Transformer Engine: a ``CustomRecipe`` quantizer factory for Megatron's FP4 path.

With a TE spec (TEGroupedMLP experts), Megatron runs every TE linear of a layer inside
``fp8_autocast(recipe)``. Setting ``fp4='e2m1'``, ``fp4_recipe='custom'`` and
``fp4_quantizer_factory`` to one of the factories below makes TE ask the factory for a quantizer
per tensor slot (``QuantizerRole``: module_type, tensor_type, name):

- ``weight`` slots in scope get :class:`NVFP4FakeQuantQuantizer`: a high-precision passthrough
  (TE's ``IdentityQuantizer``) whose held tensor is ``dequantize(quantize(W))`` computed by
  :mod:`megatron_quads.nvfp4`, so the GEMM runs in BF16 on exactly the weights the rollout holds;
- every other slot (``input``, ``grad_output``, weights out of scope) gets ``IdentityQuantizer``:
  activations and gradients stay BF16.

TE caches quantized weights across micro-batches itself (its weight workspace), so the fake quant
runs once per optimizer step there too. TE's custom recipe only needs FP8 support (sm >= 8.9), not
Blackwell.

NOT RUN HERE: Transformer Engine does not install on the CPU-only development and CI machines. The
role policy and the fake-quant arithmetic (:func:`weight_slot_is_fake_quantized`,
:func:`fake_quant_for_role`) are plain functions tested on CPU; the TE glue in
:func:`_quantizer_class` is written against TE 2.20's documented API and has not been executed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from megatron_quads.trainer.fake_quant import fake_quant_weight
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig

ROUTED_EXPERTS_FACTORY = "megatron_quads.trainer.te_recipe.quads_routed_experts_qfactory"
ALL_LINEARS_FACTORY = "megatron_quads.trainer.te_recipe.quads_all_linears_qfactory"


def weight_slot_is_fake_quantized(role: Any, scope: QuadsScope) -> bool:
    """Whether the TE tensor slot described by ``role`` gets the NVFP4 fake quant under ``scope``."""
    if role is None or getattr(role, "tensor_type", "") != "weight":
        return False
    module_type = getattr(role, "module_type", "")
    if scope == QuadsScope.ROUTED_EXPERTS:
        return module_type == "grouped_linear"  # TEGroupedMLP's expert GEMMs
    if scope == QuadsScope.ALL_LINEARS:
        return module_type in ("linear", "grouped_linear")
    raise ValueError(_unsupported_scope(scope))


def _unsupported_scope(scope: QuadsScope) -> str:
    return (
        f"QUADS scope {scope.value!r} is not available on the Transformer Engine path (TE roles do not "
        "tell shared experts from attention); use 'routed_experts' or 'all_linears', or a local spec"
    )


def _amax_group(role: Any) -> dist.ProcessGroup | None:
    """The group whose ranks hold shards of the weight: expert-TP for experts, TP otherwise."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if getattr(role, "module_type", "") == "grouped_linear":
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def fake_quant_for_role(weight: torch.Tensor, role: Any, block_2d: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize of a TE weight with the amax reduced over its shard group."""
    return fake_quant_weight(weight, _amax_group(role), block_2d=block_2d)


@functools.cache
def _quantizer_class() -> type:
    from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer

    class NVFP4FakeQuantQuantizer(IdentityQuantizer):
        """IdentityQuantizer holding ``dequantize(quantize(W))`` instead of ``W``."""

        def __init__(self, role: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.quads_role = role

        def copy(self) -> "NVFP4FakeQuantQuantizer":
            quantizer = NVFP4FakeQuantQuantizer(
                self.quads_role, dtype=self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage
            )
            quantizer.internal = self.internal
            quantizer.optimize_for_gemm = self.optimize_for_gemm
            return quantizer

        def _maybe_cast(self, tensor: torch.Tensor) -> torch.Tensor:
            return super()._maybe_cast(fake_quant_for_role(tensor.detach(), self.quads_role))

    return NVFP4FakeQuantQuantizer


def _make_factory(scope: QuadsScope):
    def qfactory(role: Any) -> Any:
        from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer

        if weight_slot_is_fake_quantized(role, scope):
            return _quantizer_class()(role)
        return IdentityQuantizer()

    qfactory.__doc__ = f"TE CustomRecipe qfactory: NVFP4 fake quant for {scope.value} weights, BF16 elsewhere."
    return qfactory


quads_routed_experts_qfactory = _make_factory(QuadsScope.ROUTED_EXPERTS)
quads_all_linears_qfactory = _make_factory(QuadsScope.ALL_LINEARS)


def te_recipe_config_overrides(quads: QuadsTrainerConfig) -> dict[str, Any]:
    """TransformerConfig fields that route TE layers through the QUADS quantizer factory."""
    if quads.block_2d:
        raise ValueError("block_2d=True is not available on the TE path: its factories fake-quantize with 1x16 blocks")
    factories = {QuadsScope.ROUTED_EXPERTS: ROUTED_EXPERTS_FACTORY, QuadsScope.ALL_LINEARS: ALL_LINEARS_FACTORY}
    if quads.scope not in factories:
        raise ValueError(_unsupported_scope(quads.scope))
    factory = factories[quads.scope]
    keep_bf16 = quads.bf16_first_layers > 0 or quads.bf16_last_layers > 0
    return {
        "fp4": "e2m1",
        "fp4_recipe": "custom",
        "fp4_quantizer_factory": factory,
        "first_last_layers_bf16": keep_bf16,
        "num_layers_at_start_in_bf16": quads.bf16_first_layers,
        "num_layers_at_end_in_bf16": quads.bf16_last_layers,
    }
