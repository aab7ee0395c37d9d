"""``config.json`` <-> ``PolicyModelConfig``: the written config keeps the source's form (transformers 5's
``num_local_experts`` / ``rope_parameters``, or the older ``num_experts`` / ``rope_theta``) and changes
only the fields the model says differently; without a source it is written whole."""

from __future__ import annotations

import copy

import pytest

from megatron_quads.trainer.hf_config import UnsupportedModelError, hf_config_from_policy, policy_config_from_hf

TRANSFORMERS_5 = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": 151645,
    "head_dim": 24, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 64, "max_position_embeddings": 64, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 32, "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "5.19.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 96,
}
"""A Qwen3-MoE config.json as transformers 5 writes it."""

TRANSFORMERS_4 = {
    **{k: v for k, v in TRANSFORMERS_5.items() if k not in ("num_local_experts", "rope_parameters", "dtype")},
    "num_experts": 4, "rope_theta": 5000.0, "torch_dtype": "bfloat16", "rope_scaling": None,
}
"""The same model as transformers 4 writes it."""


@pytest.mark.parametrize("source", [TRANSFORMERS_5, TRANSFORMERS_4], ids=["transformers5", "transformers4"])
def test_the_round_trip_gives_the_source_back_key_for_key(source: dict) -> None:
    written = hf_config_from_policy(policy_config_from_hf(source), copy.deepcopy(source))
    assert written == source
    assert list(written) == list(source)


def test_a_changed_field_is_written_under_the_sources_key() -> None:
    model = policy_config_from_hf(TRANSFORMERS_5).model_copy(
        update=dict(num_experts=8, rotary_base=20000, max_sequence_length=128, dtype="fp32"))
    written = hf_config_from_policy(model, TRANSFORMERS_5)
    changed = {k for k in written if written[k] != TRANSFORMERS_5.get(k)}
    assert changed == {"num_local_experts", "rope_parameters", "max_position_embeddings", "dtype"}
    assert written["num_local_experts"] == 8 and "num_experts" not in written
    assert written["rope_parameters"] == {"rope_theta": 20000.0, "rope_type": "default"} and "rope_theta" not in written
    assert written["max_position_embeddings"] == 128 and written["dtype"] == "float32"
    assert policy_config_from_hf(written) == model
    old = hf_config_from_policy(model, TRANSFORMERS_4)
    assert old["num_experts"] == 8 and old["rope_theta"] == 20000.0 and old["torch_dtype"] == "float32"
    assert {"num_local_experts", "rope_parameters", "dtype"}.isdisjoint(old)


def test_what_the_written_weights_are_not_is_dropped() -> None:
    """A quantization_config (the weights are written unquantized) and a scaled RoPE are dropped; a
    config without architectures gets them; defaults the model agrees with are not spelled out."""
    source = {k: v for k, v in TRANSFORMERS_5.items()
              if k not in ("architectures", "decoder_sparse_step", "mlp_only_layers", "head_dim")}
    model = policy_config_from_hf(source)
    scaled = {**source, "quantization_config": {"quant_method": "modelopt"},
              "rope_parameters": {"rope_theta": 5000.0, "rope_type": "yarn", "factor": 4.0}}
    written = hf_config_from_policy(model, scaled)
    assert "quantization_config" not in written and "rope_parameters" not in written
    assert written["rope_theta"] == 5000.0 and written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert {"decoder_sparse_step", "mlp_only_layers", "head_dim"}.isdisjoint(written)
    assert policy_config_from_hf(written) == model


def test_without_a_source_every_field_is_written() -> None:
    model = policy_config_from_hf(TRANSFORMERS_5)
    written = hf_config_from_policy(model)
    assert written == hf_config_from_policy(model, {})
    assert written["num_experts"] == 4 and written["rope_theta"] == 5000.0 and written["dtype"] == "bfloat16"
    assert {"num_local_experts", "rope_parameters", "bos_token_id"}.isdisjoint(written)
    assert policy_config_from_hf(written) == model


def test_a_model_qwen3_moe_cannot_hold_is_refused_with_or_without_a_source() -> None:
    model = policy_config_from_hf(TRANSFORMERS_5).model_copy(update=dict(moe_shared_expert_size=16))
    for base in (None, TRANSFORMERS_5):
        with pytest.raises(UnsupportedModelError, match="shared expert"):
            hf_config_from_policy(model, base)
