"""The ``--quads-*`` command-line flags for Megatron-LM (an ``extra_args_provider``); torch-free."""

from __future__ import annotations

import argparse
import math
from typing import Any

from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig

SPEC_MODULE = "megatron_quads.megatron_lm.layer_spec"
SPEC_NAME = "quads_layer_spec"
SPEC = [SPEC_MODULE, SPEC_NAME]
"""What ``--spec`` takes to build QUADS layers (Megatron-LM stores it as this list)."""

BLOCK_LAYOUTS = {"1x16": False, "16x16": True}
"""``--quads-block-layout`` -> ``QuadsTrainerConfig.block_2d``."""


def rac_ratio(text: str) -> float:
    """``--quads-rac-ratio``: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a ratio: give the fraction of each quantized linear's input channels that get a "
            "residual, a number from 0 to 1 (e.g. 0.25)"
        )
    return value


def add_quads_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the QUADS flags to Megatron-LM's argument parser (``pretrain(extra_args_provider=...)``)."""
    group = parser.add_argument_group(title="QUADS (megatron_quads)")
    group.add_argument(
        "--quads", action=argparse.BooleanOptionalAction, default=True,
        help="fake-quantize the weights in --quads-scope to NVFP4 in the forward pass (Asymmetric QAT); "
        "--no-quads builds the stock layers through the same spec",
    )
    group.add_argument(
        "--quads-scope", choices=[s.value for s in QuadsScope], default=QuadsScope.ROUTED_EXPERTS.value,
        help="which linears are fake-quantized; the Transformer Engine spec supports routed_experts and all_linears",
    )
    group.add_argument(
        "--quads-block-layout", choices=list(BLOCK_LAYOUTS), default="1x16",
        help="NVFP4 weight-scale blocks: 1x16 (what vLLM / ModelOpt checkpoints store; keep it) or 16x16 (local spec only)",
    )
    group.add_argument(
        "--quads-rac-ratio", type=rac_ratio, default=None,
        help="RAC residual-channel ratio for the NVFP4 export; training does not use it, it is saved with the "
        "checkpoint's arguments and 'megatron-quads convert to-quads' takes it when --ratio is not given",
    )
    return parser


def quads_config_from_args(args: Any) -> QuadsTrainerConfig:
    """The trainer-side QUADS settings that Megatron-LM's parsed arguments ask for.

    The ``--quads-*`` flags default as :func:`add_quads_args` does when the namespace lacks them
    (a run of the unmodified ``pretrain_gpt.py``); the high-precision first / last layers are
    Megatron-LM's own ``--first-last-layers-bf16``, ``--num-layers-at-start-in-bf16`` and
    ``--num-layers-at-end-in-bf16``.
    """
    scope = getattr(args, "quads_scope", QuadsScope.ROUTED_EXPERTS.value)
    layout = getattr(args, "quads_block_layout", "1x16")
    try:
        scope = QuadsScope(scope)
    except ValueError:
        raise ValueError(
            f"--quads-scope {scope!r} is not a QUADS scope; choose one of {', '.join(s.value for s in QuadsScope)}"
        ) from None
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"--quads-block-layout {layout!r} is not a block layout; choose 1x16 or 16x16")
    ratio = getattr(args, "quads_rac_ratio", None)
    if ratio is not None:
        try:
            rac_ratio(str(ratio))
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"--quads-rac-ratio {err}") from None
    bf16_ends = bool(getattr(args, "first_last_layers_bf16", False))
    return QuadsTrainerConfig(
        enabled=bool(getattr(args, "quads", True)),
        scope=scope,
        block_2d=BLOCK_LAYOUTS[layout],
        bf16_first_layers=int(getattr(args, "num_layers_at_start_in_bf16", 1)) if bf16_ends else 0,
        bf16_last_layers=int(getattr(args, "num_layers_at_end_in_bf16", 1)) if bf16_ends else 0,
    )
