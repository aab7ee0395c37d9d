"""Hugging Face ``config.json`` (Qwen3-MoE) <-> :class:`PolicyModelConfig`.

The converters support the architecture the trainer builds: a Qwen3-MoE decoder whose every layer
is a routed-expert MoE (no dense-MLP layers, no shared expert), RMSNorm, SwiGLU, default RoPE,
no attention bias, no sliding window. Anything else is refused with the field that differs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from megatron_quads.trainer.settings import PolicyModelConfig

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the converters map."""


def _first(doc: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if doc.get(key) is not None:
            return doc[key]
    return default


def _require(doc: Mapping[str, Any], *keys: str) -> Any:
    value = _first(doc, *keys)
    if value is None:
        raise UnsupportedModelError(f"config.json has no {' / '.join(keys)}; it is not a complete Qwen3-MoE config")
    return value


def rope_theta(doc: Mapping[str, Any]) -> float:
    """The RoPE base of a config (``rope_theta`` or transformers 5's ``rope_parameters``); refuses scaled RoPE."""
    params = doc.get("rope_parameters") or {}
    scaling = doc.get("rope_scaling")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if scaling or rope_type != "default":
        raise UnsupportedModelError(
            f"config.json asks for RoPE scaling ({scaling or rope_type}); the trainer builds default RoPE only"
        )
    return float(_first(params, "rope_theta", default=None) or _first(doc, "rope_theta", default=10000.0))


def _check_supported(doc: Mapping[str, Any]) -> None:
    architectures = doc.get("architectures") or []
    model_type = doc.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or any(a not in SUPPORTED_ARCHITECTURES for a in architectures):
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or model_type!r} (model_type {model_type!r}): the converters map "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(SUPPORTED_MODEL_TYPES)}) only"
        )
    checks = {
        "mlp_only_layers": (doc.get("mlp_only_layers") or [], [], "every layer must be an MoE layer"),
        "decoder_sparse_step": (doc.get("decoder_sparse_step", 1), 1, "every layer must be an MoE layer"),
        "attention_bias": (bool(doc.get("attention_bias", False)), False, "attention projections have no bias"),
        "hidden_act": (doc.get("hidden_act", "silu"), "silu", "experts are SwiGLU"),
        "use_sliding_window": (bool(doc.get("use_sliding_window", False)), False, "attention is global"),
    }
    for key, (found, wanted, rule) in checks.items():
        if found != wanted:
            raise UnsupportedModelError(f"config.json has {key} = {found!r}; the trainer's model needs {wanted!r} ({rule})")


def policy_config_from_hf(doc: Mapping[str, Any], max_sequence_length: int | None = None) -> PolicyModelConfig:
    """The trainer's architecture for a Qwen3-MoE ``config.json``; :class:`UnsupportedModelError` otherwise."""
    _check_supported(doc)
    dtype_name = str(_first(doc, "dtype", "torch_dtype", default="bfloat16")).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise UnsupportedModelError(f"config.json dtype {dtype_name!r}: the trainer holds bfloat16 or float32 weights")
    heads = int(_require(doc, "num_attention_heads"))
    hidden = int(_require(doc, "hidden_size"))
    return PolicyModelConfig(
        num_layers=int(_require(doc, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(_first(doc, "num_key_value_heads", default=heads)),
        kv_channels=int(_first(doc, "head_dim", default=hidden // heads)),
        ffn_hidden_size=int(_first(doc, "intermediate_size", default=4 * hidden)),
        num_experts=int(_require(doc, "num_experts", "num_local_experts")),
        moe_ffn_hidden_size=int(_require(doc, "moe_intermediate_size")),
        moe_router_topk=int(_require(doc, "num_experts_per_tok")),
        vocab_size=int(_require(doc, "vocab_size")),
        max_sequence_length=int(max_sequence_length or _first(doc, "max_position_embeddings", default=4096)),
        qk_layernorm=True,
        rotary_base=int(rope_theta(doc)),
        rms_norm_eps=float(_first(doc, "rms_norm_eps", default=1e-6)),
        norm_topk_prob=bool(_first(doc, "norm_topk_prob", default=False)),
        untie_embeddings=not bool(doc.get("tie_word_embeddings", False)),
        dtype=_DTYPES[dtype_name],
    )


def hf_config_from_policy(model: PolicyModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as Qwen3-MoE.

    With ``base`` (the source model's config), the result is ``base`` in its own form (its key names:
    ``num_local_experts`` or ``num_experts``, ``rope_parameters`` or ``rope_theta``, ``dtype`` or
    ``torch_dtype``; its key order; its other fields) with only the architecture fields that read
    differently from ``model`` rewritten, a missing ``architectures`` added, and ``quantization_config``
    and a RoPE scaling dropped (the weights written are unquantized, the RoPE is default). Without
    ``base``, every architecture field is written from ``model``."""
    if model.moe_shared_expert_size:
        raise UnsupportedModelError("Qwen3-MoE has no shared expert: a model with moe_shared_expert_size cannot be exported")
    if not model.qk_layernorm:
        raise UnsupportedModelError("Qwen3-MoE normalises queries and keys: a model without qk_layernorm cannot be exported")
    if base:
        return _config_in_base_form(model, base)
    heads = model.num_attention_heads
    return dict(
        architectures=list(SUPPORTED_ARCHITECTURES),
        model_type=SUPPORTED_MODEL_TYPES[0],
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=model.num_query_groups or heads,
        head_dim=model.kv_channels or model.hidden_size // heads,
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        norm_topk_prob=model.norm_topk_prob,
        rms_norm_eps=model.rms_norm_eps,
        rope_theta=float(model.rotary_base),
        tie_word_embeddings=not model.untie_embeddings,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        max_position_embeddings=model.max_sequence_length,
        dtype=_dtype_name(model),
    )


def _dtype_name(model: PolicyModelConfig) -> str:
    return "bfloat16" if model.dtype == "bf16" else "float32"


def _architecture_fields(model: PolicyModelConfig) -> list[tuple[tuple[str, ...], Any, Any]]:
    """``(the keys that may hold it, first one read first; model's value; what a config without it
    means)`` for every architecture field but dtype and the RoPE base, as :func:`policy_config_from_hf`
    reads them."""
    heads, hidden = model.num_attention_heads, model.hidden_size
    return [
        (("architectures",), list(SUPPORTED_ARCHITECTURES), None),
        (("model_type",), SUPPORTED_MODEL_TYPES[0], None),
        (("vocab_size",), model.vocab_size, None),
        (("hidden_size",), hidden, None),
        (("intermediate_size",), model.ffn_hidden_size, 4 * hidden),
        (("moe_intermediate_size",), model.moe_ffn_hidden_size, None),
        (("num_hidden_layers",), model.num_layers, None),
        (("num_attention_heads",), heads, None),
        (("num_key_value_heads",), model.num_query_groups or heads, heads),
        (("head_dim",), model.kv_channels or hidden // heads, hidden // heads),
        (("num_experts", "num_local_experts"), model.num_experts, None),
        (("num_experts_per_tok",), model.moe_router_topk, None),
        (("norm_topk_prob",), model.norm_topk_prob, False),
        (("rms_norm_eps",), model.rms_norm_eps, 1e-6),
        (("tie_word_embeddings",), not model.untie_embeddings, False),
        (("decoder_sparse_step",), 1, 1),
        (("mlp_only_layers",), [], []),
        (("hidden_act",), "silu", "silu"),
        (("attention_bias",), False, False),
        (("use_sliding_window",), False, False),
        (("max_position_embeddings",), model.max_sequence_length, 4096),
    ]


def _config_in_base_form(model: PolicyModelConfig, base: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with the fields that read differently from ``model`` rewritten under base's own key."""
    doc = copy.deepcopy(dict(base))
    doc.pop("quantization_config", None)
    if doc.get("rope_scaling") is not None:
        doc.pop("rope_scaling")
    for keys, value, default in _architecture_fields(model):
        key = next((k for k in keys if doc.get(k) is not None), keys[0])
        if (default if doc.get(key) is None else doc[key]) != value:
            doc[key] = value
    dtype_key = next((k for k in ("dtype", "torch_dtype") if doc.get(k) is not None), "dtype")
    if str(doc.get(dtype_key, "bfloat16")).removeprefix("torch.") != _dtype_name(model):
        doc[dtype_key] = _dtype_name(model)
    params = doc.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
        del doc["rope_parameters"]  # a scaled RoPE is not the model's
        params = None
    if rope_theta(doc) != float(model.rotary_base):
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            params["rope_theta"] = float(model.rotary_base)
        else:
            doc["rope_theta"] = float(model.rotary_base)
    return doc
