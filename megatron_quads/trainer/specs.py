"""QUADS layer specs: a transformation of Megatron-Core's stock GPT / MoE specs.

QUADS is switched on by transforming a stock spec, never by forking Megatron's model code:

- local specs (``get_gpt_layer_local_spec``): the linears in scope become fake-quant subclasses of
  ColumnParallelLinear / RowParallelLinear (SequentialMLP experts, shared experts, attention, dense
  MLPs), and GroupedMLP experts become :class:`FakeQuantGroupedMLP`;
- Transformer Engine specs (TEGroupedMLP experts): the spec stays stock and the TransformerConfig
  selects TE's custom FP4 recipe with the QUADS quantizer factory (:mod:`.te_recipe`).

:func:`apply_quads` does whichever applies. Parameter names and shapes never change, so checkpoints
move freely between QUADS and stock models.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_quads.trainer.expert_linears import (
    FakeQuantColumnParallelLinear,
    FakeQuantGroupedMLP,
    FakeQuantRowParallelLinear,
    FakeQuantSequentialMLP,
)
from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig

_FAKE_QUANT_OF = {
    ColumnParallelLinear: FakeQuantColumnParallelLinear,
    RowParallelLinear: FakeQuantRowParallelLinear,
    GroupedMLP: FakeQuantGroupedMLP,
    SequentialMLP: FakeQuantSequentialMLP,
}
_TE_EXPERT_CLASSES = ("TEGroupedMLP",)


class UnsupportedForQuads(ValueError):
    """A module class in the spec that the QUADS local path cannot fake-quantize."""


@functools.cache
def _block_2d_variant(cls: type) -> type:
    return type(f"{cls.__name__}Block2D", (cls,), {"quads_block_2d": True, "__module__": cls.__module__})


def _fake_quant_class(cls: type, where: str, block_2d: bool) -> type:
    if issubclass(cls, tuple(_FAKE_QUANT_OF.values())):
        return cls  # already transformed (including the Block2D variants)
    if cls not in _FAKE_QUANT_OF:
        hint = (
            "Transformer Engine modules are fake-quantized through TE's custom FP4 recipe: pass the TE "
            "spec to megatron_quads.trainer.apply_quads, which sets the recipe in the TransformerConfig"
            if cls.__name__.startswith("TE") or cls.__name__ in _TE_EXPERT_CLASSES
            else "use Megatron's local spec (ColumnParallelLinear / RowParallelLinear / SequentialMLP / "
            "GroupedMLP) for the layers in the QUADS scope, or narrow the scope"
        )
        raise UnsupportedForQuads(f"{where}: cannot fake-quantize {cls.__module__}.{cls.__name__}; {hint}")
    target = _FAKE_QUANT_OF[cls]
    return _block_2d_variant(target) if block_2d else target


def _swap_linears(submodules: object, names: tuple[str, ...], where: str, block_2d: bool) -> None:
    for name in names:
        cls = getattr(submodules, name, None)
        if cls is None:
            continue
        if isinstance(cls, ModuleSpec):
            cls.module = _fake_quant_class(cls.module, f"{where}.{name}", block_2d)
        else:
            setattr(submodules, name, _fake_quant_class(cls, f"{where}.{name}", block_2d))


def _swap_routed_experts(experts: ModuleSpec, block_2d: bool) -> None:
    where = "mlp.experts"
    if experts.module.__name__ in _TE_EXPERT_CLASSES:
        raise UnsupportedForQuads(
            f"{where}: {experts.module.__name__} experts run inside Transformer Engine; QUADS reaches them "
            "through TE's custom FP4 recipe: use megatron_quads.trainer.apply_quads(config, spec, quads)"
        )
    if issubclass(experts.module, SequentialMLP):
        experts.module = _fake_quant_class(experts.module, where, block_2d)
        _swap_linears(experts.submodules, ("linear_fc1", "linear_fc2"), f"{where}.local_experts", block_2d)
    elif issubclass(experts.module, GroupedMLP):
        experts.module = _fake_quant_class(experts.module, where, block_2d)
    else:
        raise UnsupportedForQuads(
            f"{where}: unsupported expert class {experts.module.__name__}; QUADS supports SequentialMLP, "
            "GroupedMLP (local specs) and TEGroupedMLP (through apply_quads)"
        )


def quads_layer_spec(layer_spec: ModuleSpec, quads: QuadsTrainerConfig) -> ModuleSpec:
    """A copy of a stock transformer-layer spec with the linears in QUADS scope fake-quantized."""
    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    mlp = getattr(sub, "mlp", None)
    if isinstance(mlp, ModuleSpec) and issubclass(mlp.module, MoELayer):
        _swap_routed_experts(mlp.submodules.experts, quads.block_2d)
        shared = getattr(mlp.submodules, "shared_experts", None)
        if quads.covers_shared_experts() and isinstance(shared, ModuleSpec):
            _swap_linears(shared.submodules, ("linear_fc1", "linear_fc2"), "mlp.shared_experts", quads.block_2d)
    elif isinstance(mlp, ModuleSpec) and quads.covers_dense_mlp():
        _swap_linears(mlp.submodules, ("linear_fc1", "linear_fc2"), "mlp", quads.block_2d)
    attention = getattr(sub, "self_attention", None)
    if quads.covers_attention() and isinstance(attention, ModuleSpec):
        names = tuple(
            f.name for f in dataclasses.fields(attention.submodules) if f.name.startswith("linear_")
        )
        _swap_linears(attention.submodules, names, "self_attention", quads.block_2d)
    return spec


def quads_block_spec(
    config: TransformerConfig,
    layer_spec: ModuleSpec | TransformerBlockSubmodules,
    quads: QuadsTrainerConfig,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage: QUADS layers, except the first / last N kept stock."""
    if isinstance(layer_spec, TransformerBlockSubmodules):
        stock = layer_spec
    else:
        num_local = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        stock = TransformerBlockSubmodules(layer_specs=[layer_spec] * num_local, layer_norm=LayerNormImpl)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    transformed: dict[int, ModuleSpec] = {}  # one transformed copy per distinct stock spec
    layer_specs = []
    for i, spec in enumerate(stock.layer_specs):
        if quads.layer_in_scope(offset + i, config.num_layers):
            spec = transformed.setdefault(id(spec), quads_layer_spec(spec, quads))
        layer_specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=stock.layer_norm)


def _uses_te_experts(layer_spec: ModuleSpec | TransformerBlockSubmodules) -> bool:
    specs = layer_spec.layer_specs if isinstance(layer_spec, TransformerBlockSubmodules) else [layer_spec]
    for spec in specs:
        mlp = getattr(spec.submodules, "mlp", None)
        if isinstance(mlp, ModuleSpec) and issubclass(mlp.module, MoELayer):
            if mlp.submodules.experts.module.__name__ in _TE_EXPERT_CLASSES:
                return True
    return False


def apply_quads(
    config: TransformerConfig,
    layer_spec: ModuleSpec | TransformerBlockSubmodules,
    quads: QuadsTrainerConfig,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> tuple[TransformerConfig, ModuleSpec | TransformerBlockSubmodules]:
    """Switch QUADS on for a GPT model: returns the (config, spec) to build ``GPTModel`` with.

    Local specs get fake-quant modules; TE specs keep their modules and get TE's custom FP4 recipe
    with the QUADS quantizer factory in the config. With ``quads.enabled`` False both come back
    unchanged.
    """
    validate_quads_config(config, quads)
    if not quads.enabled:
        return config, layer_spec
    if _uses_te_experts(layer_spec):
        from megatron_quads.trainer.te_recipe import te_recipe_config_overrides

        return dataclasses.replace(config, **te_recipe_config_overrides(quads)), layer_spec
    return config, quads_block_spec(config, layer_spec, quads, vp_stage=vp_stage, pp_rank=pp_rank)


def validate_quads_config(config: TransformerConfig, quads: QuadsTrainerConfig) -> None:
    """Fail before building when the model's sizes cannot be fake-quantized in the chosen scope."""
    if not quads.enabled:
        return
    problems = []
    if quads.bf16_first_layers + quads.bf16_last_layers >= config.num_layers:
        problems.append(
            f"bf16_first_layers ({quads.bf16_first_layers}) + bf16_last_layers ({quads.bf16_last_layers}) "
            f"leave none of the {config.num_layers} layers quantized"
        )
    if config.num_moe_experts:
        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        etp = config.expert_tensor_parallel_size or 1
        if config.hidden_size % 16:
            problems.append(f"hidden_size {config.hidden_size} (reduction dim of expert fc1) is not a multiple of 16")
        if ffn % (16 * etp):
            problems.append(
                f"moe_ffn_hidden_size {ffn} is not a multiple of 16 * expert_tensor_parallel_size "
                f"({16 * etp}); each rank's expert fc2 shard must split into 16-element blocks"
            )
    if quads.scope in (QuadsScope.EXPERTS_AND_ATTENTION, QuadsScope.ALL_LINEARS):
        tp = config.tensor_model_parallel_size
        kv = config.kv_channels or config.hidden_size // config.num_attention_heads
        proj_in = kv * config.num_attention_heads
        if config.hidden_size % 16 or proj_in % (16 * tp):
            problems.append(
                f"attention in scope needs hidden_size ({config.hidden_size}) and heads * kv_channels "
                f"per TP rank ({proj_in} / {tp}) to be multiples of 16"
            )
    if problems:
        raise ValueError("QUADS cannot fake-quantize this model: " + "; ".join(problems))
