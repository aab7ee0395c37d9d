"""Code orders of code words (megatron_quads/kernels/code_orders.py): each a permutation of a word's bits,
with a dequantization of the reordered word that gives the plain one's bits, checked here by running
the PTX sequences instruction by instruction in integer and bf16 arithmetic (the GPU tests run them)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_quads.kernels import code_orders
from megatron_quads.kernels.w4a16 import _DEQUANT_WORD_PTX as _PLAIN_PTX

_DEQUANT_WORD_PTX = _PLAIN_PTX.value

MASK32 = 0xFFFFFFFF


def _bf16x2_mul(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``mul.rn.bf16x2``: both halves of the words ``a`` (int64) times the bf16 pair ``s`` (int64)."""
    def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = (x & 0xFFFF), (x >> 16) & 0xFFFF
        as_bf16 = [torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.bfloat16) for h in (lo, hi)]
        return as_bf16[0], as_bf16[1]

    (a_lo, a_hi), (s_lo, s_hi) = halves(a), halves(s)
    # the fp32 product of two bf16 values is exact, so rounding it to bf16 is mul.rn.bf16x2
    out = [(x.float() * y.float()).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
           for x, y in ((a_lo, s_lo), (a_hi, s_hi))]
    return out[0] | (out[1] << 16)


def _run_ptx(ptx: str, word: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """Interpret the dequantization PTX (the instructions it uses) on int64 words; its 8 16-bit outputs."""
    regs: dict[str, torch.Tensor] = {"$8": word & MASK32, "$9": scale & MASK32}
    outputs: dict[str, torch.Tensor] = {}

    def value(name: str) -> torch.Tensor:
        name = name.strip()
        return regs[name] if name in regs else torch.full_like(word, int(name, 0))

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", "{", "}")):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32":
            lo, hi, src = re.match(r"\{(\$\d), (\$\d)\}, (\w+)", args).groups()
            outputs[lo], outputs[hi] = regs[src] & 0xFFFF, (regs[src] >> 16) & 0xFFFF
            continue
        dst, *srcs = [a.strip() for a in args.split(",")]
        x = [value(s) for s in srcs]
        if op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "mul.lo.u32":
            regs[dst] = (x[0] * x[1]) & MASK32
        elif op == "shr.u32":
            regs[dst] = x[0] >> x[1]
        elif op == "shf.l.wrap.b32":
            assert srcs[0] == srcs[1]  # a rotation
            n = int(srcs[2]) % 32
            regs[dst] = ((x[0] << n) | (x[0] >> (32 - n))) & MASK32
        elif op == "mul.rn.bf16x2":
            regs[dst] = _bf16x2_mul(x[0], x[1])
        elif op == "lop3.b32":
            assert srcs[3] == "0x78"  # a ^ (b & c)
            regs[dst] = x[0] ^ (x[1] & x[2])
        else:
            raise AssertionError(f"instruction {op} not interpreted")
    return [outputs[f"${i}"] for i in range(8)]


def _scale_pairs() -> torch.Tensor:
    """Every finite E4M3 scale byte as the bf16 pair ``(s, s)``, ``s = scale * 2^118``, as int64 words."""
    codes = torch.arange(256, dtype=torch.uint8)
    scale = codes.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(scale)
    half = (scale[finite] * 2.0**118).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return half | (half << 16)


def _words(generator: torch.Generator) -> torch.Tensor:
    """Every code in every position at least once beside random ones, as int32 words."""
    every = torch.arange(256, dtype=torch.int64)  # each pair's two codes take all 256 values
    patterned = sum((every << (4 * q)) & (0xF << (4 * q)) | ((every >> 4) << (4 * q + 16)) for q in range(4))
    random = torch.randint(0, 2**32, (4096,), generator=generator, dtype=torch.int64)
    words = torch.cat([patterned, random])
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("order", sorted(code_orders.CODE_ORDERS))
def test_a_code_order_is_a_bit_permutation_and_round_trips(order: int) -> None:
    words = _words(torch.Generator().manual_seed(0))
    ordered = code_orders.to_code_order(words, order)
    assert not torch.equal(ordered, words)
    assert torch.equal(code_orders.from_code_order(ordered, order), words)
    ones = lambda w: sum(((w.to(torch.int64) & MASK32) >> b & 1) for b in range(32))  # noqa: E731
    assert torch.equal(ones(ordered), ones(words))
    assert code_orders.to_code_order(words, code_orders.PLAIN) is words
    with pytest.raises(TypeError, match="int32"):
        code_orders.to_code_order(words.to(torch.int64), order)
    with pytest.raises(ValueError, match="code order 9"):
        code_orders.to_code_order(words, 9)


def _pipes(ptx: str) -> tuple[int, int]:
    """(instructions, of them on the integer ALU pipe) of a dequantization PTX sequence (movs are renamings)."""
    ops = [line.split()[0] for line in ptx.splitlines() if re.match(r"\s*[a-z]", line)
           and not line.strip().startswith((".reg", "mov.b32"))]
    return len(ops), sum(op.startswith(("and", "lop3", "shf", "shr")) for op in ops)


@pytest.mark.parametrize(("order", "instructions", "alu"), [(1, 14, 9), (2, 15, 7)])
def test_a_code_orders_dequantization_gives_the_plain_bits_in_fewer_instructions(order: int, instructions: int,
                                                                                  alu: int) -> None:
    words = _words(torch.Generator().manual_seed(1))
    scales = _scale_pairs()
    w = words.to(torch.int64).repeat_interleave(scales.numel())
    s = scales.repeat(words.numel())
    ordered = code_orders.to_code_order(words, order).to(torch.int64).repeat_interleave(scales.numel())
    plain_out = _run_ptx(_DEQUANT_WORD_PTX, w, s)
    ordered_out = _run_ptx(code_orders.DEQUANT_WORD_PTX[order], ordered, s)
    for i, (a, b) in enumerate(zip(plain_out, ordered_out, strict=True)):
        assert torch.equal(a, b), f"output {i}: {int((a != b).sum())} of {a.numel()} differ"
    assert _pipes(_DEQUANT_WORD_PTX) == (17, 9)
    assert _pipes(code_orders.DEQUANT_WORD_PTX[order]) == (instructions, alu)
