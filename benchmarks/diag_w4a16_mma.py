"""Where the Gluon dense decode kernel's time goes: timed variants of the same kernel (H200).

    python benchmarks/diag_w4a16_mma.py            # appends a record to results/diag_w4a16_mma.json
    COMPILE_ONLY=1 python benchmarks/diag_w4a16_mma.py   # compiles each variant for sm_90 only (no GPU)

Each variant is a source-transformed copy of ``megatron_quads/kernels/w4a16_mma.py`` (the
kernel itself is untouched), timed by CUDA-graph replay beside the real kernel:

- ``real R=r``: the real kernel with x repeated ``r`` times, program ``i`` reading copy ``i mod r``
  (if x's few hot L2 lines were the limit, ``r = 32`` would be faster);
- ``loads``: the register path's K loop with the dequantization and MMA replaced by XOR / add of
  the loaded registers (the memory pipeline alone at this grid and prefetch);
- ``loadsw``: ``loads`` without x's loads (weights and scale bytes only);
- ``nodq``: the real kernel with its 17-instruction dequantization PTX replaced by 4 register moves
  (the same loads, scale pairs and MMA: what the dequantization costs).

Only ``real`` computes the product (``correct`` says whether it matched the Triton kernel).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import triton
from kernel_variants import load_source_module, replace_anchor
from results_io import append_record

ROOT = Path(__file__).resolve().parents[1]
SOURCE = (ROOT / "megatron_quads/kernels/w4a16_mma.py").read_text()
OUT = Path(__file__).parent / "results" / "diag_w4a16_mma.json"

_SIGNATURE = "STAGES: gl.constexpr, X_STEPS: gl.constexpr,\n):"
_K_LOOP = '''        for kt in range(kt_lo, kt_hi):
            w1, s1, x1 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(kt + 1, kt_hi - 1), BLOCK_K)
            acc = mma_v2(_dequant_a(w0, s0, A_LAYOUT, WORDS), _x_operand(x0, B_LAYOUT), acc)
            w0, s0, x0 = w1, s1, x1
'''
_LOADS_ONLY = '''        chk_w = w0
        chk_s = s0.to(gl.int32)
        chk_x = x0.to(gl.float32)
        for kt in range(kt_lo, kt_hi):
            w1, s1, x1 = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(kt + 1, kt_hi - 1), BLOCK_K)
            chk_w = chk_w ^ w1
            chk_s = chk_s ^ s1.to(gl.int32)
            chk_x = chk_x + x1.to(gl.float32)
        acc += (gl.sum(gl.sum(gl.sum(chk_w, 2), 1), 0) + gl.sum(gl.sum(gl.sum(chk_s, 2), 1), 0)).to(gl.float32)
        acc += gl.sum(gl.sum(gl.sum(chk_x, 2), 1), 0)
'''
_X_LOAD = "    return words, scales, gl.load(x_ptrs + kt * BLOCK_K)\n"
_X_CONSTANT = "    return words, scales, gl.full(x_ptrs.shape, 0, gl.bfloat16, layout=x_ptrs.type.layout)\n"
_DEQUANT_CALL = "    o = gl.inline_asm_elementwise(WORD_PTX, "
_MOVES_CALL = ('    o = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $8; mov.b32 {$2, $3}, $9; '
               'mov.b32 {$4, $5}, $8; mov.b32 {$6, $7}, $9;", ')


def _replace(src: str, old: str, new: str) -> str:
    return replace_anchor(src, old, new, "w4a16_mma.py")


def variant_source(name: str) -> str:
    """The kernel module's source for variant ``name`` (``real``, ``loads``, ``loadsw``, ``nodq``);
    every variant takes a ``REPLICAS`` constexpr (x copy ``program % REPLICAS``)."""
    src = _replace(SOURCE, _SIGNATURE, _SIGNATURE.replace("X_STEPS: gl.constexpr,", "X_STEPS: gl.constexpr, REPLICAS: gl.constexpr,"))
    anchor = "    kt_lo, kt_hi = _split_steps(K, pid_k, BLOCK_K, SPLIT_K)\n"
    src = _replace(src, anchor, "    x_ptr = x_ptr + ((pid_n * SPLIT_K + pid_k) % REPLICAS).to(gl.int64) * M * stride_xm\n" + anchor)
    if name in ("loads", "loadsw"):
        src = _replace(src, _K_LOOP, _LOADS_ONLY)
    if name == "loadsw":
        src = _replace(src, _X_LOAD, _X_CONSTANT)
    if name == "nodq":
        src = _replace(src, _DEQUANT_CALL, _MOVES_CALL)
    return src


def load_variant(name: str, directory: Path):
    """Import :func:`variant_source` ``name`` as its own module (Gluon compiles from the file)."""
    return load_source_module(f"w4a16_mma_{name}", variant_source(name), directory)


CASES = [  # (M, K, N), (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, X_SMEM, maxnreg), variants as (name, replicas)
    ((16, 8192, 8192), (64, 128, 8, 1, 0, 255),
     [("real", 1), ("real", 4), ("real", 32), ("loads", 1), ("loadsw", 1), ("nodq", 1)]),
    ((16, 8192, 8192), (32, 128, 4, 1, 0, 255), [("real", 1), ("real", 32), ("loads", 1), ("loadsw", 1)]),
    ((16, 8192, 8192), (128, 128, 8, 4, 1, 128), [("real", 1), ("nodq", 1)]),
    ((16, 4096, 4096), (32, 128, 4, 1, 0, 255), [("real", 1), ("real", 32), ("loads", 1), ("loadsw", 1)]),
    ((64, 8192, 8192), (64, 128, 4, 1, 0, 255), [("real", 1), ("nodq", 1)]),
]
"""``loads`` / ``loadsw`` replace the register path's loop: only with ``X_SMEM`` 0."""


def _time_case(modules: dict, shape: tuple[int, int, int], config: tuple[int, int, int, int, int, int],
               variants: list[tuple[str, int]]) -> dict[str, dict]:
    """One shape and tile config: each ``(variant, replicas)`` launched and timed on the same operands."""
    from bench_kernels import _weight, time_graph

    from megatron_quads.kernels import w4a16 as triton_w4a16

    (m, k, n), (bn, bk, split, warps, x_smem, maxnreg) = shape, config
    _, qw = _weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    reference = triton_w4a16.w4a16_linear_kernel(x, qw).float()
    real = modules["real"]
    codes, scales = real._operands(qw)
    ws2 = qw.weight_scale_2.reshape(1).to(torch.float32)
    block_m = real.default_block_m(m)
    grid = (triton.cdiv(n, bn), split, triton.cdiv(m, block_m))
    partials = triton_w4a16._new_partials(split * grid[0] * bn * grid[2] * block_m, x.device)
    counters = real._split_counters(x.device, grid[0] * grid[2])
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    options = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "NUM_WARPS": warps, "PREFETCH": 1,
               "STAGES": 0, "X_STEPS": real.x_slice_steps(k // bk, split) if x_smem else 0, "num_warps": warps,
               "maxnreg": maxnreg}
    results = {}
    for name, replicas in variants:
        xr = x.repeat(replicas, 1).contiguous()
        kernel = modules[name]._decode_kernel[grid]

        def call(kernel=kernel, xr=xr, replicas=replicas):
            kernel(xr, codes, scales, ws2, y, partials, counters, m, n, k, xr.stride(0), codes.stride(0),
                   scales.stride(0), y.stride(0), REPLICAS=replicas, **options)

        call()
        torch.cuda.synchronize()
        correct = bool(torch.allclose(y.float(), reference, rtol=2**-6, atol=1e-2 * float(reference.abs().max())))
        key = f"M={m} K={k} N={n} {bn}x{bk} w{warps} s{split}{' xs' if x_smem else ''} r{maxnreg} {name} R={replicas}"
        results[key] = {"us": round(time_graph(call), 2), "correct": correct}
        print(key, results[key], flush=True)
    return results


def compile_offline(module, config: tuple[int, int, int, int, int, int], block_m: int = 16) -> int:
    """Compile ``module``'s ``_decode_kernel`` for sm_90 without a GPU (what ``COMPILE_ONLY`` checks):
    the SASS size in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bn, bk, split, warps, x_smem, maxnreg = config
    kernel = module._decode_kernel
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*u8", "ws2_ptr": "*fp32",
                "partials_ptr": "*fp32", "counters_ptr": "*i32"}
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "NUM_WARPS": warps, "PREFETCH": 1,
                  "STAGES": 0, "X_STEPS": module.x_slice_steps(8192 // bk, split) if x_smem else 0, "REPLICAS": 1}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    # what the launcher specializes on the GPU: pointers, K and the strides divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name] != "constexpr" and name not in ("M", "N")}
    source = GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "maxnreg": maxnreg})
    return len(compiled.asm["cubin"])


def main() -> None:
    """Time every case; append one record to results/diag_w4a16_mma.json."""
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / "diag_w4a16_mma"
    directory.mkdir(parents=True, exist_ok=True)
    modules = {name: load_variant(name, directory) for name in ("real", "loads", "loadsw", "nodq")}
    if os.environ.get("COMPILE_ONLY"):
        for name, module in modules.items():
            print(f"{name}: cubin {compile_offline(module, CASES[0][1])} bytes for sm_90", flush=True)
        return
    results = {}
    for shape, config, variants in CASES:
        results |= _time_case(modules, shape, config, variants)
    append_record(OUT, {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name(), "command": "python benchmarks/diag_w4a16_mma.py",
                        "results": results})


if __name__ == "__main__":
    main()
