"""The warp-specialized Gluon grouped W4A16 kernel (``w4a16_ws``) against the fp64 oracle.

Bit for bit on inputs whose fp32 sums are exact, within the fp32 accumulation bound on realistic
and raw weights, outputs NaN-poisoned; here x goes in already in the kernel's K order, as the engine passes it. Persistent
programs walk many (expert, N tile) pairs through one ring, so a config with 3 programs makes every
program wrap the ring at uneven points. Gluon kernels need the GPU; the argument checks and the
offline sm_90 compile of each config run on CPU.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from test_kernels_w4a16 import (
    _activations,
    _assert_within,
    _gaussian_weight,
    _grid_activations,
    _grouped_oracle,
    _raw_weight,
    _tolerance,
    _with_ws2,
    assert_grouped_exact,
)

from megatron_quads.nvfp4 import NVFP4Tensor
from megatron_quads.kernels import w4a16, w4a16_ws
from megatron_quads.kernels.code_orders import ordered_weight
from megatron_quads.rollout.grouped import expert_offsets_from_counts

CONFIGS: list[dict[str, Any]] = [
    {},  # the defaults: 2 MMA warpgroups, two 128-wide sub-steps a ring stage, 2 CTAs an SM
    {"BLOCK_K": 128},  # one sub-step a stage (K not a multiple of 256)
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_M": 16, "STAGES": 2, "CTAS_PER_SM": 2, "maxnreg": 128},
    {"BLOCK_N": 256, "num_warps": 16, "BLOCK_K": 128, "BLOCK_M": 32, "STAGES": 3, "CTAS_PER_SM": 1, "maxnreg": 0},
    {"BLOCK_K": 128, "BLOCK_M": 64, "STAGES": 6, "PROGRAMS": 3, "maxnreg": 0},
    {"BLOCK_K": 128, "BLOCK_M": 128, "STAGES": 2, "PROGRAMS": 5, "maxnreg": 0},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 128, "STAGES": 3, "CTAS_PER_SM": 3, "maxnreg": 80},
    {"BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 256, "BLOCK_M": 32, "STAGES": 3, "PROGRAMS": 7},
    {"BLOCK_K": 256, "BLOCK_N": 128, "num_warps": 8, "BLOCK_M": 32, "STAGES": 2, "PROGRAMS": 3},
    {"BLOCK_K": 128, "BLOCK_M": 64, "STAGES": 5, "PROGRAMS": 3, "maxnreg": 0},
    {"DYNAMIC": 1},  # tiles handed out by the shared counter
    {"DYNAMIC": 1, "BLOCK_K": 128, "BLOCK_M": 64, "STAGES": 3, "PROGRAMS": 3, "maxnreg": 0},
    {"DYNAMIC": 1, "BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 256, "BLOCK_M": 32, "STAGES": 3, "PROGRAMS": 7},
    {"WG_SPLIT": 1},  # each MMA warpgroup its own partition
    {"WG_SPLIT": 1, "BLOCK_K": 128, "DYNAMIC": 0, "BLOCK_M": 64, "STAGES": 3, "PROGRAMS": 3},
    {"A_PIPE": 1, "BLOCK_K": 256, "STAGES": 2, "DYNAMIC": 1},  # a sub-step dequantized while the last one's wgmma run
    {"A_PIPE": 1, "BLOCK_K": 256, "BLOCK_M": 64, "STAGES": 3},
    {"A_PIPE": 1, "BLOCK_K": 256, "WG_SPLIT": 1},
    {"A_PIPE": 1, "BLOCK_N": 64, "num_warps": 4, "BLOCK_K": 256, "BLOCK_M": 32, "STAGES": 3, "PROGRAMS": 7},
]


def _grouped_cases(big_expert_rows: int = 70) -> list[tuple[list[int], int, int]]:
    """(tokens per expert, N, K): empty experts, one expert with everything (``big_expert_rows``:
    several token tiles), E = 1, N not a multiple of the tile, and Qwen3-30B-A3B gate/up routing of
    512 tokens (top-8 of 128 experts, skewed)."""
    routed = torch.distributions.Categorical(logits=torch.randn(128) * 1.5).sample((512 * 8,))
    return [([3, 0, 17, 5], 40, 256), ([0, 0, big_expert_rows, 0], 24, 512), ([7], 72, 256),
            (torch.bincount(routed, minlength=128).tolist(), 1536, 2048), ([0] * 15 + [200], 768 + 40, 2048)]


def _check_grouped_exact(run: Callable[[torch.Tensor, object, list[int]], torch.Tensor],
                        cases: list[tuple[list[int], int, int]], device: str) -> None:
    """``run(x, weight, counts)`` bit for bit on every case, inputs whose fp32 sums are exact."""
    for counts, n, k in cases:
        weight = _raw_weight((len(counts), n, k), device, scale_bytes=(0x28, 0x4F))
        x = _grid_activations((sum(counts), k), torch.bfloat16, device, bound=1)
        assert_grouped_exact(run(x, weight, counts), x, weight, counts)


def _check_grouped_within_fp32_bound(run: Callable[[torch.Tensor, object, list[int]], torch.Tensor],
                                    cases: list[tuple[list[int], int, int]], device: str, ws2_layout: str) -> None:
    """``run(x, weight, counts)`` within the fp32 accumulation bound on every case, Gaussian and raw
    weights with ``weight_scale_2`` laid out as ``ws2_layout``."""
    for counts, n, k in cases:
        for weight in (_gaussian_weight((len(counts), n, k), device), _raw_weight((len(counts), n, k), device)):
            weight = _with_ws2(weight, ws2_layout)
            x = _activations((sum(counts), k), torch.bfloat16, device)
            exact, magnitude = _grouped_oracle(x, weight, counts)
            _assert_within(run(x, weight, counts), exact, _tolerance(exact, magnitude, k, torch.bfloat16))


def _on_gpu(test: Callable) -> Callable:
    """A GPU test of a Gluon kernel: the Triton interpreter cannot run Gluon, so it is skipped
    without a CUDA device even under ``TRITON_INTERPRET=1``."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="Gluon kernels need a CUDA GPU")(test))


def _config_id(config: dict[str, Any]) -> str:
    return "-".join(f"{k[0]}{k[-1]}{v}" for k, v in config.items()) or "default"


def _cases() -> list[tuple[list[int], int, int]]:
    """The Gluon grouped kernels' cases, the big expert with 300 rows: several tiles of 128 tokens."""
    return _grouped_cases(big_expert_rows=300)


def _run(x: torch.Tensor, weight, counts: list[int], config: dict[str, Any], y_mma_order: bool = False) -> torch.Tensor:
    """The kernel on x put in its K order, into a NaN-filled output."""
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(x.device)
    out = torch.full((x.shape[0], weight.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    ordered = w4a16.mma_k_order_rows(x, w4a16.X_ORDER_BLOCK_K)
    assert w4a16_ws.grouped_w4a16_ws_into(ordered, weight, offsets, out, config, y_mma_order=y_mma_order) is out
    return out


@_on_gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_exact_on_exactly_summable_inputs(kernel_device: str, config: dict[str, Any]) -> None:
    _check_grouped_exact(lambda x, weight, counts: _run(x, weight, counts, config), _cases(), kernel_device)


@_on_gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("ws2_layout", ["E1", "shared"])
def test_within_fp32_accumulation_error(kernel_device: str, config: dict[str, Any], ws2_layout: str) -> None:
    _check_grouped_within_fp32_bound(lambda x, weight, counts: _run(x, weight, counts, config), _cases(), kernel_device,
                                    ws2_layout)


@_on_gpu
@pytest.mark.parametrize("config", CONFIGS[:3], ids=_config_id)
def test_y_mma_order_stores_each_row_in_the_k_order(kernel_device: str, config: dict[str, Any]) -> None:
    for counts, n, k in [([5, 0, 40, 9], 256, 256), _cases()[3]]:
        weight = _gaussian_weight((len(counts), n, k), kernel_device)
        x = _activations((sum(counts), k), torch.bfloat16, kernel_device)
        natural = _run(x, weight, counts, config)
        ordered = _run(x, weight, counts, config, y_mma_order=True)
        assert torch.equal(ordered, w4a16.mma_k_order_rows(natural, w4a16.X_ORDER_BLOCK_K))


def _with_weight_scale(tail: NVFP4Tensor, weight: NVFP4Tensor) -> NVFP4Tensor:
    """A RAC tail weight: its own codes and scale bytes under the weight's ``weight_scale_2``."""
    return NVFP4Tensor(codes=tail.codes, scales=tail.scales, weight_scale_2=weight.weight_scale_2, shape=tail.shape,
                       dtype=tail.dtype)


def _rac_outputs(counts: list[int], n: int, k: int, k2: int, out_dtype: torch.dtype,
                 device: str) -> dict[str, torch.Tensor]:
    """One W4A4 + RAC grouped GEMM (a ``k2``-column tail, a row scale) by this kernel, by the Triton
    kernel on the same K-ordered x and on natural x, and through ``grouped_w4a16_into``'s dispatch."""
    weight = _gaussian_weight((len(counts), n, k), device)
    tail = _with_weight_scale(_gaussian_weight((len(counts), n, k2), device), weight)
    x = _activations((sum(counts), k + k2), torch.bfloat16, device)
    ordered = w4a16.mma_k_order_rows(x, w4a16.X_ORDER_BLOCK_K)
    row_scale = torch.rand(x.shape[0], device=device) + 0.5
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(device)
    outputs = {}
    for name, fn, rows, kwargs in (("ws", w4a16_ws.grouped_w4a16_ws_into, ordered, {}),
                                   ("dispatched", w4a16.grouped_w4a16_into, ordered, {"x_mma_order": True}),
                                   ("triton_x_order", w4a16.grouped_w4a16_into, ordered,
                                    {"x_mma_order": True, "kernel": "triton"}),
                                   ("natural", w4a16.grouped_w4a16_into, x, {})):
        out = torch.full((x.shape[0], n), float("nan"), dtype=out_dtype, device=device)
        fn(rows, weight, offsets, out, tail=tail, row_scale=row_scale, **kwargs)
        outputs[name] = out
    return outputs


@_on_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_tail_and_row_scale_give_the_triton_x_order_bits(kernel_device: str, out_dtype: torch.dtype) -> None:
    """W4A4 + RAC on this kernel (a tail weight over ``K2`` more columns of x, ``alpha`` a row in the
    epilogue): bit for bit the Triton kernel's x-order path with the same tail (which is within the
    fp32 bound of its natural-order path), at the short-K (dynamic) and the wide-K defaults, and what
    ``grouped_w4a16_into`` dispatches to."""
    for counts, n, k, k2 in (([0, 37, 5, 300, 64, 1, 33, 90], 384, 512, 256), (_cases()[3][0], 1536, 2048, 256)):
        out = _rac_outputs(counts, n, k, k2, out_dtype, kernel_device)
        assert torch.equal(out["ws"], out["triton_x_order"]), (n, k)
        assert torch.equal(out["dispatched"], out["ws"]), (n, k)
        scale = float(out["natural"].float().abs().max())
        assert torch.allclose(out["ws"].float(), out["natural"].float(), rtol=2**-7, atol=1e-3 * scale), (n, k)


@_on_gpu
def test_64_bit_output_offsets_store_the_same_bits(kernel_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs of 2^31 elements or more are addressed in 64 bits (forced here on a small one)."""
    counts, n, k = _cases()[3]
    weight = _gaussian_weight((len(counts), n, k), kernel_device)
    x = _activations((sum(counts), k), torch.bfloat16, kernel_device)
    narrow = _run(x, weight, counts, {})
    monkeypatch.setattr(w4a16_ws, "Y_I32_LIMIT", 0)
    assert torch.equal(_run(x, weight, counts, {}), narrow)


@_on_gpu
@pytest.mark.parametrize("variant", [{"WG_SPLIT": 1}, {"A_PIPE": 1}, {"A_PIPE": 1, "WG_SPLIT": 1}, {"CODE_ORDER": 1},
                                     {"CODE_ORDER": 2}, {"CODE_ORDER": 2, "A_PIPE": 1}], ids=_config_id)
def test_config_variants_give_the_default_bits(kernel_device: str, variant: dict[str, int]) -> None:
    """``WG_SPLIT`` only changes which warps wait on the ring, ``A_PIPE`` only when a sub-step is
    dequantized, ``CODE_ORDER`` only how the codes (reordered to match) become the same bf16
    operands: the products and their order are the default kernel's, plain and with a RAC tail and
    row scale, at both schedules."""
    counts, n, k = _cases()[3]
    weight = _gaussian_weight((len(counts), n, k), kernel_device)
    tail = _with_weight_scale(_gaussian_weight((len(counts), n, 256), kernel_device), weight)
    x = w4a16.mma_k_order_rows(_activations((sum(counts), k + 256), torch.bfloat16, kernel_device),
                               w4a16.X_ORDER_BLOCK_K)
    row_scale = torch.rand(x.shape[0], device=kernel_device) + 0.5
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
    for dynamic in (0, 1):
        outs = []
        for config in ({}, variant):
            order = config.get("CODE_ORDER", 0)
            weight_, tail_ = (ordered_weight(weight, order), ordered_weight(tail, order)) if order else (weight, tail)
            out = torch.full((x.shape[0], n), float("nan"), dtype=torch.float32, device=kernel_device)
            w4a16_ws.grouped_w4a16_ws_into(x, weight_, offsets, out, {**config, "DYNAMIC": dynamic},
                                           tail=tail_, row_scale=row_scale)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), dynamic


@_on_gpu
def test_dynamic_schedule_gives_the_static_bits_and_leaves_its_counters_zero(kernel_device: str) -> None:
    """Which program takes a tile does not change its products; each launch puts the shared counters
    back to zero (a stale count would make the next launch skip tiles), at any program count."""
    counts = [0, 37, 5, 300, 64, 1, 33, 90]
    weight = _gaussian_weight((len(counts), 384, 512), kernel_device)
    x = _activations((sum(counts), 512), torch.bfloat16, kernel_device)
    static = _run(x, weight, counts, {})
    for programs in (1, 4, 9, 10_000):
        assert torch.equal(_run(x, weight, counts, {"DYNAMIC": 1, "PROGRAMS": programs}), static), programs
        assert w4a16._split_counters(x.device, 2)[:2].tolist() == [0, 0]


@_on_gpu
def test_agrees_with_the_triton_grouped_kernel(kernel_device: str) -> None:
    counts, n, k = _cases()[3]
    weight = _gaussian_weight((len(counts), n, k), kernel_device)
    x = _activations((sum(counts), k), torch.bfloat16, kernel_device)
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
    reference = w4a16.grouped_w4a16_kernel(x, weight, offsets)
    y = _run(x, weight, counts, {})
    assert torch.allclose(y.float(), reference.float(), rtol=2**-7, atol=1e-3 * float(reference.float().abs().max()))


@_on_gpu
def test_grouped_w4a16_into_dispatches_x_order_calls_here_bit_for_bit(kernel_device: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 the engine's x-in-K-order grouped calls run this kernel, with the Triton kernel's
    bits (same products, same K order of the fp32 accumulation); ``kernel="triton"`` runs that one."""
    counts, n, k = _cases()[3]
    weight = _gaussian_weight((len(counts), n, k), kernel_device)
    x = w4a16.mma_k_order_rows(_activations((sum(counts), k), torch.bfloat16, kernel_device), w4a16.X_ORDER_BLOCK_K)
    offsets = expert_offsets_from_counts(torch.tensor(counts)).to(kernel_device)
    calls = []
    real = w4a16_ws.grouped_w4a16_ws_into
    monkeypatch.setattr(w4a16_ws, "grouped_w4a16_ws_into", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for y_mma_order in (False, True):
        dispatched, triton_only = (torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
                                   for _ in range(2))
        w4a16.grouped_w4a16_into(x, weight, offsets, dispatched, x_mma_order=True, y_mma_order=y_mma_order)
        w4a16.grouped_w4a16_into(x, weight, offsets, triton_only, x_mma_order=True, y_mma_order=y_mma_order,
                                 kernel="triton")
        assert torch.equal(dispatched, triton_only)
    assert len(calls) == 2


def test_default_configs_follow_k() -> None:
    wide, wide_short, short, odd = (w4a16_ws.default_config(k) for k in (2048, 768, 640, 1152))
    for cfg in (wide, wide_short):
        assert (cfg["BLOCK_K"], cfg["BLOCK_N"]) == (256, 128) and w4a16_ws._scale_ring(cfg)
    assert wide["DYNAMIC"] and wide_short["DYNAMIC"]  # the shared tile counter wherever 256 divides K
    assert not odd.get("DYNAMIC") and not short.get("DYNAMIC")
    assert (odd["BLOCK_K"], odd["BLOCK_N"]) == (128, 128) and not w4a16_ws._scale_ring(odd)
    assert (short["BLOCK_K"], short["BLOCK_N"], short["num_warps"]) == (128, 64, 4) and not w4a16_ws._scale_ring(short)
    for k, cfg in ((2048, wide), (768, wide_short), (640, short), (1152, odd)):
        w4a16_ws.check_config({**cfg, "BLOCK_M": 64}, 2048, k)


def test_argument_errors() -> None:
    stacked = _raw_weight((4, 256, 256), "cpu")
    x = torch.zeros(6, 256, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    out = torch.empty(6, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_K must be 128"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"BLOCK_K": 64})
    with pytest.raises(ValueError, match="num_warps = BLOCK_N / 16"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"BLOCK_N": 64})  # with 8 warps
    with pytest.raises(ValueError, match="CODE_ORDER must be 0"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"CODE_ORDER": 3})
    with pytest.raises(ValueError, match="A_PIPE overlaps the dequantization"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"BLOCK_K": 128, "A_PIPE": 1})
    with pytest.raises(ValueError, match="WG_SPLIT splits the two MMA warpgroups"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"BLOCK_N": 64, "num_warps": 4, "WG_SPLIT": 1})
    with pytest.raises(ValueError, match="do not fit in shared memory"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, {"BLOCK_M": 128, "STAGES": 8})
    with pytest.raises(ValueError, match="int32"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets.long(), out)
    with pytest.raises(ValueError, match="y_mma_order needs N"):
        w4a16_ws.grouped_w4a16_ws_into(x, _raw_weight((4, 40, 256), "cpu"), offsets, torch.empty(6, 40, dtype=torch.bfloat16),
                                       y_mma_order=True)
    with pytest.raises(ValueError, match="divide K"):
        w4a16_ws.grouped_w4a16_ws_into(torch.zeros(6, 320, dtype=torch.bfloat16), _raw_weight((4, 256, 320), "cpu"),
                                       offsets, out)
    tail = _raw_weight((4, 256, 128), "cpu")
    with pytest.raises(ValueError, match="a tail runs on the scale ring"):  # 128 columns: half a 256-wide step
        w4a16_ws.grouped_w4a16_ws_into(torch.zeros(6, 384, dtype=torch.bfloat16), stacked, offsets, out, tail=tail)
    with pytest.raises(ValueError, match="row_scale must be float32"):
        w4a16_ws.grouped_w4a16_ws_into(x, stacked, offsets, out, row_scale=torch.ones(6, dtype=torch.float16))
    assert w4a16_ws.takes_tail(2048, 256) and w4a16_ws.takes_tail(512, 512)
    assert not w4a16_ws.takes_tail(2048, 128) and not w4a16_ws.takes_tail(640, 256)  # K 640: no 256-wide steps


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_every_config_compiles_for_sm90(config: dict[str, Any]) -> None:
    """The Gluon kernel builds for sm_90 without a GPU (layouts proven trivial, warp partitions,
    TMA descriptors), with the wgmma and the loader's TMA copies in its SASS."""
    sass = w4a16_ws.compile_offline({**w4a16_ws.DEFAULT_CONFIG, "BLOCK_M": 32, **config}, n=1536, k=2048)
    assert "HGMMA" in sass and "UTMALDG" in sass and "SYNCS.PHASECHK" in sass
    assert ("ATOMG" in sass) == bool(config.get("DYNAMIC"))  # the tile counter: only the dynamic schedule


def _gate_up_sass(config: dict[str, Any], **kwargs: Any) -> str:
    """Offline sm_90 SASS at Qwen3-30B-A3B's gate/up shape, ``config`` over its default with 64-row tiles."""
    return w4a16_ws.compile_offline({**w4a16_ws.default_config(2048), "BLOCK_M": 64, **config}, n=1536, k=2048,
                                    **kwargs)


def _op_counts(sass: str) -> collections.Counter:
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass, re.MULTILINE))


def _sass_ops(config: dict[str, Any]) -> collections.Counter:
    return _op_counts(_gate_up_sass(config))


def test_split_warpgroups_synchronize_within_a_warpgroup() -> None:
    """Offline sm_90 SASS: unsplit, the two MMA warpgroups meet at CTA barriers of 256 threads in
    their K loop; with ``WG_SPLIT`` every named barrier spans 128 threads (one warpgroup) and each
    partition carries its own copy of the wgmma loop."""
    def barrier_threads(sass: str) -> set[str]:
        return set(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING\s+0x[0-9a-f]+,\s*(0x[0-9a-f]+)", sass))

    plain_sass, split_sass = _gate_up_sass({}), _gate_up_sass({"WG_SPLIT": 1})
    plain, split = _op_counts(plain_sass), _op_counts(split_sass)
    assert "0x100" in barrier_threads(plain_sass) and barrier_threads(split_sass) == {"0x80"}
    assert split["HGMMA"] == 2 * plain["HGMMA"] and split["UTMALDG"] == plain["UTMALDG"]


def _k_step_loops(sass: str) -> list[collections.Counter]:
    """The opcodes of the two innermost loops (backward branches' spans) of ``sass`` holding one ring
    step's 16 HGMMA: the K loops of the full- and the half-width token tile."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9.]+)[^;]*;",
                                                     sass, re.MULTILINE)]
    targets = {int(a, 16): int(t, 16) for a, t in re.findall(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?0x([0-9a-f]+)",
                                                             sass)}
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, _) in enumerate(ins):
        if a in targets and targets[a] < a and targets[a] in index:
            body = collections.Counter(op.split(".")[0] for _, op in ins[index[targets[a]]:i + 1])
            if body["HGMMA"] == 16:
                loops.append(body)
    return sorted(loops, key=lambda body: sum(body.values()))[:2]


def test_overlapped_dequantization_keeps_the_k_step_and_spills_nothing() -> None:
    """Offline sm_90 SASS at 16- and 64-row tiles: with ``A_PIPE`` the K loop issues as many
    instructions a ring step as the default's (within 5%: the next sub-step's A operand takes other
    registers, not copies into the same ones), and nothing goes to local memory."""
    for block_m in (16, 64):
        plain = _k_step_loops(_gate_up_sass({"BLOCK_M": block_m}))
        sass = _gate_up_sass({"BLOCK_M": block_m, "A_PIPE": 1})
        piped = _k_step_loops(sass)
        assert len(plain) == len(piped) == 2
        for a, b in zip(plain, piped):
            assert b["HMUL2"] == a["HMUL2"] and sum(b.values()) <= 1.05 * sum(a.values()), (a, b)
        ops = _op_counts(sass)
        assert ops["LDL"] == ops["STL"] == 0


def test_code_orders_take_fewer_instructions_a_k_step() -> None:
    """Offline sm_90 SASS at 16- and 64-row tiles: the rotated code order cuts the K loop's
    instructions a ring step by 9% or more, the balanced one its integer-ALU instructions (LOP3, SHF)
    by 15% or more and its total too; the same wgmma, no spills."""
    for block_m in (16, 64):
        plain = _k_step_loops(_gate_up_sass({"BLOCK_M": block_m}))
        rotated = _k_step_loops(_gate_up_sass({"BLOCK_M": block_m, "CODE_ORDER": 1}))
        sass = _gate_up_sass({"BLOCK_M": block_m, "CODE_ORDER": 2})
        balanced = _k_step_loops(sass)
        for a, r, b in zip(plain, rotated, balanced, strict=True):
            alu = lambda ops: ops["LOP3"] + ops["SHF"]  # noqa: E731
            assert sum(r.values()) <= 0.91 * sum(a.values()), (a, r)
            assert alu(b) <= 0.85 * alu(a) and sum(b.values()) < sum(a.values()), (a, b)
            assert a["HGMMA"] == r["HGMMA"] == b["HGMMA"] == 16
        ops = _op_counts(sass)
        assert ops["LDL"] == ops["STL"] == 0


def test_a_tail_adds_its_tma_copies_and_a_row_scale_its_loads() -> None:
    """Offline sm_90 SASS of the W4A4 + RAC variant: the loader copies the tail's words and scale
    bytes by their own descriptors (two more UTMALDG), the MMA is unchanged, the epilogue loads a
    row scale a token."""
    base, count = _sass_ops({}), _op_counts(_gate_up_sass({}, k2=256, row_scale=True))
    assert count["UTMALDG"] == base["UTMALDG"] + 2 and count["HGMMA"] == base["HGMMA"]
    assert count["LDG"] > base["LDG"]


def test_dynamic_schedule_moves_the_tile_loads_to_the_loader() -> None:
    """Offline sm_90 SASS: with ``DYNAMIC`` the loader loads each tile's row bounds and
    ``weight_scale_2`` and hands them over in the tile queue, so the MMA warps' three global loads a
    tile are gone (the static loader loads the bounds too: 2 + 3 against 3); the counter's atomics
    appear."""
    static, dynamic = _sass_ops({"DYNAMIC": 0}), _sass_ops({"DYNAMIC": 1})
    assert dynamic["LDG"] < static["LDG"]
    assert dynamic["ATOMG"] > 0 == static["ATOMG"]
    assert dynamic["UTMALDG"] == static["UTMALDG"] and dynamic["HGMMA"] == static["HGMMA"]
