"""A run's numerics as one frozen value, decided once from the run config and carried everywhere.

:class:`Precision` says what the trainer and the rollout compute for the linears in scope:

| field | values | meaning |
|---|---|---|
| ``kind`` | ``bf16``, ``w4a16``, ``w4a4``, ``quads`` | the rollout's linears: ``x W^T``; ``x q(W)^T``; ``q(x) q(W)^T``; ``[q(x), q(r_S)] [q(W), W_S]^T`` |
| ``ratio`` | ``[0, 1]``, ``quads`` only | the RAC residual-channel ratio |
| ``trainer_fake_quant`` | bool | the trainer computes ``x q(W)^T`` (AQAT, "aqat") instead of ``x W^T`` |
| ``trainer_block_2d`` | bool | the trainer's fake-quant uses 16x16 weight blocks instead of 1x16 |
| ``scope`` | :data:`SCOPES` | which linears are quantized |

The text form (``str(precision)``, :meth:`Precision.parse`) names the rollout: ``bf16``, ``w4a16``,
``w4a4``, ``quads`` or ``quads@<ratio>``; labels, metrics, checkpoints' ``quads.precision`` and the
vLLM plugin's override variable use it. This module imports nothing of the package and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

RolloutKind = Literal["bf16", "w4a16", "w4a4", "quads"]
ROLLOUT_KINDS: tuple[str, ...] = get_args(RolloutKind)
"""The rollout's precision of the linears in scope, from high to low (``quads`` adds RAC to ``w4a4``)."""

ConfigMode = Literal["bf16", "naive-nvfp4", "w4a16", "aqat", "quads"]
"""The run config's ``precision.mode``: trainer and rollout together (:data:`CONFIG_MODES`)."""

TRAINER_FAKE_QUANT = "aqat"
"""The name of the trainer's NVFP4 fake-quant forward (Asymmetric QAT) in labels and pair names."""

SCOPES: dict[str, str] = {
    "routed_experts": "the routed experts' linears",
    "experts": "the routed and shared experts' linears",
    "routed_experts_and_attention": "the routed experts' linears and the attention projections (q/k/v/o)",
    "experts_and_attention": "the routed and shared experts' linears and the attention projections (q/k/v/o)",
    "all_linears": "every transformer linear, dense MLPs included",
}
"""Every scope name and the linears it covers; the trainer, the converter and the engines use these
names only, each with this meaning. Router, embeddings, output layer and norms are never in scope."""

CONFIG_MODES: dict[ConfigMode, tuple[RolloutKind, bool]] = {
    "bf16": ("bf16", False),
    "naive-nvfp4": ("w4a4", False),
    "w4a16": ("w4a16", True),
    "aqat": ("w4a4", True),
    "quads": ("quads", True),
}
"""``precision.mode`` of the run config -> (rollout kind, trainer fake-quant)."""


@dataclass(frozen=True)
class Precision:
    """What trainer and rollout compute for the linears in scope (module docstring). Construction
    validates: an unknown kind or scope, a ratio outside [0, 1], or a ratio on a kind other than
    ``quads`` raises ValueError."""

    kind: RolloutKind = "bf16"
    ratio: float = 0.0
    trainer_fake_quant: bool = False
    trainer_block_2d: bool = False
    scope: str = "routed_experts"

    def __post_init__(self) -> None:
        if self.kind not in ROLLOUT_KINDS:
            raise ValueError(f"unknown rollout precision {self.kind!r}; choose one of {ROLLOUT_KINDS}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, int | float) or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"the RAC ratio must be a number in [0, 1], got {self.ratio!r}")
        if self.ratio and self.kind != "quads":
            raise ValueError(f"a RAC ratio ({self.ratio}) is for the quads precision only, not {self.kind!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; choose one of {tuple(SCOPES)}")
        object.__setattr__(self, "ratio", float(self.ratio))

    @classmethod
    def from_config_mode(cls, mode: str, rac_ratio: float, **trainer: bool | str) -> Precision:
        """The precision of a run config's ``precision.mode`` (:data:`CONFIG_MODES`); ``rac_ratio``
        counts for ``quads`` only. ``trainer``: ``trainer_block_2d`` / ``scope``."""
        if mode not in CONFIG_MODES:
            raise ValueError(f"unknown precision mode {mode!r}; choose one of {tuple(CONFIG_MODES)}")
        kind, fake_quant = CONFIG_MODES[mode]
        return cls(kind, rac_ratio if kind == "quads" else 0.0, trainer_fake_quant=fake_quant, **trainer)

    @classmethod
    def parse(cls, text: str, default_ratio: float = 0.0) -> Precision:
        """The rollout precision of a text form (``"quads@0.25"``, ``"w4a4"``); ``quads`` without a
        ratio takes ``default_ratio``."""
        name, at, ratio = text.strip().partition("@")
        if name not in ROLLOUT_KINDS or (at and name != "quads"):
            raise ValueError(f"precision {text!r}: expected one of {', '.join(ROLLOUT_KINDS)} or quads@<ratio>")
        try:
            value = float(ratio) if at else (default_ratio if name == "quads" else 0.0)
        except ValueError:
            raise ValueError(f"precision {text!r}: the ratio after '@' must be a number in [0, 1]") from None
        return cls(name, value)

    def __str__(self) -> str:
        """The text form :meth:`parse` reads back exactly."""
        return f"quads@{self.ratio!r}" if self.kind == "quads" else self.kind

    @property
    def label(self) -> str:
        """The rollout's short name for tables and plots (``quads@0.25``, ratio to 3 digits)."""
        return f"quads@{self.ratio:.3g}" if self.kind == "quads" else self.kind

    @property
    def trainer_label(self) -> str:
        """The trainer's forward: ``aqat`` (fake-quant) or ``bf16``."""
        return TRAINER_FAKE_QUANT if self.trainer_fake_quant else "bf16"

    @property
    def quantized_rollout(self) -> bool:
        """Whether the rollout holds the linears in scope as NVFP4."""
        return self.kind != "bf16"

    @property
    def quantized_activations(self) -> bool:
        """Whether the rollout quantizes the inputs of the linears in scope (W4A4, with or without RAC)."""
        return self.kind in ("w4a4", "quads")

    @property
    def uses_rac(self) -> bool:
        """Whether the rollout adds Residual Activation Compensation (``quads``)."""
        return self.kind == "quads"

    @property
    def weight_format(self) -> Literal["bf16", "nvfp4"]:
        """The rollout's weight format of the linears in scope (also what the weight sync sends)."""
        return "nvfp4" if self.quantized_rollout else "bf16"

    @property
    def activation_format(self) -> Literal["bf16", "nvfp4"]:
        """The rollout's activation format at the inputs of the linears in scope."""
        return "nvfp4" if self.quantized_activations else "bf16"

    def rollout(self) -> Precision:
        """The rollout part alone (kind and ratio; trainer fields at their defaults), as a checkpoint
        or a served model records it."""
        return Precision(self.kind, self.ratio, scope=self.scope)
