"""The GPU vLLM benchmark's arithmetic and report (benchmarks/vllm_gpu_bench.py): the byte floor of a
decode step, the kernel classes of the profile split, and the targets table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from random_moe import QWEN3_30B_A3B  # noqa: E402
from vllm_gpu_bench import _kernel_class, decode_step_bytes, markdown  # noqa: E402


def test_one_sequence_reads_its_top_k_experts_and_the_dense_weights_once() -> None:
    s = QWEN3_30B_A3B
    attention = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    expert = 3 * s.hidden * s.expert_ffn
    kv = 100 * 2 * s.kv_heads * s.head_dim * 2
    want = s.layers * (2 * attention + 2 * s.top_k * expert + 2 * s.experts * s.hidden + kv) + 2 * s.vocab * s.hidden + 2 * s.hidden
    assert decode_step_bytes(s, "bf16", 1, 100) == pytest.approx(want)


def test_fewer_bytes_a_weight_fewer_bytes_a_step_and_the_rac_tail_adds_its_ratio() -> None:
    s = QWEN3_30B_A3B
    steps = {m: decode_step_bytes(s, m, 64, 512) for m in ("bf16", "fp8", "w4a16", "quads-0.25", "quads-0.5", "quads-0.25-attn")}
    assert steps["bf16"] > steps["fp8"] > steps["quads-0.5"] > steps["quads-0.25"] > steps["w4a16"]
    assert steps["quads-0.25-attn"] < steps["quads-0.25"]  # attention in NVFP4 too
    tail = (steps["quads-0.5"] - steps["w4a16"]) / (steps["quads-0.25"] - steps["w4a16"])
    assert tail == pytest.approx(2.0)
    assert decode_step_bytes(s, "w4a16", 512, 512) > decode_step_bytes(s, "w4a16", 64, 512)


@pytest.mark.parametrize(("name", "kind"), [
    ("fused_moe_kernel", "moe"), ("_grouped_ws_kernel", "moe"), ("_quantize_rows_kernel", "moe"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<", "attention"), ("nvjet_sm90_tst_384x64_64x3_2x1_v_bz_coopB_TNN", "other"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 3, true>", "other"),
])
def test_kernels_are_classed_by_name(name: str, kind: str) -> None:
    assert _kernel_class(name) == kind


def _record(w4a16: dict[int, float], fp8: dict[int, float]) -> dict:
    def mode(rates: dict[int, float]) -> dict:
        return {"cudagraph_mode": "FULL_DECODE_ONLY", "capture_sizes": [1, 512], "engine_start_s": 1.0, "methods": {},
                "throughput": [{"batch": b, "decode_tokens_per_s": r} for b, r in rates.items()]}

    return {"date": "d", "device": "GPU", "command": "c", "layers": 8, "of_layers": 48, "prompt_len": 256, "gen_len": 1024,
            "engine_settings": {}, "copy_bandwidth_tb_per_s": 4.2, "floor": [], "floor_48_layers": [],
            "modes": {"fp8": mode(fp8), "w4a16": mode(w4a16), "w4a4": {"mode": "w4a4", "error": "RuntimeError: boom"}}}


def _target_row(text: str, against: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| w4a16 | {against} |"))


def test_a_target_is_met_only_when_every_batch_in_its_range_reaches_it() -> None:
    fp8 = {1: 100.0, 8: 100.0, 256: 100.0, 512: 100.0}
    met = markdown(_record({1: 50.0, 8: 131.0, 256: 140.0, 512: 10.0}, fp8))
    assert _target_row(met, "fp8").endswith("| yes |")  # batches 1 and 512 lie outside 8-256
    missed = markdown(_record({1: 500.0, 8: 131.0, 256: 129.0, 512: 500.0}, fp8))
    assert _target_row(missed, "fp8").endswith("| no |") and "| 1.29x |" in _target_row(missed, "fp8")
    assert "| w4a4 | failed: RuntimeError: boom |" in met


def test_the_bf16_checkpoint_estimate_counts_every_tensor_of_the_model() -> None:
    from dataclasses import replace

    from random_moe import random_weights
    from vllm_gpu_bench import checkpoint_bytes

    shape = replace(QWEN3_30B_A3B, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, expert_ffn=32, vocab=512)
    actual = sum(t.numel() * t.element_size() for _, t in random_weights(shape, device="cpu"))
    assert checkpoint_bytes(shape, "bf16") == pytest.approx(actual, rel=0.02)
    assert checkpoint_bytes(shape, "plain") < checkpoint_bytes(shape, "quads") < checkpoint_bytes(shape, "bf16")
    assert checkpoint_bytes(shape, "plain-attn") < checkpoint_bytes(shape, "plain")


def test_a_work_folder_without_room_is_refused_before_anything_is_built(tmp_path, monkeypatch) -> None:
    import shutil
    from types import SimpleNamespace

    import vllm_gpu_bench

    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=10e9))
    with pytest.raises(SystemExit, match=r"--work .* has 10.0 GB free; the checkpoints \['bf16'\] of 8 layers need about 11"):
        vllm_gpu_bench.check_free_space(tmp_path, 8, ["bf16", "fp8"])
    vllm_gpu_bench.check_free_space(tmp_path, 2, ["bf16", "fp8"])  # 2 layers fit
    (tmp_path / "bf16-L8").mkdir()
    (tmp_path / "bf16-L8" / "config.json").write_text("{}")
    vllm_gpu_bench.check_free_space(tmp_path, 8, ["bf16", "fp8"])  # already written: nothing to add


def test_graphs_are_captured_at_the_batches_the_run_times_and_profiles() -> None:
    import vllm_gpu_bench

    args = vllm_gpu_bench.parse_args(["--batches", "1", "64", "512", "--profile-batches", "96"])
    settings = vllm_gpu_bench.engine_settings(args)
    assert settings["cudagraph_capture_sizes"] == [1, vllm_gpu_bench.WARM_UP_BATCH, 64, 96, 512]
    assert settings["cudagraph_mode"] == "FULL_DECODE_ONLY"


def test_the_profile_row_gives_the_share_of_the_measured_step_spent_in_kernels() -> None:
    record = _record({64: 100.0}, {64: 100.0})
    record["modes"]["fp8"]["throughput"][0]["ms_per_decode_step"] = 4.0
    record["modes"]["fp8"]["profiles"] = [{"batch": 64, "us_per_step": {"moe": 1000.0, "other": 1000.0},
                                           "us_per_step_total": 2000.0, "top_kernels": []}]
    assert "| fp8 | 64 | 1,000 | 0 | 1,000 | 2,000 | 4,000 | 50% |" in markdown(record)


def test_the_view_holds_every_gpu_record_the_main_one_first_and_no_other_key() -> None:
    import vllm_gpu_bench

    main, side = _record({64: 100.0}, {64: 100.0}), _record({64: 50.0}, {64: 50.0})
    main["layers"], side["layers"] = 24, 8
    records = {"cpu": {}, "gpu_8_layers": side, "gpu": main, "gpux": {}}
    assert vllm_gpu_bench.record_keys(records) == ["gpu", "gpu_8_layers"]
    view = vllm_gpu_bench.markdown_records(records)
    assert view.index("GPU: 24 layers") < view.index("GPU: 8 layers")
    assert view == markdown(main) + "\n" + markdown(side)


def test_kernel_config_variants_are_valid_configs_and_cost_their_base_modes_bytes() -> None:
    import vllm_gpu_bench

    from megatron_quads.kernels import w4a16_ws
    variants = {m: spec for m, spec in vllm_gpu_bench.MODES.items() if spec.get("ws_config")}
    assert variants
    for mode, spec in variants.items():
        base = mode.rsplit("-", 1)[0]
        assert vllm_gpu_bench.MODES[base]["checkpoint"] == spec["checkpoint"]
        w4a16_ws.check_config({**w4a16_ws.default_config(2048), "BLOCK_M": 16, **spec["ws_config"]}, 1536, 2048)
        assert decode_step_bytes(QWEN3_30B_A3B, mode, 64, 512) == decode_step_bytes(QWEN3_30B_A3B, base, 64, 512)
