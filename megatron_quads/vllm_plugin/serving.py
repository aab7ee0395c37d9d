"""What the QUADS vLLM plugin serves: the precision of the linears in scope and the RAC ratio.

Read from the checkpoint's ``quads`` config block (its ``precision``, the text form of
:class:`~megatron_quads.precision.Precision`, which the rollout engines record;
a checkpoint without one is served as ``quads`` when it stores residual tensors, else ``w4a4``). The
environment variable ``MEGATRON_QUADS_VLLM_PRECISION`` (``quads``, ``quads@<ratio>``, ``w4a4`` or
``w4a16``) overrides it, for serving a checkpoint someone else wrote another way. This module
imports no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_quads.precision import Precision
from megatron_quads.rollout.checkpoint_format import FORMAT_VERSION, GROUP_SIZE, QUANT_ALGO
from megatron_quads.rollout.rac import num_residual_channels

QUANT_NAME = "quads_nvfp4"
"""The quantization method name the plugin registers with vLLM."""

PRECISION_ENV = "MEGATRON_QUADS_VLLM_PRECISION"
"""The override of a checkpoint's recorded precision (its text form)."""


@dataclass(frozen=True)
class ServingConfig:
    """How the plugin computes the quantized linears of one checkpoint.

    ``precision``: an NVFP4 rollout precision (w4a16, w4a4 or quads at its RAC ratio: each linear
    with K inputs holds ``num_residual_channels(K, ratio)`` residual channels);
    ``exclude_modules``: ModelOpt's list of unquantized modules; ``input_scales``: whether the
    checkpoint stores a static ``input_scale`` per linear; ``residual_tensors``: whether it stores
    the ``residual_*`` tensors."""

    precision: Precision
    exclude_modules: tuple[str, ...]
    input_scales: bool
    residual_tensors: bool

    def __post_init__(self) -> None:
        if not self.precision.quantized_rollout:
            raise ValueError(f"the QUADS plugin serves NVFP4 precisions (w4a16, w4a4, quads), not {self.precision}")

    def residual_channels(self, in_features: int) -> int:
        """Residual channels held per linear with ``in_features`` inputs (0 unless quads)."""
        return num_residual_channels(in_features, self.precision.ratio) if self.precision.uses_rac else 0


def parse_precision(text: str, default_ratio: float = 0.0) -> Precision:
    """The served precision of an override (``"quads@0.25"``, ``"w4a16"``; ``quads`` alone keeps
    ``default_ratio``); raises ValueError naming :data:`PRECISION_ENV`."""
    try:
        precision = Precision.parse(text, default_ratio)
    except ValueError as err:
        raise ValueError(f"{PRECISION_ENV}: {err}") from None
    if not precision.quantized_rollout:
        raise ValueError(f"{PRECISION_ENV}={text!r}: the QUADS plugin serves quads, quads@<ratio>, w4a4 or w4a16")
    return precision


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
        precision, ratio, input_scales, residual = Precision("w4a4"), 0.0, True, False
    else:
        if not isinstance(quads, Mapping) or quads.get("version") != FORMAT_VERSION:
            version = quads.get("version") if isinstance(quads, Mapping) else quads
            raise ValueError(f"quantization_config.quads.version is {version!r}; this plugin reads version {FORMAT_VERSION} "
                             "(docs/format.md): re-export the checkpoint with this release of megatron_quads")
        residual = bool(quads.get("residual_tensors", True))
        ratio = float(quads.get("residual_ratio", 0.0))
        recorded = quads.get("precision", "quads" if residual else "w4a4")
        try:
            precision = Precision.parse(str(recorded), ratio)
        except ValueError as err:
            raise ValueError(f"quantization_config.quads.precision: {err}") from None
        input_scales = bool(quads.get("input_scales", False))
    if environ.get(PRECISION_ENV):
        precision = parse_precision(environ[PRECISION_ENV], ratio)
    return ServingConfig(precision, tuple(excludes), input_scales, residual)
