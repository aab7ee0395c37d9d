"""The weight-sync wire format: stacked expert quantization is today's per-linear quantization, byte for byte."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.scopes import routed_expert_scope
from megatron_quads.rollout.wire import (
    WIRE_FIELDS,
    channel_stacks,
    channels_key,
    decode_wire,
    encode_wire,
    stack_module,
    with_channels,
)

EXPERTS, HIDDEN, FFN = 4, 64, 32


class _Stack:
    """One layer's experts in high precision, and their wire names."""

    def __init__(self, layer: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layer, self.first_expert, self.num_experts = layer, 0, EXPERTS
        self.gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        self.down = torch.randn(EXPERTS, HIDDEN, FFN, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        self.gate_up[1, FFN:] *= 8.0  # expert 1: the amax sits in up, gate must share it
        self.down[2] = 0.0  # an all-zero expert: amax 0

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{stack_module(self.layer, 0, EXPERTS, 'gate_up_proj')}.weight", self.gate_up),
                (f"{stack_module(self.layer, 0, EXPERTS, 'down_proj')}.weight", self.down)]


def _stack(layer: int, seed: int) -> _Stack:
    return _Stack(layer, seed)


def _channels(k: int, count: int, seed: int) -> torch.Tensor:
    """[experts, count] sorted channel sets: expert 0 one aligned block plus scattered channels."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for e in range(EXPERTS):
        if e == 0:
            rest = torch.randperm(k - 16, generator=gen)[: count - 16] + 16
            rows.append(torch.cat([torch.arange(16), rest]).sort().values)
        else:
            rows.append(torch.randperm(k, generator=gen)[:count].sort().values)
    return torch.stack(rows).to(torch.int32)


def _hf_named(stacks: list[_Stack], dense: dict[str, torch.Tensor]):
    yield from dense.items()
    for s in stacks:
        for e in range(s.num_experts):
            base = f"model.layers.{s.layer}.mlp.experts.{s.first_expert + e}"
            yield f"{base}.gate_proj.weight", s.gate_up[e, :FFN].float()
            yield f"{base}.up_proj.weight", s.gate_up[e, FFN:].float()
            yield f"{base}.down_proj.weight", s.down[e].float()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("with_channels", [False, True])
def test_stacked_quantization_equals_quantize_hf_weights_byte_for_byte(with_channels: bool) -> None:
    stacks = [_stack(0, 1), _stack(1, 2)]
    dense = {"model.norm.weight": torch.randn(HIDDEN), "model.layers.0.mlp.gate.weight": torch.randn(EXPERTS, HIDDEN)}
    channels = None
    per_module = None
    if with_channels:
        channels = {channels_key(s.layer, p): _channels(k, 32 if p == "gate_up_proj" else 16, 10 * s.layer + i)
                    for s in stacks for i, (p, k) in enumerate((("gate_up_proj", HIDDEN), ("down_proj", FFN)))}
        per_module = {}
        for s in stacks:
            for e in range(EXPERTS):
                base = f"model.layers.{s.layer}.mlp.experts.{e}"
                per_module[f"{base}.gate_proj"] = per_module[f"{base}.up_proj"] = channels[channels_key(s.layer, "gate_up_proj")][e]
                per_module[f"{base}.down_proj"] = channels[channels_key(s.layer, "down_proj")][e]
    payload = encode_wire([*dense.items(), *(p for st in stacks for p in st.named())], quantized=True, dtype=torch.bfloat16, residual_channels=channels)
    assert f"{stack_module(0, 0, EXPERTS, 'gate_up_proj')}.weight" in payload
    got = decode_wire(payload, quantized=True, weight_version=3)
    expected = quantize_hf_weights(_hf_named(stacks, dense), routed_expert_scope(), per_module, weight_version=3)
    assert got.config == expected.config
    got_tensors, expected_tensors = got.state_dict(), expected.state_dict()
    assert got_tensors.keys() == expected_tensors.keys()
    for name, tensor in expected_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype, name
        assert torch.equal(_raw(got_tensors[name]), _raw(tensor)), name
    if with_channels:
        assert got.residual_fraction > 0.3


def test_bf16_stacks_decode_to_per_expert_views() -> None:
    stack = _stack(3, 4)
    payload = encode_wire(stack.named(), quantized=False, dtype=torch.bfloat16)
    got = decode_wire(payload, quantized=False, weight_version=0)
    assert len(got) == 3 * EXPERTS
    assert torch.equal(got["model.layers.3.mlp.experts.2.up_proj.weight"], stack.gate_up[2, FFN:])
    assert torch.equal(got["model.layers.3.mlp.experts.1.down_proj.weight"], stack.down[1])
    stack.gate_up.zero_()  # the payload is a snapshot
    assert got["model.layers.3.mlp.experts.0.gate_proj.weight"].abs().sum() > 0


def test_non_finite_weights_are_refused_naming_the_stack() -> None:
    stack = _stack(5, 6)
    stack.down[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.5\.mlp\.experts\.0-3\.down_proj"):
        encode_wire(stack.named(), quantized=True, dtype=torch.bfloat16)


def test_damaged_payloads_are_refused_naming_the_tensor() -> None:
    payload = encode_wire(_stack(0, 7).named(), quantized=True, dtype=torch.bfloat16,
                          residual_channels={channels_key(0, "gate_up_proj"): _channels(HIDDEN, 32, 1),
                                             channels_key(0, "down_proj"): _channels(FFN, 16, 2)})
    module = stack_module(0, 0, EXPERTS, "gate_up_proj")
    scales = dict(payload)
    scales[f"{module}.weight_scale"] = payload[f"{module}.weight_scale"].clone()
    scales[f"{module}.weight_scale"].view(torch.uint8)[1, 2, 3] = 0x7F  # a NaN block scale
    with pytest.raises(ValueError, match=rf"{module}\.weight_scale.*NaN"):
        decode_wire(scales, quantized=True, weight_version=0)
    zero = dict(payload)
    zero[f"{module}.weight_scale_2"] = payload[f"{module}.weight_scale_2"].clone()
    zero[f"{module}.weight_scale_2"][3] = 0.0  # expert 3's non-zero weight would decode to zeros
    with pytest.raises(ValueError, match=rf"{module}\.weight_scale_2.*0 beside non-zero block scales"):
        decode_wire(zero, quantized=True, weight_version=0)
    unsorted = dict(payload)
    unsorted[f"{module}.residual_channels"] = payload[f"{module}.residual_channels"].flip(1).contiguous()
    with pytest.raises(ValueError, match=rf"{module}\.residual_channels.*sorted"):
        decode_wire(unsorted, quantized=True, weight_version=0)
    missing = {k: v for k, v in payload.items() if not k.endswith(f"{module}.weight_scale")}
    with pytest.raises(ValueError, match=rf"missing tensor '{module}\.weight_scale'"):
        decode_wire(missing, quantized=True, weight_version=0)
    outside = dict(payload)
    outside[f"{module}.residual_channels"] = payload[f"{module}.residual_channels"] + HIDDEN  # past K
    with pytest.raises(ValueError, match=rf"{module}\.residual_channels.*outside"):
        decode_wire(outside, quantized=True, weight_version=0)
    extra = {**payload, f"{module}.residual_weight": torch.zeros(EXPERTS, 2 * FFN, 16, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=rf"'{module}' has fields \['residual_weight'\] the wire does not carry"):
        decode_wire(extra, quantized=True, weight_version=0)


def test_the_wire_carries_channels_not_w_s() -> None:
    """W_S is rebuilt by the receiver: an NVFP4 stack on the wire is its codes, scales and channels."""
    payload = encode_wire(_stack(0, 7).named(), quantized=True, dtype=torch.bfloat16,
                          residual_channels={channels_key(0, "gate_up_proj"): _channels(HIDDEN, 32, 1),
                                             channels_key(0, "down_proj"): _channels(FFN, 16, 2)})
    module = stack_module(0, 0, EXPERTS, "gate_up_proj")
    assert sorted(k.removeprefix(f"{module}.") for k in payload if k.startswith(module)) == sorted(WIRE_FIELDS)
    assert payload[f"{module}.residual_channels"].shape == (EXPERTS, 32)
    assert decode_wire(payload, quantized=True, weight_version=0).expert_stacks[
        channels_key(0, "gate_up_proj")].residual_weight.shape == (EXPERTS, 2 * FFN, 16)


def test_the_trainer_names_its_stacks_as_the_wire_format_does() -> None:
    from megatron_quads.trainer.hf_export import expert_stack_name

    assert expert_stack_name(3, 64, 64, "down_proj") == f"{stack_module(3, 64, 64, 'down_proj')}.weight"
    assert expert_stack_name(0, 0, 8, "gate_up_proj") == f"{stack_module(0, 0, 8, 'gate_up_proj')}.weight"


def test_payloads_of_several_senders_decode_to_one_model() -> None:
    """Two expert-parallel senders (experts 0-1 and 2-3 of each layer) decode to the weights one
    sender of all four gives; a gap or an overlap between them is an error naming the layer."""
    whole = _stack(0, 9)
    halves = []
    for first in (0, 2):
        halves.append(encode_wire([(f"{stack_module(0, first, 2, 'gate_up_proj')}.weight", whole.gate_up[first : first + 2]),
                                   (f"{stack_module(0, first, 2, 'down_proj')}.weight", whole.down[first : first + 2])],
                                  quantized=True, dtype=torch.bfloat16))
    union = decode_wire({**halves[0], **halves[1]}, quantized=True, weight_version=1)
    single = decode_wire(encode_wire(whole.named(), quantized=True, dtype=torch.bfloat16), quantized=True, weight_version=1)
    assert union.state_dict().keys() == single.state_dict().keys()
    for name, tensor in single.state_dict().items():
        assert torch.equal(_raw(union.state_dict()[name]), _raw(tensor)), name
    assert union.expert_stacks[channels_key(0, "down_proj")].num_experts == EXPERTS
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*leave experts 0\.\.1 out"):
        decode_wire(halves[1], quantized=True, weight_version=1)
    overlap = encode_wire([(f"{stack_module(0, 1, 3, 'gate_up_proj')}.weight", whole.gate_up[1:]),
                           (f"{stack_module(0, 1, 3, 'down_proj')}.weight", whole.down[1:])], quantized=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):
        decode_wire({**halves[0], **overlap}, quantized=True, weight_version=1)


def test_kept_channels_on_a_payload_sent_without_them_decode_as_if_sent_with_them() -> None:
    """An engine's channel sets by checkpoint module, stacked per layer (:func:`channel_stacks`) and
    put on two expert-parallel senders' payloads that carry none (the trainer's export): the decoded
    weights are byte for byte those of a sender that sent the channels (``W_S`` of the new weights)."""
    whole = _stack(0, 11)
    channels = {channels_key(0, "gate_up_proj"): _channels(HIDDEN, 32, 3), channels_key(0, "down_proj"): _channels(FFN, 16, 4)}
    sent_with = decode_wire(encode_wire(whole.named(), quantized=True, dtype=torch.bfloat16, residual_channels=channels),
                            quantized=True, weight_version=1)
    reported = {m: lin.residual_channels for m, lin in sent_with.quantized.items()}  # what an engine reports
    kept = channel_stacks(reported)
    assert kept.keys() == channels.keys() and all(torch.equal(kept[k], channels[k]) for k in channels)
    halves = {}
    for first in (0, 2):
        halves.update(encode_wire([(f"{stack_module(0, first, 2, 'gate_up_proj')}.weight", whole.gate_up[first : first + 2]),
                                   (f"{stack_module(0, first, 2, 'down_proj')}.weight", whole.down[first : first + 2])],
                                  quantized=True, dtype=torch.bfloat16))
    assert all(t.shape[1] == 0 for n, t in halves.items() if n.endswith(".residual_channels"))
    decoded = decode_wire(with_channels(halves, kept), quantized=True, weight_version=1)
    assert decoded.state_dict().keys() == sent_with.state_dict().keys()
    for name, tensor in sent_with.state_dict().items():
        assert torch.equal(_raw(decoded.state_dict()[name]), _raw(tensor)), name
    with pytest.raises(ValueError, match=r"experts\.0-1\.down_proj\.residual_channels': the kept channel sets hold none"):
        with_channels(halves, {channels_key(0, "gate_up_proj"): kept[channels_key(0, "gate_up_proj")]})
    up = "model.layers.0.mlp.experts.1.up_proj"
    with pytest.raises(ValueError, match="gate_proj and up_proj read the same input"):
        channel_stacks({**reported, up: reported[up].flip(0)})
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj' lack experts \[2\]"):
        channel_stacks({m: c for m, c in reported.items() if ".experts.2." not in m})


def test_the_stack_quantizer_holds_one_stack_back_and_gives_what_quantize_stack_gives() -> None:
    from megatron_quads.rollout.expert_stacks import StackQuantizer, quantize_stack

    first, second = _stack(0, 11), _stack(1, 12)
    quantizer = StackQuantizer()
    assert quantizer.add(first.gate_up, key="a") == []  # held back until the next stack arrives
    done = quantizer.add(first.down, key="b") + quantizer.add(second.gate_up, key="c") + quantizer.finish()
    assert [key for key, _ in done] == ["a", "b", "c"] and quantizer.finish() == []
    for (_, got), weight in zip(done, (first.gate_up, first.down, second.gate_up), strict=True):
        expected = quantize_stack(weight)
        for name, tensor in expected.tensors().items():
            raw = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
            assert torch.equal(raw(got.tensors()[name]), raw(tensor)), name
    with pytest.raises(ValueError, match=r"layer 9: a stack is a floating-point \[experts, N, K\]"):
        StackQuantizer().add(torch.zeros(2, 8, 24), what="layer 9")


def test_deferred_finite_checks_name_each_failing_tensor_in_one_read_back() -> None:
    from megatron_quads.rollout.expert_stacks import DeferredChecks

    checks = DeferredChecks()
    checks.add_finite("stack A", torch.tensor([1.0, 2.0]))
    checks.add_finite("stack B", torch.tensor([0.0, float("inf"), 3.0]))
    checks.add_finite("stack C", torch.tensor([float("nan")]))
    checks.add("flag D", torch.tensor([False, False]))
    with pytest.raises(ValueError, match=r"2 check\(s\) failed: stack B, stack C"):
        checks.raise_if_failed()
    checks.add_finite("stack E", torch.tensor([5.0]))
    checks.raise_if_failed()  # every value finite: nothing raised, and the earlier failures are gone
