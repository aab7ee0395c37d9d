"""The QUADS layer spec for the model that Megatron-LM's arguments describe.

:func:`quads_spec_from_args` is :func:`megatron_quads.trainer.specs.apply_quads` driven by
Megatron-LM's parsed arguments: it builds Megatron-Core's stock layer spec the way Megatron-LM's
``gpt_builders.py`` does (local or Transformer Engine, from ``--transformer-impl``) and transforms
it. Megatron-LM builds the ``TransformerConfig`` itself, from its arguments, before it reads the
spec, so the one config change QUADS needs (the Transformer Engine path's custom FP4 recipe) must
come in as Megatron-LM's own ``--fp4-*`` flags: this module checks they are there.
"""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_quads.megatron_lm.args import quads_config_from_args
from megatron_quads.trainer.quads_config import QuadsTrainerConfig
from megatron_quads.trainer.specs import quads_block_spec, quads_layer_spec, validate_quads_config
from megatron_quads.trainer.te_recipe import te_recipe_config_overrides

TE_FLAGS = {"fp4": "--fp4-format", "fp4_recipe": "--fp4-recipe", "fp4_quantizer_factory": "--fp4-quantizer-factory"}
"""TransformerConfig fields of the TE recipe -> the Megatron-LM flags that set them."""


class MegatronLMUnavailable(RuntimeError):
    """Megatron-LM's training package is needed (its parsed arguments or its config builder) and absent.

    A RuntimeError, not an ImportError: Megatron-LM's ``--spec`` loader turns an ImportError raised
    while importing the spec module into a logged message and a ``None`` spec.
    """


def megatron_lm_args() -> Namespace:
    """The arguments of the running Megatron-LM job (``megatron.training.get_args()``)."""
    try:
        from megatron.training import get_args
    except ImportError as err:
        raise MegatronLMUnavailable(
            f"megatron_quads.megatron_lm needs Megatron-LM's training package (megatron.training: {err}) to read "
            "the job's arguments; run it inside Megatron-LM's pretrain_gpt.py (with Megatron-LM's checkout on "
            "PYTHONPATH), or call quads_spec_from_args(args) with an argument namespace"
        ) from None
    return get_args()


def megatron_lm_config(args: Namespace) -> TransformerConfig:
    """The TransformerConfig Megatron-LM builds from ``args`` (``core_transformer_config_from_args``)."""
    try:
        from megatron.training.arguments import core_transformer_config_from_args
    except ImportError as err:
        raise MegatronLMUnavailable(
            f"the high-precision first / last layers of a local-spec QUADS model need this pipeline stage's layer "
            f"count, from Megatron-LM's config builder (megatron.training: {err}); pass config= to "
            "quads_spec_from_args"
        ) from None
    return core_transformer_config_from_args(args)


def transformer_impl(args: Any) -> str:
    """``--transformer-impl`` (Megatron-LM's default: transformer_engine)."""
    return getattr(args, "transformer_impl", "transformer_engine")


def _unsupported(args: Any) -> list[str]:
    problems = []
    if not getattr(args, "num_experts", None):
        problems.append("--num-experts is not set: the QUADS spec is an MoE layer spec")
    freq = getattr(args, "moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, list) and all(f == 1 for f in freq))):
        problems.append(
            f"--moe-layer-freq {freq}: the spec is one layer spec for every layer, so every layer must be an MoE layer"
        )
    for name, flag in (("experimental_attention_variant", "--experimental-attention-variant"),
                       ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
                       ("kitchen_config_file", "--kitchen-config-file"),
                       ("kitchen_recipe_number", "--kitchen-recipe-number")):
        if getattr(args, name, None) is not None:
            problems.append(f"{flag} builds its own layer specs, which the QUADS spec does not transform")
    if transformer_impl(args) not in ("local", "transformer_engine"):
        problems.append(f"--transformer-impl {transformer_impl(args)}: QUADS builds 'local' or 'transformer_engine' layers")
    return problems


def stock_spec_from_args(args: Any) -> ModuleSpec:
    """Megatron-Core's stock GPT layer spec for ``args``, as Megatron-LM's ``gpt_builders.py`` picks it."""
    from megatron.core.models.gpt import gpt_layer_specs

    common = dict(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        moe_use_legacy_grouped_gemm=getattr(args, "moe_use_legacy_grouped_gemm", False),
        qk_l2_norm=getattr(args, "qk_l2_norm", False),
    )
    if transformer_impl(args) == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(**common, normalization=args.normalization)
    if not gpt_layer_specs.HAVE_TE:
        raise RuntimeError(
            "--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer Engine, which is not "
            "importable here; install transformer-engine[pytorch] on a CUDA machine, or pass --transformer-impl local "
            "(QUADS then fake-quantizes through its own modules)"
        )
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**common)


def _check_te_args(args: Any, quads: QuadsTrainerConfig) -> None:
    if not args.moe_grouped_gemm or getattr(args, "moe_use_legacy_grouped_gemm", False):
        raise ValueError(
            "QUADS reaches Transformer Engine experts only as TEGroupedMLP: pass --moe-grouped-gemm without "
            "--moe-use-legacy-grouped-gemm, or use --transformer-impl local"
        )
    try:
        wanted = te_recipe_config_overrides(quads)
    except ValueError as err:
        raise ValueError(f"--transformer-impl transformer_engine: {err} (--quads-scope / --quads-block-layout)") from None
    wrong = {field: getattr(args, field, None) for field in TE_FLAGS if getattr(args, field, None) != wanted[field]}
    if wrong:
        found = ", ".join(f"{TE_FLAGS[f]}={v}" for f, v in wrong.items())
        needed = " ".join(f"{TE_FLAGS[f]} {wanted[f]}" for f in TE_FLAGS)
        raise ValueError(
            f"QUADS on Transformer Engine layers runs through Megatron's custom FP4 recipe with the QUADS quantizer "
            f"factory, which Megatron-LM builds from its own flags; add: {needed} (found {found})"
        )


def _check_local_args(args: Any) -> None:
    if getattr(args, "fp4", None) or getattr(args, "fp8", None):
        raise ValueError(
            "--fp4-format / --fp8-format act only on Transformer Engine modules; the local QUADS spec fake-quantizes "
            "with its own modules: drop them, or use --transformer-impl transformer_engine"
        )


def _size_view(args: Any) -> SimpleNamespace:
    """The TransformerConfig fields :func:`validate_quads_config` reads, from Megatron-LM's arguments."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    return SimpleNamespace(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=getattr(args, "kv_channels", None), num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None), ffn_hidden_size=args.ffn_hidden_size,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None) or tp,
        tensor_model_parallel_size=tp,
    )


def quads_spec_from_args(
    args: Any = None, config: TransformerConfig | None = None
) -> ModuleSpec | TransformerBlockSubmodules:
    """The QUADS layer spec (stock with ``--no-quads``) for the model Megatron-LM's ``args`` describe.

    ``args``: the parsed namespace (default: the running job's, ``megatron.training.get_args()``).
    A local spec comes back as one transformed layer spec, which every pipeline stage expands; with
    ``--first-last-layers-bf16`` as this stage's per-layer block spec, built with ``config`` (default:
    Megatron-LM's config from ``args``). A Transformer Engine spec comes back unchanged: QUADS acts
    there through the ``--fp4-*`` recipe flags, which are checked.
    """
    args = megatron_lm_args() if args is None else args
    quads = quads_config_from_args(args)
    problems = _unsupported(args)
    if problems:
        raise ValueError("the QUADS --spec cannot build this model: " + "; ".join(problems))
    stock = stock_spec_from_args(args)
    if not quads.enabled:
        return stock
    validate_quads_config(config or _size_view(args), quads)
    if transformer_impl(args) == "transformer_engine":
        _check_te_args(args, quads)
        return stock
    _check_local_args(args)
    if not (quads.bf16_first_layers or quads.bf16_last_layers):
        return quads_layer_spec(stock, quads)
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(
            "--first-last-layers-bf16 with the local QUADS spec needs per-stage layer specs, and Megatron-LM reads "
            "one --spec for every virtual pipeline stage: drop --num-layers-per-virtual-pipeline-stage, or use "
            "--transformer-impl transformer_engine"
        )
    return quads_block_spec(config or megatron_lm_config(args), stock, quads)
