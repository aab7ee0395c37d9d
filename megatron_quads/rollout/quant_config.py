"""The quant config of a model's NVFP4-plus-residual weights: the dict :class:`QuantizedModelWeights`
carries and the checkpoint's ``hf_quant_config.json`` records (quant algorithm, block size, RAC
ratio, excluded modules, weight version)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatron_quads.precision import Precision
from megatron_quads.rollout import checkpoint_format as fmt

QUANT_CONFIG_KEYS = ("quant_algo", "group_size", "residual_ratio", "exclude_modules", "weight_version")
OPTIONAL_QUANT_CONFIG_KEYS = ("precision",)
"""``precision``: the text form of the rollout :class:`~megatron_quads.precision.Precision` the
weights are made for (weights that came without one serve as their reader derives)."""


def make_quant_config(
    residual_ratio: float = 0.0, exclude_modules: Iterable[str] = (), weight_version: int = 0,
    precision: Precision | str | None = None,
) -> dict[str, Any]:
    """The container's config dict (validated); ``precision`` is recorded in its text form."""
    config = {
        "quant_algo": fmt.QUANT_ALGO,
        "group_size": fmt.GROUP_SIZE,
        "residual_ratio": float(residual_ratio),
        "exclude_modules": list(exclude_modules),
        "weight_version": int(weight_version),
    }
    if precision is not None:
        config["precision"] = str(precision)
    validate_quant_config(config)
    return config


def recorded_precision(config: Mapping[str, Any]) -> Precision | None:
    """The rollout precision a config dict records, or None when it records none."""
    text = config.get("precision")
    return None if text is None else Precision.parse(text, float(config["residual_ratio"]))


def validate_quant_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError naming the key if the config dict is not a valid QUADS NVFP4 config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict with keys {QUANT_CONFIG_KEYS}, got {type(config).__name__}")
    missing = [k for k in QUANT_CONFIG_KEYS if k not in config]
    unknown = [k for k in config if k not in QUANT_CONFIG_KEYS + OPTIONAL_QUANT_CONFIG_KEYS]
    if missing or unknown:
        raise ValueError(f"config has missing keys {missing} / unknown keys {unknown}; expected exactly {QUANT_CONFIG_KEYS}")
    if config["quant_algo"] != fmt.QUANT_ALGO or config["group_size"] != fmt.GROUP_SIZE:
        raise ValueError(
            f"config quant_algo={config['quant_algo']!r}, group_size={config['group_size']!r}; "
            f"this format is quant_algo='{fmt.QUANT_ALGO}', group_size={fmt.GROUP_SIZE}"
        )
    ratio = config["residual_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"config residual_ratio={ratio!r}; expected a fraction of input channels in [0, 1]")
    excl = config["exclude_modules"]
    if not isinstance(excl, list) or not all(isinstance(e, str) and e for e in excl):
        raise ValueError(f"config exclude_modules must be a list of non-empty module names, got {excl!r}")
    version = config["weight_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"config weight_version={version!r}; expected an integer >= 0")
    if "precision" in config:
        precision = recorded_precision(config)
        if not precision.quantized_rollout or (precision.uses_rac and precision.ratio != ratio):
            raise ValueError(f"config precision={config['precision']!r} does not fit NVFP4 weights with residual_ratio={ratio}")
