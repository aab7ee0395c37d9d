"""Where the grouped W4A16 kernel's time goes at large decode batches: timed variants of it (H200).

    python benchmarks/diag_grouped_w4a16.py            # appends a record to results/diag_grouped_w4a16.json
    COMPILE_ONLY=1 python benchmarks/diag_grouped_w4a16.py   # compiles each variant for sm_90 only (no GPU)

Each variant is a source-transformed copy of ``megatron_quads/kernels/w4a16.py`` (the kernel
itself is untouched), run through that copy's ``grouped_w4a16_into`` with one fixed config on x in
the kernel's K order, at Qwen3-30B-A3B expert shapes and 512 tokens (top-8 of 128 experts):

- ``real``: the kernel as it is (``correct`` says whether it gave the library kernel's bits);
- ``nodq``: the 17-instruction dequantization PTX replaced by 4 register moves (the same loads,
  scale pairs and MMA: what the dequantization costs);
- ``nox``: x's tile a constant instead of loaded (what x's loads cost);

each with the half-width token tile on and off (``_HALF_TILE``). Only ``real`` computes the product.
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
SOURCE = (ROOT / "megatron_quads/kernels/w4a16.py").read_text()
OUT = Path(__file__).parent / "results" / "diag_grouped_w4a16.json"
VARIANTS = ("real", "nodq", "nox")

_DEQUANT_CALL = '            _DEQUANT_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pairs],\n'
_MOVES_CALL = ('            "mov.b32 {$0, $1}, $8; mov.b32 {$2, $3}, $9; mov.b32 {$4, $5}, $8; mov.b32 {$6, $7}, $9;", '
               '"=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, pairs],\n')
_X_LOAD = "            xt = tl.load(x_ptrs, mask=x_live, other=0.0)\n"
_X_CONSTANT = "            xt = tl.full((BLOCK_K, x_rows.shape[1]), 1.0, x_rows.dtype.element_ty)\n"

CASES = [  # (name, N, K), config
    ("gate_up", 1536, 2048), ("down", 2048, 768),
]
CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3}
"""The x-order autotuner's pick at 512 tokens for both projections (2026-11-30 runs)."""


def _replace(src: str, old: str, new: str) -> str:
    return replace_anchor(src, old, new, "w4a16.py")


def variant_source(name: str) -> str:
    """The kernel module's source for variant ``name`` (one of :data:`VARIANTS`)."""
    if name == "nodq":
        return _replace(SOURCE, _DEQUANT_CALL, _MOVES_CALL)
    if name == "nox":
        return _replace(SOURCE, _X_LOAD, _X_CONSTANT)
    return SOURCE


def load_variant(name: str, directory: Path):
    """Import :func:`variant_source` ``name`` as its own module (Triton compiles from the file)."""
    return load_source_module(f"w4a16_grouped_{name}", variant_source(name), directory)


def _time_case(modules: dict, proj: str, n: int, k: int, tokens: int = 512) -> dict[str, dict]:
    """One projection: every variant, half tile on and off, on the same operands."""
    from bench_kernels import _routing, _weight, time_graph

    from megatron_quads.kernels import w4a16 as library
    from megatron_quads.rollout.grouped import expert_offsets_from_counts

    experts, top_k = 128, 8
    _, qw = _weight(n, k, experts)
    offsets = expert_offsets_from_counts(_routing(tokens, experts, top_k))
    x = library.mma_k_order_rows(torch.randn(tokens * top_k, k, device="cuda", dtype=torch.bfloat16), 128)
    reference = torch.empty(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    library.grouped_w4a16_into(x, qw, offsets, reference, CONFIG, x_mma_order=True)
    y = torch.empty_like(reference)
    results = {}
    for name, module in modules.items():
        for half_tile in (True, False):
            module._HALF_TILE = half_tile

            def call(module=module):
                module.grouped_w4a16_into(x, qw, offsets, y, CONFIG, x_mma_order=True)

            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            key = f"{proj} tokens={tokens} {name} half_tile={int(half_tile)}"
            results[key] = {"us": round(time_graph(call), 2), "correct": bool(torch.equal(y, reference))}
            print(key, results[key], flush=True)
    return results


def compile_offline(module, half_tile: bool = True) -> int:
    """Compile ``module``'s grouped kernel with :data:`CONFIG` for sm_90 without a GPU (what
    ``COMPILE_ONLY`` checks): the cubin size in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = module._grouped_kernel
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "codes_ptr": "*i32", "tail_codes_ptr": "*i32", "scales_ptr": "*u8",
                "tail_scales_ptr": "*u8", "ws2_ptr": "*fp32", "row_scale_ptr": "*fp32", "offsets_ptr": "*i32"}
    constexprs = {"BLOCK_M": CONFIG["BLOCK_M"], "BLOCK_N": CONFIG["BLOCK_N"], "BLOCK_K": CONFIG["BLOCK_K"],
                  "EVEN_K": True, "EVEN_K2": True, "HAS_TAIL": False, "DOT_F32": False, "ROW_SCALE": False,
                  "X_MMA_ORDER": True, "HALF_TILE": half_tile, "Y_MMA_ORDER": False, "stride_xk": 1, "stride_yn": 1}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    # what the launcher specializes on the GPU: pointers, K and the strides divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name] != "constexpr" and name != "N"}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"]})
    return len(compiled.asm["cubin"])


def main() -> None:
    """Time every case; append one record to results/diag_grouped_w4a16.json."""
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / "diag_grouped_w4a16"
    directory.mkdir(parents=True, exist_ok=True)
    modules = {name: load_variant(name, directory) for name in VARIANTS}
    if os.environ.get("COMPILE_ONLY"):
        for name, module in modules.items():
            print(f"{name}: cubin {compile_offline(module)} bytes for sm_90", flush=True)
        return
    results = {}
    for proj, n, k in CASES:
        results |= _time_case(modules, proj, n, k)
    append_record(OUT, {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name(), "command": "python benchmarks/diag_grouped_w4a16.py",
                        "config": CONFIG, "results": results})


if __name__ == "__main__":
    main()
