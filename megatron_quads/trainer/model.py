"""Build a Megatron-Core GPT-MoE model (stock or QUADS) from a typed config."""

from __future__ import annotations

import logging

import torch.nn.functional as F
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_quads.trainer.megatron_fixes import (
    fix_router_without_te,
    provide_grouped_gemm_fallback,
    sequence_parallel_block_spec,
)
from megatron_quads.trainer.quads_config import QuadsTrainerConfig
from megatron_quads.trainer.settings import (  # noqa: F401 (re-exported)
    MODEL_CONFIG_FILE,
    ParallelConfig,
    PolicyModelConfig,
    load_model_config,
    save_model_config,
)
from megatron_quads.trainer.specs import apply_quads

logger = logging.getLogger(__name__)


def build_transformer_config(
    model: PolicyModelConfig, parallel: ParallelConfig, initialize: bool = True, routing_replay: bool = False
) -> TransformerConfig:
    """Megatron TransformerConfig for ``model`` under ``parallel``; ``initialize=False`` leaves the
    parameters uninitialised (for a caller that fills every one, e.g. a checkpoint converter);
    ``routing_replay`` gives every router Megatron's routing replay (:mod:`.router_replay`)."""
    tp = parallel.tensor_parallel
    te = parallel.transformer_impl == "transformer_engine"
    if model.num_experts % parallel.expert_parallel:
        raise ValueError(
            f"num_experts {model.num_experts} is not divisible by expert_parallel {parallel.expert_parallel}"
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_size,
        moe_grouped_gemm=model.moe_grouped_gemm or te,  # TE: TEGroupedMLP experts
        moe_use_legacy_grouped_gemm=model.moe_grouped_gemm,
        transformer_impl=parallel.transformer_impl,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        # Megatron's pre-softmax routing (softmax over all experts, then top-k) leaves the top-k
        # probabilities unnormalised; top-k first and a softmax over the k is the renormalised form
        moe_router_pre_softmax=not model.norm_topk_prob,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        init_method_std=model.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=model.dtype == "bf16",
        params_dtype=model.torch_dtype,
        pipeline_dtype=model.torch_dtype,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel or tp,
        sequence_parallel=parallel.sequence_parallel or tp > 1,
        moe_enable_routing_replay=routing_replay,
    )


class TransformerEngineUnavailable(RuntimeError):
    """``parallel.transformer_impl=transformer_engine`` on a machine where TE does not import."""


def stock_layer_spec(model: PolicyModelConfig, transformer_impl: str = "local") -> ModuleSpec:
    """Megatron's GPT-MoE layer spec: local modules, or Transformer Engine's with TEGroupedMLP experts."""
    if transformer_impl == "transformer_engine":
        if not gpt_layer_specs.HAVE_TE:
            raise TransformerEngineUnavailable(
                "parallel.transformer_impl=transformer_engine needs Transformer Engine, and it does not import here "
                "(Megatron-Core's TE extension is unavailable): install transformer-engine[pytorch] on the trainer's "
                "CUDA machines, or set parallel.transformer_impl=local"
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts,
            moe_grouped_gemm=True,
            qk_layernorm=model.qk_layernorm,
            moe_use_legacy_grouped_gemm=False,
        )
    if transformer_impl != "local":
        raise ValueError(f"transformer_impl {transformer_impl!r} is not 'local' or 'transformer_engine'")
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=model.moe_grouped_gemm,
        moe_use_legacy_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
    )


def build_gpt_model(
    model: PolicyModelConfig,
    parallel: ParallelConfig,
    quads: QuadsTrainerConfig | None = None,
    layer_spec: ModuleSpec | TransformerBlockSubmodules | None = None,
    initialize: bool = True,
    routing_replay: bool = False,
) -> GPTModel:
    """A Megatron GPTModel for this rank; QUADS fake quant applied when ``quads`` is enabled.

    Needs ``parallel_state`` initialized with the same layout as ``parallel``. ``initialize=False``:
    parameters are allocated but not initialised (the caller loads every one). ``routing_replay``:
    the routers can replay given experts (:mod:`.router_replay`).
    """
    spec = layer_spec if layer_spec is not None else stock_layer_spec(model, parallel.transformer_impl)
    config = build_transformer_config(model, parallel, initialize, routing_replay)
    fix_router_without_te()
    if model.moe_grouped_gemm and provide_grouped_gemm_fallback():
        logger.warning("grouped_gemm is not installed: GroupedMLP uses torch._grouped_mm (CUDA, bf16) or a "
                       "per-expert torch matmul loop (elsewhere)")
    if config.sequence_parallel and isinstance(spec, ModuleSpec) and parallel.transformer_impl == "local":
        spec = sequence_parallel_block_spec(spec, config)  # torch norms that accept SP (TE's norms do)
    if quads is not None:
        config, spec = apply_quads(config, spec, quads)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        share_embeddings_and_output_weights=not model.untie_embeddings,
    )
