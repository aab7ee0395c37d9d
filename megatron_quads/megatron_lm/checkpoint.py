"""What a Megatron-LM checkpoint recorded about itself: the architecture and the QUADS flags.

Megatron-LM saves its parsed arguments with every ``torch_dist`` checkpoint (``common.pt``, key
``args``). ``megatron-quads convert`` reads the architecture from them when the checkpoint has no
``model_config.json``, and ``to-quads`` takes ``--quads-rac-ratio`` from them when ``--ratio`` is
not given.
"""

from __future__ import annotations

import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from megatron_quads.trainer.settings import PolicyModelConfig

COMMON_FILE = "common.pt"


def read_megatron_lm_args(directory: str | os.PathLike[str]) -> Namespace | None:
    """The arguments a Megatron-LM dist checkpoint recorded; None when its ``common.pt`` holds none."""
    path = Path(directory) / COMMON_FILE
    if not path.is_file():
        return None
    import megatron.core  # noqa: F401  (registers Megatron's argument classes as safe for weights_only loading)

    from megatron_quads.trainer.checkpoint_audit import load_plain_data

    state = load_plain_data(path, path, "Megatron-LM's common state")
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, Namespace) else None


def _not_qwen3_moe(args: Any) -> list[str]:
    """What in Megatron-LM's ``args`` has no Qwen3-MoE counterpart (the architectures convert maps)."""
    checks = [
        (getattr(args, "num_experts", None), "--num-experts is not set (a dense model)", lambda v: bool(v)),
        (getattr(args, "normalization", None), "--normalization {} (Qwen3-MoE: RMSNorm)", lambda v: v == "RMSNorm"),
        (getattr(args, "swiglu", False), "no --swiglu (Qwen3-MoE's MLPs are SwiGLU)", bool),
        (getattr(args, "add_bias_linear", True), "linear biases (pass --disable-bias-linear)", lambda v: not v),
        (getattr(args, "add_qkv_bias", False), "--add-qkv-bias", lambda v: not v),
        (getattr(args, "position_embedding_type", None), "--position-embedding-type {} (Qwen3-MoE: rope)",
         lambda v: v == "rope"),
        (getattr(args, "rotary_percent", 1.0), "--rotary-percent {} (Qwen3-MoE: 1.0)", lambda v: v == 1.0),
        (getattr(args, "use_rope_scaling", False), "--use-rope-scaling", lambda v: not v),
        (getattr(args, "rotary_interleaved", False), "--rotary-interleaved", lambda v: not v),
        (getattr(args, "multi_latent_attention", False), "--multi-latent-attention", lambda v: not v),
        (getattr(args, "qk_l2_norm", False), "--qk-l2-norm", lambda v: not v),
        (getattr(args, "apply_layernorm_1p", False), "--apply-layernorm-1p", lambda v: not v),
        (getattr(args, "moe_layer_freq", 1), "--moe-layer-freq {} (every layer must be an MoE layer)",
         lambda v: v == 1 or (isinstance(v, list) and all(f == 1 for f in v))),
        (getattr(args, "moe_router_score_function", "softmax"), "--moe-router-score-function {} (Qwen3-MoE: softmax)",
         lambda v: v == "softmax"),
        (getattr(args, "moe_router_enable_expert_bias", False), "--moe-router-enable-expert-bias", lambda v: not v),
        (getattr(args, "moe_router_topk_scaling_factor", None), "--moe-router-topk-scaling-factor {}",
         lambda v: v is None),
        (getattr(args, "moe_router_num_groups", None), "--moe-router-num-groups {}", lambda v: v is None),
        (getattr(args, "mtp_num_layers", None), "--mtp-num-layers {}", lambda v: not v),
        (getattr(args, "fp16", False), "--fp16 (bf16 or fp32 weights only)", lambda v: not v),
        (getattr(args, "padded_vocab_size", None), "no padded_vocab_size (not a training run's arguments)",
         lambda v: bool(v)),
    ]
    return [what.format(value) for value, what, ok in checks if not ok(value)]


def model_config_from_megatron_lm_args(args: Any) -> PolicyModelConfig:
    """The architecture (``model_config.json`` fields) of the GPT-MoE Megatron-LM's ``args`` train."""
    problems = _not_qwen3_moe(args)
    if problems:
        raise ValueError(
            "this Megatron-LM model has no Qwen3-MoE counterpart, which convert needs: " + "; ".join(problems)
        )
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv = getattr(args, "kv_channels", None)
    return PolicyModelConfig(
        num_layers=args.num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        kv_channels=None if kv is None or kv * heads == hidden else kv,
        ffn_hidden_size=args.ffn_hidden_size,
        num_experts=args.num_experts,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_shared_expert_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        rotary_base=int(getattr(args, "rotary_base", 10000)),
        rms_norm_eps=float(getattr(args, "norm_epsilon", 1e-5)),
        norm_topk_prob=not getattr(args, "moe_router_pre_softmax", False),
        untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        dtype="bf16" if getattr(args, "bf16", False) else "fp32",
        init_method_std=float(getattr(args, "init_method_std", 0.02)),
    )


def megatron_lm_model_config(directory: str | os.PathLike[str]) -> PolicyModelConfig | None:
    """The architecture a Megatron-LM checkpoint's recorded arguments describe; None when it recorded none."""
    args = read_megatron_lm_args(directory)
    if args is None:
        return None
    try:
        return model_config_from_megatron_lm_args(args)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None


def recorded_rac_ratio(directory: str | os.PathLike[str]) -> float | None:
    """The ``--quads-rac-ratio`` a Megatron-LM checkpoint's run was given; None when it has none."""
    args = read_megatron_lm_args(directory)
    return getattr(args, "quads_rac_ratio", None) if args is not None else None
