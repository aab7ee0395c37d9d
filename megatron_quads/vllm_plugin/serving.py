"""What the QUADS vLLM plugin serves: the precision of the linears in scope and the RAC ratio.

Read from the checkpoint's ``quads`` config block and overridable by the environment variable
``MEGATRON_QUADS_VLLM_PRECISION`` (``quads``, ``quads@<ratio>``, ``w4a4`` or ``w4a16``), which every
process vLLM starts inherits. This module imports no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_quads.rollout.checkpoint_format import FORMAT_VERSION, GROUP_SIZE, QUANT_ALGO
from megatron_quads.rollout.precision import Precision
from megatron_quads.rollout.rac import num_residual_channels

QUANT_NAME = "quads_nvfp4"
"""The quantization method name the plugin registers with vLLM."""

PRECISION_ENV = "MEGATRON_QUADS_VLLM_PRECISION"
SERVED_PRECISIONS = ("quads", "w4a4", "w4a16")
_KIND = {"quads": "quads", "w4a4": "w4a4", "w4a16": "aqat"}


@dataclass(frozen=True)
class ServingConfig:
    """How the plugin computes the quantized linears of one checkpoint.

    ``precision``: quads (W4A4 + RAC), w4a4 or w4a16; ``ratio``: the RAC ratio (quads only: each
    linear with K inputs holds ``num_residual_channels(K, ratio)`` residual channels);
    ``exclude_modules``: ModelOpt's list of unquantized modules; ``input_scales``: whether the
    checkpoint stores a static ``input_scale`` per linear; ``residual_tensors``: whether it stores
    the ``residual_*`` tensors."""

    precision: str
    ratio: float
    exclude_modules: tuple[str, ...]
    input_scales: bool
    residual_tensors: bool

    def __post_init__(self) -> None:
        if self.precision not in SERVED_PRECISIONS:
            raise ValueError(f"the QUADS plugin serves {SERVED_PRECISIONS}, not {self.precision!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"the RAC ratio must be in [0, 1], got {self.ratio}")

    @property
    def linear_precision(self) -> Precision:
        """The project's precision of the linears in scope (w4a16 is the ``aqat`` product ``x q(W)^T``)."""
        return Precision(_KIND[self.precision], self.ratio if self.precision == "quads" else 0.0)

    def residual_channels(self, in_features: int) -> int:
        """Residual channels held per linear with ``in_features`` inputs (0 unless quads)."""
        return num_residual_channels(in_features, self.ratio) if self.precision == "quads" else 0


def parse_precision(text: str) -> tuple[str, float | None]:
    """``"quads@0.25"`` -> ``("quads", 0.25)``; ``"w4a4"`` -> ``("w4a4", None)``."""
    name, _, ratio = text.strip().partition("@")
    if name not in SERVED_PRECISIONS or (ratio and name != "quads"):
        raise ValueError(f"{PRECISION_ENV}={text!r}: expected one of quads, quads@<ratio>, w4a4, w4a16")
    try:
        return name, float(ratio) if ratio else None
    except ValueError:
        raise ValueError(f"{PRECISION_ENV}={text!r}: the ratio after '@' must be a number in [0, 1]") from None


def is_modelopt_nvfp4(config: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's quantization config (flat or nested) is ModelOpt NVFP4."""
    nested = config.get("quantization")
    algo = (nested if isinstance(nested, Mapping) else config).get("quant_algo")
    return isinstance(algo, str) and algo.upper() == QUANT_ALGO


def serving_config(config: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> ServingConfig:
    """The :class:`ServingConfig` of a checkpoint's quantization config (``config.json``'s flat
    ``quantization_config`` or ``hf_quant_config.json``'s nested layout), with the environment's
    override; raises ``ValueError`` naming the key that is wrong."""
    nested = config.get("quantization")
    body = nested if isinstance(nested, Mapping) else config
    if str(body.get("quant_algo", "")).upper() != QUANT_ALGO:
        raise ValueError(f"quantization_config.quant_algo is {body.get('quant_algo')!r}; the QUADS plugin serves {QUANT_ALGO!r}")
    group = body.get("group_size", GROUP_SIZE)
    if group != GROUP_SIZE:
        raise ValueError(f"quantization_config.group_size is {group!r}; NVFP4 uses blocks of {GROUP_SIZE}")
    excludes = body.get("exclude_modules", body.get("ignore", config.get("ignore"))) or []
    quads = config.get("quads")
    if quads is None:  # a plain ModelOpt NVFP4 checkpoint: W4A4 with static input scales
        precision, ratio, input_scales, residual = "w4a4", 0.0, True, False
    else:
        if not isinstance(quads, Mapping) or quads.get("version") != FORMAT_VERSION:
            version = quads.get("version") if isinstance(quads, Mapping) else quads
            raise ValueError(f"quantization_config.quads.version is {version!r}; this plugin reads version {FORMAT_VERSION} "
                             "(docs/format.md): re-export the checkpoint with this release of megatron_quads")
        residual = bool(quads.get("residual_tensors", True))
        ratio = float(quads.get("residual_ratio", 0.0))
        precision = str(quads.get("precision", "quads" if residual else "w4a4"))
        input_scales = bool(quads.get("input_scales", False))
    if environ.get(PRECISION_ENV):
        precision, override_ratio = parse_precision(environ[PRECISION_ENV])
        ratio = ratio if override_ratio is None else override_ratio
    return ServingConfig(precision, ratio, tuple(excludes), input_scales, residual)
