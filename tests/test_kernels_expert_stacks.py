"""The Triton kernels of the stacked expert export (per-expert amax, W_S re-blocking) equal the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.backend import reference_path
from megatron_quads.nvfp4.global_scale import global_amax_from_decode_scale
from megatron_quads.nvfp4.quantize_kernel import leading_amax_kernel
from megatron_quads.nvfp4.reblock import reblock_columns, reblock_columns_deferred
from megatron_quads.nvfp4.reblock_kernel import reblock_columns_kernel
from megatron_quads.nvfp4.stacked import expert_weight
from megatron_quads.nvfp4.tensor import NVFP4Tensor
from megatron_quads.rollout.expert_stacks import expert_amax

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1


def _stacked(n: int, rows: int, k: int) -> NVFP4Tensor:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, rows, k, generator=gen) * torch.logspace(-3, 1, n)[:, None, None]
    w[1] = 0.0  # amax 0
    w[0, 3, :16] = 0.0  # one all-zero block
    amax = w.abs().amax(dim=(1, 2))
    q = quantize(w, global_amax=amax[:, None])
    return NVFP4Tensor(q.codes, q.scales, q.weight_scale_2.reshape(n), torch.Size((n, rows, k)), torch.float32)


def _channels(n: int, k: int, count: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    sets = []
    for e in range(n):
        if count == k:
            sets.append(torch.arange(k))
        elif e == 0:  # two aligned blocks among scattered channels
            rest = torch.randperm(k - 48, generator=gen)[: count - 32] + 48
            sets.append(torch.cat([torch.arange(16), torch.arange(32, 48), rest]).sort().values)
        else:
            sets.append(torch.randperm(k, generator=gen)[:count].sort().values)
    return torch.stack(sets).to(torch.int32)


@pytest.mark.parametrize("shape", [(3, 20, 64, 48), (2, 16, 256, 256)])
def test_reblock_kernel_equals_the_reference_byte_for_byte(shape: tuple[int, int, int, int]) -> None:
    n, rows, k, count = shape
    q = _stacked(n, rows, k)
    channels = _channels(n, k, count)
    with reference_path():
        reference, no_amax = reblock_columns_deferred(q, channels)
        ref_codes, ref_scales = reference.codes, reference.scales
        assert not no_amax.any()
        for e in range(n):  # the stacked reference is the per-linear one
            single = reblock_columns(expert_weight(q, e), channels[e])
            assert torch.equal(single.codes, ref_codes[e])
            assert torch.equal(single.scales.view(torch.uint8), ref_scales[e].view(torch.uint8))
    amax, missing = global_amax_from_decode_scale(q.weight_scale_2)
    assert not missing.any()
    got_codes, got_scales = reblock_columns_kernel(q.codes.to(DEVICE), q.scales.to(DEVICE), q.weight_scale_2.to(DEVICE),
                                                    amax.to(DEVICE), channels.to(DEVICE))
    assert torch.equal(got_codes.cpu(), ref_codes)
    assert torch.equal(got_scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
    if count == k:  # every channel: W_S is q(W) itself
        assert torch.equal(got_codes.cpu(), q.codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the channels live on the host, the weight on a CUDA device")
def test_reblock_takes_host_channels_for_a_gpu_weight() -> None:
    """Channels chosen on the host (RAC calibration's selection) re-block a weight on the GPU: the
    kernel path moves them to the weight's device and gives the reference's bytes."""
    q = _stacked(2, 16, 256)
    channels = _channels(2, 256, 64)
    with reference_path():
        reference = reblock_columns(expert_weight(q, 0), channels[0])
    on_gpu = NVFP4Tensor(q.codes.cuda(), q.scales.cuda(), q.weight_scale_2.cuda(), q.shape, q.dtype)
    got = reblock_columns(expert_weight(on_gpu, 0), channels[0])  # channels stay on the host
    assert got.codes.device.type == "cuda"
    assert torch.equal(got.codes.cpu(), reference.codes)
    assert torch.equal(got.scales.cpu().view(torch.uint8), reference.scales.view(torch.uint8))


def test_leading_amax_is_each_experts_max_and_shows_nan() -> None:
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(5, 24, 80, generator=gen) * torch.logspace(-4, 2, 5)[:, None, None]).to(torch.bfloat16)
    w[2] = 0.0
    w[3, 7, 9] = float("nan")
    got = leading_amax_kernel(w.to(DEVICE)).cpu()
    ref = expert_amax(w)  # the reference path on CPU
    assert torch.equal(got[[0, 1, 2, 4]], ref[[0, 1, 2, 4]]) and got[2] == 0.0
    assert torch.isnan(got[3]) and torch.isnan(ref[3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the export's kernels dispatch on CUDA tensors only")
def test_the_export_on_the_gpu_equals_quantize_hf_weights_on_the_cpu() -> None:
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.scopes import routed_expert_scope
    from megatron_quads.rollout.wire import channels_key, decode_wire, encode_wire, stack_module

    gen = torch.Generator().manual_seed(3)
    n, ffn, hidden = 8, 96, 256
    gate_up = (torch.randn(n, 2 * ffn, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(n, hidden, ffn, generator=gen) * 0.02).to(torch.bfloat16)
    channels = {channels_key(0, "gate_up_proj"): _channels(n, hidden, 128), channels_key(0, "down_proj"): _channels(n, ffn, 48)}
    stack = [(f"{stack_module(0, 0, n, 'gate_up_proj')}.weight", gate_up.cuda()),
             (f"{stack_module(0, 0, n, 'down_proj')}.weight", down.cuda())]
    got = decode_wire(encode_wire(stack, True, torch.bfloat16, {k: v.cuda() for k, v in channels.items()}), True, 0)
    named, per_module = [], {}
    for e in range(n):
        base = f"model.layers.0.mlp.experts.{e}"
        named += [(f"{base}.gate_proj.weight", gate_up[e, :ffn].float()), (f"{base}.up_proj.weight", gate_up[e, ffn:].float()),
                  (f"{base}.down_proj.weight", down[e].float())]
        per_module[f"{base}.gate_proj"] = per_module[f"{base}.up_proj"] = channels[channels_key(0, "gate_up_proj")][e]
        per_module[f"{base}.down_proj"] = channels[channels_key(0, "down_proj")][e]
    expected = quantize_hf_weights(named, routed_expert_scope(), per_module).state_dict()
    for name, tensor in got.state_dict().items():
        raw = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
        assert torch.equal(raw(tensor).cpu(), raw(expected[name])), name


@pytest.mark.parametrize("shapes", [((3, 20, 64), (5, 24, 80)), ((4, 48, 768), (2, 96, 256)), ((2, 7, 48), (1, 16))])
def test_quantizing_one_stack_while_taking_the_next_ones_amax_equals_the_two_kernels(shapes) -> None:
    from megatron_quads.nvfp4.quantize_kernel import quantize_kernel, quantize_stack_and_amax

    (n, rows, k), other_shape = shapes
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(n, rows, k, generator=gen) * torch.logspace(-3, 1, n)[:, None, None]).to(torch.bfloat16).to(DEVICE)
    w[1] = 0.0
    other = torch.randn(*other_shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    other.view(-1)[5] = float("nan")
    amax = leading_amax_kernel(w)
    got, next_amax = quantize_stack_and_amax(w, amax, other)
    expected = quantize_kernel(w, amax[:, None], validate=False)
    assert torch.equal(got.codes, expected.codes)
    assert torch.equal(got.scales.view(torch.uint8), expected.scales.view(torch.uint8))
    assert torch.equal(got.weight_scale_2, expected.weight_scale_2)
    reference = leading_amax_kernel(other)
    assert torch.equal(next_amax.nan_to_num(-1.0), reference.nan_to_num(-1.0)) and torch.isnan(next_amax[0])
