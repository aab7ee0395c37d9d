"""The weight-sync wire format: what a trainer rank sends to rollout engines, and its decoding.

A sender's payload is one ``{name: tensor}`` dict:

- every tensor that is not a routed expert under its Hugging Face name, in the run's dtype;
- each MoE layer's routed experts ``[first, last]`` that the sender holds as stacks, under
  ``model.layers.<L>.mlp.experts.<first>-<last>.<projection>.<field>`` with ``projection``
  ``gate_up_proj`` (``[n, 2I, H]``: every expert's gate rows, then its up rows) or ``down_proj``
  (``[n, H, I]``). In BF16 the field is ``weight``; in NVFP4 the fields are :data:`WIRE_FIELDS`
  (codes, block scales, one decode scale per expert, and the RAC channels). ``W_S`` is not sent:
  the receiver re-blocks it from ``q(W)`` and the channels on its own device, byte for byte what the
  sender would have made, so the wire carries only the format's main tensors and the channel sets.

:func:`encode_wire` builds a payload from the trainer's export; :func:`decode_wire` turns the union
of every sender's payloads into what engines load (BF16 tensors by HF name, or a
:class:`~megatron_quads.rollout.model_weights.QuantizedModelWeights` whose expert linears are views
of the stacks, which it keeps as ``expert_stacks`` for engines that hold experts stacked). Neither
reads a value on the host per tensor: each checks its values once per payload. The trainer's export
sends no channels (``[n, 0]``); an engine that keeps the channel sets of its last RAC calibration
puts them on each payload it receives (:func:`with_channels`) before decoding it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from megatron_quads.precision import Precision
from megatron_quads.rollout.expert_stacks import (
    DeferredChecks,
    StackedLinearWeight,
    StackQuantizer,
    check_stack_fields,
    rebuild_residual,
)
from megatron_quads.rollout.model_weights import LazyLinears, QuantizedModelWeights
from megatron_quads.rollout.quant_config import make_quant_config
from megatron_quads.rollout.quantized_linear import QuantizedLinearWeight
from megatron_quads.rollout.scopes import excluded_modules
from megatron_quads.rollout.stored_scales import invalid_block_scales, invalid_decode_scales

PROJECTIONS = ("gate_up_proj", "down_proj")
_LINEARS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""The checkpoint linears of each stacked projection, in the order of the stack's rows."""
WIRE_FIELDS = ("weight", "weight_scale", "weight_scale_2", "residual_channels")
"""The fields of an NVFP4 expert stack on the wire (``W_S`` is rebuilt by the receiver)."""
_STACK_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)-(\d+)\.(gate_up_proj|down_proj)\.(\w+)$")
_EXPERT_LINEAR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def stack_module(layer: int, first: int, count: int, projection: str) -> str:
    """The wire module name of experts ``[first, first + count)`` of one layer's projection."""
    return f"model.layers.{layer}.mlp.experts.{first}-{first + count - 1}.{projection}"


def is_stack_name(name: str) -> bool:
    """Whether ``name`` is a tensor of an expert stack (:func:`stack_module`)."""
    return _STACK_NAME.match(name) is not None


def channels_key(layer: int, projection: str) -> str:
    """Key of one layer's projection in a residual-channel mapping (``[experts, |S|]`` per key)."""
    return f"model.layers.{layer}.mlp.experts.{projection}"


def encode_wire(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    quantized: bool,
    dtype: torch.dtype,
    residual_channels: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """A sender's payload from ``(name, tensor)`` pairs: HF-named tensors, and expert stacks named
    ``<stack_module(...)>.weight`` (the trainer's export). Tensors are copied, so later updates of the
    trainer's parameters do not reach the payload. ``quantized``: stacks in NVFP4 (else ``dtype``).

    ``residual_channels`` maps :func:`channels_key` to every expert's sorted channels ``[experts,
    |S|]`` (the stack's rows are taken); without it there are none.
    """
    out: dict[str, torch.Tensor] = {}
    checks = DeferredChecks()
    quantizer = StackQuantizer(checks)

    def store(done: list[tuple[object, StackedLinearWeight]]) -> None:
        for (module, device, channels), stack in done:
            fields = {"weight": stack.weight, "weight_scale": stack.weight_scale, "weight_scale_2": stack.weight_scale_2,
                      "residual_channels": stack.residual_channels if channels is None
                      else channels.to(device=device, dtype=torch.int32)}
            check_stack_fields(fields, f"{module}.", WIRE_FIELDS)
            out.update({f"{module}.{f}": t for f, t in fields.items()})

    for name, tensor in named_tensors:
        match = _STACK_NAME.match(name)
        if match is not None and match.group(5) != "weight":
            raise ValueError(f"'{name}': a high-precision expert stack is named '<stack module>.weight'")
        if match is None or not quantized:
            out[name] = tensor.detach().to(dtype, copy=True).contiguous()
            continue
        layer, first, last, projection, _ = match.groups()
        module = name.rpartition(".")[0]
        channels = None
        if residual_channels is not None:
            channels = residual_channels[channels_key(int(layer), projection)][int(first) : int(last) + 1]
        store(quantizer.add(tensor.detach(), None, what=module, key=(module, tensor.device, channels)))
    store(quantizer.finish())
    checks.raise_if_failed()
    return out


def channel_stacks(sets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert channel sets by checkpoint module (``model.layers.<L>.mlp.experts.<e>.<linear>``, as
    the engines report them) as the wire's per-layer form: :func:`channels_key` -> int32 ``[experts,
    |S|]`` (gate_up_proj: the set gate_proj and up_proj share). Sets that do not cover experts
    0..E-1 of a layer, or a gate and up set that differ, raise ValueError."""
    by_key: dict[str, dict[int, torch.Tensor]] = {}
    for module, channels in sets.items():
        match = _EXPERT_LINEAR.match(module)
        if match is None:
            raise ValueError(f"'{module}' is not a routed expert's linear (model.layers.<L>.mlp.experts.<e>.<linear>)")
        layer, expert, linear = int(match.group(1)), int(match.group(2)), match.group(3)
        per_expert = by_key.setdefault(channels_key(layer, "down_proj" if linear == "down_proj" else "gate_up_proj"), {})
        if expert in per_expert and not torch.equal(per_expert[expert], channels):
            raise ValueError(f"'{module}': gate_proj and up_proj read the same input, so they need the same channels")
        per_expert[expert] = channels
    out = {}
    for key, per_expert in by_key.items():
        missing = sorted(set(range(max(per_expert) + 1)) - set(per_expert))
        if missing:
            raise ValueError(f"the channel sets of '{key}' lack experts {missing[:8]}: every expert 0..E-1 needs one")
        out[key] = torch.stack([per_expert[e].to(torch.int32) for e in range(len(per_expert))])
    return out


def with_channels(tensors: Mapping[str, torch.Tensor], channels: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A received payload whose NVFP4 stacks carry ``channels`` (:func:`channel_stacks` form) instead
    of the channels they were sent with: :func:`decode_wire` then re-blocks ``W_S`` from the payload's
    ``q(W)`` on them. A stack whose projection ``channels`` lacks or does not cover raises ValueError."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        match = _STACK_NAME.match(name)
        if match is None or match.group(5) != "residual_channels":
            continue
        layer, first, last, projection, _ = match.groups()
        kept = channels.get(channels_key(int(layer), projection))
        if kept is None or kept.shape[0] <= int(last):
            held = "none" if kept is None else f"{kept.shape[0]} experts"
            raise ValueError(f"'{name}': the kept channel sets hold {held} for this layer's projection; the stack "
                             f"holds experts {first}..{last}")
        out[name] = kept[int(first) : int(last) + 1].to(device=tensor.device, dtype=torch.int32)
    return out


def _value_checks(fields: Mapping[str, torch.Tensor], module: str, checks: DeferredChecks) -> None:
    """Flag what the per-linear checks of the format would reject, for a whole stack at once."""
    in_features = 2 * fields["weight"].shape[2]
    scales = fields["weight_scale"]
    checks.add(f"'{module}.weight_scale' (negative or NaN block scales)", invalid_block_scales(scales))
    ws2 = fields["weight_scale_2"]
    nonzero = scales.view(torch.uint8).ne(0).reshape(ws2.numel(), -1).any(dim=1).reshape(ws2.shape)
    checks.add(f"'{module}.weight_scale_2' (not finite and >= 0, or 0 beside non-zero block scales)",
               invalid_decode_scales(ws2, nonzero))
    ch = fields["residual_channels"]
    if ch.shape[1]:
        bad = (ch < 0) | (ch >= in_features)
        checks.add(f"'{module}.residual_channels' (outside [0, K={in_features}))", bad)
        checks.add(f"'{module}.residual_channels' (not sorted and unique per expert)", ch[:, 1:] <= ch[:, :-1])


def _layer_stack(parts: list[tuple[int, int, dict[str, torch.Tensor]]], module: str) -> dict[str, torch.Tensor]:
    """One layer's projection from its senders' stacks ``(first, count, wire fields)``: they must cover
    experts ``0..E-1`` once, in order (a single stack is kept as it is, several are concatenated)."""
    parts = sorted(parts, key=lambda p: p[0])
    expected = 0
    for first, count, _ in parts:
        if first != expected:
            problem = "overlap" if first < expected else f"leave experts {expected}..{first - 1} out"
            raise ValueError(f"the expert stacks of '{module}' {problem}: every expert must arrive exactly once")
        expected = first + count
    if len(parts) == 1:
        return parts[0][2]
    return {f: torch.cat([fields[f] for _, _, fields in parts]) for f in WIRE_FIELDS}


def decode_wire(
    tensors: Mapping[str, torch.Tensor], quantized: bool, weight_version: int, precision: Precision | None = None
) -> QuantizedModelWeights | dict[str, torch.Tensor]:
    """The union of every sender's payload as engines load it: BF16 tensors by HF name, or (``quantized``)
    a QuantizedModelWeights whose expert linears view each layer's stacks (kept in its
    ``expert_stacks``, with ``W_S`` re-blocked here from ``q(W)`` and the channels), whose config
    records ``precision`` (the rollout precision they are for, and its RAC ratio). A stack whose
    fields do not fit, or hold values NVFP4 cannot (checked once for the whole payload), and experts
    that arrive twice or not at all raise ValueError naming them."""
    dense: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _STACK_NAME.match(name)
        if match is None:
            dense[name] = tensor
        else:
            stacks.setdefault(name.rpartition(".")[0], {})[match.group(5)] = tensor
    checks = DeferredChecks(hint="the payload is damaged or was not made by the weight-sync export (encode_wire)")
    by_layer: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
    for module, fields in stacks.items():
        layer, first, last, projection, _ = _STACK_NAME.match(f"{module}.weight").groups()
        first, count = int(first), int(last) - int(first) + 1
        if not quantized:
            if set(fields) != {"weight"}:
                raise ValueError(f"BF16 expert stack '{module}' has fields {sorted(fields)}; expected only 'weight'")
            _split_dense(fields["weight"], f"model.layers.{layer}.mlp.experts", first, count, projection, module, dense)
            continue
        unexpected = sorted(set(fields) - set(WIRE_FIELDS))
        if unexpected:
            raise ValueError(f"NVFP4 expert stack '{module}' has fields {unexpected} the wire does not carry; "
                             f"expected {list(WIRE_FIELDS)} (W_S is rebuilt by the receiver)")
        check_stack_fields(fields, f"{module}.", WIRE_FIELDS)
        n, rows = fields["weight"].shape[:2]
        if n != count:
            raise ValueError(f"'{module}.weight' holds {n} experts; its name says {count}")
        if projection == "gate_up_proj" and rows % 2:
            raise ValueError(f"'{module}.weight' has {rows} rows; gate_up stacks hold 2 * ffn rows")
        _value_checks(fields, module, checks)
        by_layer.setdefault(channels_key(int(layer), projection), []).append((first, count, fields))
    if not quantized:
        return dense
    checks.raise_if_failed()  # channels are sorted, unique and inside [0, K) before W_S is gathered with them
    layer_stacks = {key: rebuild_residual(**_layer_stack(parts, key), checks=checks) for key, parts in by_layer.items()}
    checks.raise_if_failed()
    modules = {key: [[f"{key.rsplit('.', 1)[0]}.{e}.{name}" for name in _LINEARS[key.rsplit('.', 1)[1]]]
                     for e in range(stack.num_experts)] for key, stack in layer_stacks.items()}

    def expert_linears() -> dict[str, QuantizedLinearWeight]:
        return {name: lin for key, stack in layer_stacks.items()
                for names, parts in zip(modules[key], stack.expert_linears(len(_LINEARS[key.rsplit(".", 1)[1]])), strict=True)
                for name, lin in zip(names, parts, strict=True)}

    linears = LazyLinears([name for per_expert in modules.values() for names in per_expert for name in names], expert_linears)
    ratio = precision.ratio if precision is not None else 0.0
    config = make_quant_config(ratio, excluded_modules(linears, dense), weight_version, precision)
    return QuantizedModelWeights.from_checked_linears(linears, dense, config, expert_stacks=layer_stacks)


def _split_dense(weight: torch.Tensor, base: str, first: int, count: int, projection: str, module: str,
                 out: dict[str, torch.Tensor]) -> None:
    """Per-expert HF tensors (views) of a BF16 stack."""
    if weight.ndim != 3 or weight.shape[0] != count:
        raise ValueError(f"'{module}.weight' has shape {tuple(weight.shape)}; expected [{count}, N, K]")
    names = ("down_proj",) if projection == "down_proj" else ("gate_proj", "up_proj")
    per_part = [part.unbind(0) for part in weight.chunk(len(names), dim=1)]
    for p, name in enumerate(names):
        out.update({f"{base}.{first + i}.{name}.weight": t for i, t in enumerate(per_part[p])})
