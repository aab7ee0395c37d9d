"""What the QUADS vLLM plugin serves, from a checkpoint's quantization config (no vLLM needed)."""

from __future__ import annotations

import pytest

from megatron_quads.precision import Precision
from megatron_quads.rollout.checkpoint_format import hf_quant_config, quads_block, quantization_config_block
from megatron_quads.vllm_plugin.serving import PRECISION_ENV, is_modelopt_nvfp4, parse_precision, serving_config

EXCLUDE = ["lm_head", "model.layers.0.mlp.gate"]


def _quads(**overrides) -> dict:
    block = quads_block(residual_ratio=0.25, weight_version=3, residual_tensors=True, input_scales=False,
                        num_quantized_modules=6, num_unquantized_tensors=4)
    return {**block, **overrides}


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_a_quads_checkpoint_is_served_as_quads_at_its_ratio(layout: str) -> None:
    config = (quantization_config_block(EXCLUDE, _quads()) if layout == "flat" else hf_quant_config(EXCLUDE, _quads()))
    serving = serving_config(config, environ={})
    assert (serving.precision, serving.exclude_modules) == (Precision("quads", 0.25), tuple(EXCLUDE))
    assert serving.precision.label == "quads@0.25"
    assert (serving.residual_channels(128), serving.residual_channels(64)) == (32, 16)


def test_the_environment_overrides_precision_and_ratio() -> None:
    config = quantization_config_block(EXCLUDE, _quads())
    assert serving_config(config, {PRECISION_ENV: "w4a16"}).precision == Precision("w4a16")
    assert serving_config(config, {PRECISION_ENV: "quads"}).precision == Precision("quads", 0.25)
    assert serving_config(config, {PRECISION_ENV: "w4a4"}).residual_channels(128) == 0
    assert serving_config(config, {PRECISION_ENV: "quads@0.5"}).residual_channels(128) == 64
    with pytest.raises(ValueError, match="expected one of bf16, w4a16, w4a4, quads or quads@<ratio>"):
        serving_config(config, {PRECISION_ENV: "w8a8"})
    with pytest.raises(ValueError, match="ratio after '@'"):
        parse_precision("quads@half")


def test_a_plain_modelopt_checkpoint_is_w4a4_with_static_input_scales() -> None:
    config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDE}
    assert is_modelopt_nvfp4(config) and is_modelopt_nvfp4({"quantization": {"quant_algo": "NVFP4"}})
    assert not is_modelopt_nvfp4({"quant_algo": "FP8"})
    serving = serving_config(config, environ={})
    assert (serving.precision, serving.input_scales, serving.residual_tensors) == (Precision("w4a4"), True, False)


def test_a_checkpoint_without_residual_tensors_defaults_to_w4a4() -> None:
    serving = serving_config(quantization_config_block(EXCLUDE, _quads(residual_tensors=False)), environ={})
    assert serving.precision == Precision("w4a4")


@pytest.mark.parametrize("recorded", ["w4a16", "w4a4", "quads@0.5"])
def test_the_checkpoints_recorded_precision_is_served_without_the_environment(recorded: str) -> None:
    serving = serving_config(quantization_config_block(EXCLUDE, _quads(precision=recorded)), environ={})
    assert serving.precision == Precision.parse(recorded)
    assert serving.residual_channels(128) == (64 if recorded == "quads@0.5" else 0)


def test_the_environment_overrides_the_recorded_precision() -> None:
    config = quantization_config_block(EXCLUDE, _quads(precision="w4a16"))
    assert serving_config(config, {PRECISION_ENV: "quads"}).precision == Precision("quads", 0.25)


def test_the_plugin_refuses_bf16_and_a_bad_recorded_precision() -> None:
    with pytest.raises(ValueError, match="serves quads, quads@<ratio>, w4a4 or w4a16"):
        serving_config(quantization_config_block(EXCLUDE, _quads()), {PRECISION_ENV: "bf16"})
    with pytest.raises(ValueError, match="quads.precision: precision 'aqat'"):
        serving_config(quantization_config_block(EXCLUDE, _quads(precision="aqat")), environ={})


@pytest.mark.parametrize("config, message", [
    ({"quant_algo": "FP8", "quads": _quads()}, "quant_algo is 'FP8'"),
    ({"quant_algo": "NVFP4", "group_size": 32, "quads": _quads()}, "group_size is 32"),
    ({"quant_algo": "NVFP4", "quads": _quads(version=2)}, "quads.version is 2; this plugin reads version 1"),
    ({"quant_algo": "NVFP4", "quads": _quads(residual_ratio=1.5)}, r"ratio must be a number in \[0, 1\]"),
])
def test_bad_configs_fail_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serving_config(config, environ={})
