"""A model's NVFP4-plus-residual rollout weights: :class:`QuantizedModelWeights` (quantized linears by
module name, the other tensors, the quant config) and :class:`LazyLinears` (linears built on first
access, for weights that arrive as expert stacks)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.expert_stacks import StackedLinearWeight
from megatron_quads.rollout.quant_config import make_quant_config, validate_quant_config
from megatron_quads.rollout.quantized_linear import (
    FIELD_SPECS,
    ChannelsLike,
    QuantizedLinearWeight,
    ScaleLike,
    input_scale_from_amax,
)
from megatron_quads.rollout.scopes import shared_scale_group, vllm_excludes, vllm_prefixes

_FP8 = torch.float8_e4m3fn


def _check_unquantized(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"unquantized tensor '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in fmt.UNQUANTIZED_DTYPES:
        hint = ""
        if t.dtype in (torch.uint8, _FP8):
            hint = (
                f" ({t.dtype} suggests quantized data: is '{fmt.split_tensor_name(name)[0]}' missing its "
                f"{fmt.WEIGHT_SCALE} / {fmt.WEIGHT_SCALE_2} tensors?)"
            )
        allowed = ", ".join(str(d) for d in fmt.UNQUANTIZED_DTYPES)
        raise ValueError(f"unquantized tensor '{name}' has dtype {t.dtype}; expected one of {allowed}{hint}")
    if fmt.split_tensor_name(name)[1] in fmt.QUANTIZED_ONLY_LEAVES:
        raise ValueError(
            f"unquantized tensor '{name}' ends in '.{fmt.split_tensor_name(name)[1]}', a name reserved for quantized "
            "modules; rename it"
        )


class LazyLinears(Mapping[str, "QuantizedLinearWeight"]):
    """Quantized linears by module name, whose objects are built by ``build`` on the first access to
    a value: names, membership and length need no objects (a weight sync's engine that holds experts
    stacked never asks for them)."""

    def __init__(self, names: Sequence[str], build: Callable[[], dict[str, QuantizedLinearWeight]]) -> None:
        self._names, self._known = list(names), frozenset(names)
        self._build: Callable[[], dict[str, QuantizedLinearWeight]] | None = build
        self._linears: dict[str, QuantizedLinearWeight] = {}

    def _built(self) -> dict[str, QuantizedLinearWeight]:
        if self._build is not None:
            self._linears, self._build = self._build(), None
        return self._linears

    def __getitem__(self, module: str) -> QuantizedLinearWeight:
        return self._built()[module]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, module: object) -> bool:
        return module in self._known


@dataclass(eq=False)
class QuantizedModelWeights:
    """A model's rollout weights: quantized linears by HF module name, other tensors by HF tensor name.

    Attributes:
        quantized: ``{module name: QuantizedLinearWeight}``, e.g. ``model.layers.3.mlp.experts.7.gate_proj``.
        unquantized: ``{tensor name: tensor}`` kept in high precision (norms, embeddings, router,
            attention when not in scope), bf16 unless built otherwise.
        config: ``quant_algo`` ("NVFP4"), ``group_size`` (16), ``residual_ratio`` (the RAC ratio),
            ``exclude_modules`` (ModelOpt's list of modules left unquantized), ``weight_version``.
        expert_stacks: each MoE layer's projection (``model.layers.L.mlp.experts.gate_up_proj`` or
            ``...down_proj``) as one :class:`StackedLinearWeight` when the weights arrived
            stacked (the weight sync): the expert linears in ``quantized`` view them. Empty otherwise;
            not part of the checkpoint, and dropped by every method that returns new weights.
    """

    quantized: Mapping[str, QuantizedLinearWeight]
    unquantized: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=make_quant_config)
    expert_stacks: dict[str, StackedLinearWeight] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Validate the config, names, dtypes and cross-module rules."""
        self._validate(shared_scales=True)

    @classmethod
    def from_checked_linears(
        cls, quantized: dict[str, QuantizedLinearWeight], unquantized: dict[str, torch.Tensor], config: dict[str, Any],
        expert_stacks: dict[str, StackedLinearWeight] | None = None,
    ) -> QuantizedModelWeights:
        """Build from linears whose fused siblings already share one ``weight_scale_2`` tensor (views
        of the checked ``expert_stacks``): every rule but that value comparison is checked. For
        :class:`LazyLinears` (built from stacks, without input scales) only the rules on names are."""
        weights = object.__new__(cls)
        weights.quantized, weights.unquantized, weights.config = quantized, unquantized, config
        weights.expert_stacks = dict(expert_stacks or {})
        weights._validate(shared_scales=False, per_linear=not isinstance(quantized, LazyLinears))
        return weights

    def _validate(self, shared_scales: bool, per_linear: bool = True) -> None:
        validate_quant_config(self.config)
        for module in self.quantized:
            if not isinstance(module, str) or not module:
                raise ValueError(f"quantized module names must be non-empty strings, got {module!r}")
        if per_linear:
            for module, lin in self.quantized.items():
                if not isinstance(lin, QuantizedLinearWeight):
                    raise TypeError(f"quantized['{module}'] must be a QuantizedLinearWeight, got {type(lin).__name__}")
        reserved_leaves = {*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES}
        for name, t in self.unquantized.items():
            _check_unquantized(name, t)
            module, leaf = fmt.split_tensor_name(name)
            if leaf in reserved_leaves and module in self.quantized:
                raise ValueError(f"unquantized tensor '{name}' collides with a tensor of quantized module '{module}'")
        if per_linear:
            self._check_input_scales()
        if shared_scales:
            self._check_shared_scales()
        self._check_excludes()

    def _check_input_scales(self) -> None:
        have = [m for m, lin in self.quantized.items() if lin.input_scale is not None]
        if have and len(have) != len(self.quantized):
            lacking = next(m for m, lin in self.quantized.items() if lin.input_scale is None)
            raise ValueError(
                f"'{have[0]}' has an input_scale but '{lacking}' has none: give every quantized module a static "
                "input_scale, or none (dynamic activation scales)"
            )

    def _check_shared_scales(self) -> None:
        first: dict[str, str] = {}
        for module, lin in self.quantized.items():
            group = shared_scale_group(module)
            if group is None:
                continue
            other = first.setdefault(group[0], module)
            if other != module and not torch.equal(lin.weight_scale_2, self.quantized[other].weight_scale_2):
                raise ValueError(
                    f"'{other}' and '{module}' have different weight_scale_2 ({float(self.quantized[other].weight_scale_2)!r} "
                    f"vs {float(lin.weight_scale_2)!r}); engines fuse them and keep one: quantize both with one "
                    "global_amax (the max of their amaxes), as quantize_hf_weights does"
                )

    def _check_excludes(self) -> None:
        entries = self.config["exclude_modules"]
        prefixes = {p: m for m in self.quantized for p in vllm_prefixes(m)}
        for prefix, module in prefixes.items():
            hit = next((e for e in entries if vllm_excludes(prefix, e)), None)
            if hit is not None:
                raise ValueError(
                    f"quantized module '{module}' is matched by exclude_modules entry '{hit}' (vLLM checks "
                    f"'{prefix}' by exact, substring and wildcard match) and would be loaded as unquantized"
                )

    @property
    def input_scales(self) -> bool:
        """Whether the quantized modules carry static activation scales."""
        return any(lin.input_scale is not None for lin in self.quantized.values())

    @property
    def residual_fraction(self) -> float:
        """``sum |S| / sum K`` over the quantized modules (0 when there are none)."""
        total = sum(lin.in_features for lin in self.quantized.values())
        return sum(lin.num_residual_channels for lin in self.quantized.values()) / total if total else 0.0

    def state_dict(self, include_residual: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor by checkpoint name: quantized modules' tensors, then the unquantized ones."""
        out: dict[str, torch.Tensor] = {}
        for module, lin in self.quantized.items():
            out.update(lin.state_dict(module, include_residual))
        out.update(self.unquantized)
        return out

    @classmethod
    def from_state_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        residual_tensors: bool = True,
        input_scales: bool | None = None,
    ) -> QuantizedModelWeights:
        """Rebuild from checkpoint tensors; a missing, misshapen or mistyped tensor raises ValueError naming it.

        A module is quantized when any of its quantized-only tensors is present. ``residual_tensors``
        and ``input_scales`` (None: either) say which optional tensors every quantized module must have.
        """
        modules: dict[str, set[str]] = {}
        for name in tensors:
            module, leaf = fmt.split_tensor_name(name)
            if module and leaf in fmt.QUANTIZED_ONLY_LEAVES:
                modules.setdefault(module, set()).add(leaf)
        required = [fmt.WEIGHT, fmt.WEIGHT_SCALE, fmt.WEIGHT_SCALE_2] + (list(fmt.RESIDUAL_LEAVES) if residual_tensors else [])
        if input_scales:
            required.append(fmt.INPUT_SCALE)
        forbidden = ([] if residual_tensors else list(fmt.RESIDUAL_LEAVES)) + ([fmt.INPUT_SCALE] if input_scales is False else [])
        quantized: dict[str, QuantizedLinearWeight] = {}
        for module, leaves in modules.items():
            present = sorted(leaves | ({fmt.WEIGHT} if fmt.tensor_name(module, fmt.WEIGHT) in tensors else set()))
            for leaf in required:
                if fmt.tensor_name(module, leaf) not in tensors:
                    raise ValueError(
                        f"checkpoint is missing tensor '{module}.{leaf}' ({FIELD_SPECS[leaf]}) of quantized module "
                        f"'{module}' (it has: {', '.join(present)}); the checkpoint is incomplete: re-export it"
                    )
            for leaf in forbidden:
                if leaf in leaves:
                    raise ValueError(
                        f"checkpoint has tensor '{module}.{leaf}' but its config says there are no '{leaf}' tensors; "
                        "the config and the tensors disagree: re-export the checkpoint"
                    )
            quantized[module] = QuantizedLinearWeight.from_state_dict(tensors, module)
        taken = {fmt.tensor_name(m, leaf) for m in quantized for leaf in (*fmt.MODELOPT_LEAVES, *fmt.RESIDUAL_LEAVES)}
        unquantized = {name: t for name, t in tensors.items() if name not in taken}
        return cls(quantized=quantized, unquantized=unquantized, config=dict(config))

    def with_residual_channels(
        self, channels: Mapping[str, ChannelsLike | None], weight_version: int | None = None
    ) -> QuantizedModelWeights:
        """A copy with new channel sets for the named modules (others keep theirs); ``q(W)`` is not re-quantized."""
        unknown = [m for m in channels if m not in self.quantized]
        if unknown:
            raise ValueError(f"residual channels given for {len(unknown)} module(s) that are not quantized, e.g. '{unknown[0]}'")
        quantized = dict(self.quantized)
        for module, ch in channels.items():
            try:
                quantized[module] = quantized[module].with_residual_channels(ch)
            except ValueError as err:
                raise ValueError(f"{module}: {err}") from err
        config = dict(self.config)
        if weight_version is not None:
            config["weight_version"] = weight_version
        return QuantizedModelWeights(quantized=quantized, unquantized=dict(self.unquantized), config=config)

    def with_input_amax(self, input_amax: Mapping[str, ScaleLike] | None) -> QuantizedModelWeights:
        """A copy with static activation scales ``input_scale = amax / 2688`` (``input_amax`` names
        every quantized module, as :func:`quantize_hf_weights` requires), or none for ``None``."""
        quantized = {}
        for module, lin in self.quantized.items():
            if input_amax is not None and module not in input_amax:
                raise ValueError(f"input_amax has no entry for quantized module '{module}'; give one for every quantized module")
            try:
                scale = None if input_amax is None else input_scale_from_amax(input_amax[module])
            except ValueError as err:
                raise ValueError(f"{module}: {err}") from err
            quantized[module] = lin.with_input_scale(scale)
        return QuantizedModelWeights(quantized=quantized, unquantized=dict(self.unquantized), config=dict(self.config))

    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(lin.nbytes() for lin in self.quantized.values()) + sum(
            t.numel() * t.element_size() for t in self.unquantized.values()
        )
