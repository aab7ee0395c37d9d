"""Trainer side of QUADS: Asymmetric QAT layer specs for Megatron-Core MoE, and the policy worker.

The names below are imported on first use, so importing the torch-free
:mod:`megatron_quads.trainer.settings` does not import torch or Megatron-Core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_quads.trainer.fake_quant import invalidate_fake_quant_caches
    from megatron_quads.trainer.quads_config import QuadsScope, QuadsTrainerConfig
    from megatron_quads.trainer.specs import apply_quads, quads_block_spec, quads_layer_spec

_WHERE = {
    "QuadsScope": "quads_config",
    "QuadsTrainerConfig": "quads_config",
    "apply_quads": "specs",
    "invalidate_fake_quant_caches": "fake_quant",
    "quads_block_spec": "specs",
    "quads_layer_spec": "specs",
}
"""Exported name -> the submodule that defines it."""

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
