"""The precision study's report: collapse detection, the early warning's lead, the RAC sweep (benchmarks/study_precisions.py)."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import study_precisions  # noqa: E402
from study_precisions import (  # noqa: E402
    EVAL_SUFFIX,
    METRICS_SUFFIX,
    claimed,
    record_overrides,
    collapse_step,
    first_warning,
    load_results,
    parse_run_name,
    report_markdown,
    run_name,
)

STAMP = {"date": "2026-12-02T00:00:00+00:00", "device": "test CPU", "command": "python benchmarks/study_precisions.py report"}


def test_a_reward_that_falls_to_a_third_of_its_peak_collapses_and_a_noisy_plateau_does_not() -> None:
    rising_then_falling = [0.1 + 0.02 * i for i in range(30)] + [0.1] * 30  # peak ~0.6, then 0.1
    step = collapse_step(rising_then_falling)
    assert step is not None and 30 <= step < 40
    plateau = [0.5 + (0.05 if i % 2 else -0.05) for i in range(60)]
    assert collapse_step(plateau) is None


def _write_run(results: Path, name: str, rewards: list[float], gap: float, k3: list[float]) -> None:
    records = [{"step": i, "reward": r, "mismatch/gap_max_abs": gap, "mismatch/gap_mean_abs": gap / 10, "mismatch/k3_kl": k,
                "response_length": 4.0} for i, (r, k) in enumerate(zip(rewards, k3, strict=True))]
    _write_records(results / f"{name}{METRICS_SUFFIX}", records)
    _write_records(results / f"{name}{EVAL_SUFFIX}", [{"step": len(rewards), "eval/pass@1": rewards[-1]}])


def _write_records(path: Path, records: list[dict]) -> None:
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))


def _rising_from(start: int, steps: int) -> list[float]:
    """k3 KL flat at 1e-3, then doubling every 5 steps from ``start``."""
    return [1e-3 * 2 ** (max(0, i - start) / 5) for i in range(steps)]


def test_the_report_names_collapses_the_warnings_lead_and_the_rac_sweep(tmp_path: Path) -> None:
    steps = 160
    collapse = [0.2 + 0.005 * i for i in range(100)] + [0.05] * 60
    stable = [0.6] * steps
    _write_run(tmp_path, run_name("naive-nvfp4", 0, "none"), collapse, 0.9, _rising_from(20, steps))
    _write_run(tmp_path, run_name("aqat", 0, "none"), stable, 0.6, _rising_from(steps, steps))
    _write_run(tmp_path, run_name("quads-0.5", 0, "none"), stable, 0.5, _rising_from(90, steps))
    _write_run(tmp_path, run_name("quads-1.0", 0, "none"), stable, 0.4, _rising_from(steps, steps))
    runs = load_results(tmp_path)
    assert parse_run_name("quads-0.5.seed2.tis") == ("quads-0.5", 2, "tis")
    assert set(runs) == {"naive-nvfp4.seed0.none", "aqat.seed0.none", "quads-0.5.seed0.none", "quads-1.0.seed0.none"}
    warned, step = first_warning(runs["naive-nvfp4.seed0.none"]["metrics"]), collapse_step(collapse)
    assert warned is not None and step is not None and 20 < warned < step
    assert first_warning(runs["aqat.seed0.none"]["metrics"]) is None
    false_alarm = first_warning(runs["quads-0.5.seed0.none"]["metrics"])
    assert false_alarm is not None and false_alarm > 90
    text = report_markdown(runs, STAMP)
    naive = next(line for line in text.splitlines() if line.startswith("| naive-nvfp4 |"))
    assert f"step {step}" in naive and f"step {warned} ({step - warned} steps before)" in naive
    assert f"step {false_alarm} (false alarm)" in next(line for line in text.splitlines() if line.startswith("| quads-0.5 |"))
    assert "| 0.0 | 0.600 | 1 |" in text and "| 1.0 | 0.400 | 1 |" in text
    assert "falls monotonically with the ratio" in text
    # each run's line: first and last 50 steps' reward, the final evaluation, the deepest fall (0.05 against
    # the best 10-step mean before it, 0.6725 at step 99, from step 109 on, when the window holds no higher reward)
    assert "| naive-nvfp4.seed0.none | 160 | 0.323 | 0.050 | 0.050, 0.050 (step 160), 0.050 (step 160) | 0.09000 | " \
           "0.90 |" in text
    assert next(line for line in text.splitlines() if line.startswith("| naive-nvfp4.seed0.none |")).endswith(
        "| 0.07 (step 109) |")
    assert next(line for line in text.splitlines() if line.startswith("| aqat.seed0.none |")).endswith("| 1.00 (step 10) |")


def test_the_analysis_section_lists_each_layers_errors_and_the_rac_pairs(tmp_path: Path) -> None:
    from study_precisions import analysis_markdown

    layers = {"layer 0": {"weight_rel": 0.05, "activation_rel": 0.03}, "layer 1": {"weight_rel": 0.04, "activation_rel": 0.02}}
    gap = lambda m: {"max_abs": m, "mean_abs": m / 10, "k3_kl": m / 100}  # noqa: E731
    doc = {"model": "x", "tokens": 512, "ratios": [0.5],
           "pairs": {"bf16 vs w4a4": {"label": "bf16 vs w4a4", "gap": gap(3.9), "layers": layers},
                     "bf16 vs w4a16": {"gap": gap(3.0), "layers": layers},
                     "aqat vs w4a4": {"gap": gap(3.5), "layers": layers},
                     "aqat vs quads@0.5 (output_error)": {"gap": gap(1.8), "layers": layers},
                     "aqat vs quads@0.5 (activation_magnitude)": {"gap": gap(1.9), "layers": layers}}}
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "naive-nvfp4.seed0.none.json").write_text(json.dumps(doc))
    text = "\n".join(analysis_markdown(tmp_path))
    assert "Gap decomposition of naive-nvfp4.seed0.none's final checkpoint" in text
    assert "| layer 1 | 0.0400 | 0.0200 |" in text
    assert "| aqat vs quads@0.5 (output_error) | 1.800 | 0.1800 | 1.80e-02 |" in text and "activation_magnitude" not in text
    # the summary row: layer means, weights alone (bf16 vs w4a16), activations alone (aqat vs w4a4), RAC by ratio
    assert "| naive-nvfp4.seed0.none | 0.0450 | 0.0250 | 0.3000 | 0.3500 | 0.1800 |" in text


def test_the_report_draws_each_analysis_plot_from_its_kept_json(tmp_path: Path) -> None:
    """The analysis plots are not kept in git: ``report`` draws them from the JSON that is."""
    from study_precisions import plot_analyses

    kept = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "study" / "analysis"
    (tmp_path / "analysis").mkdir()
    for name in ("aqat.seed0.none.json", "quads-0.25.seed0.none.json"):
        shutil.copy(kept / name, tmp_path / "analysis" / name)
    written = plot_analyses(tmp_path)
    assert sorted(p.name for p in written) == ["aqat.seed0.none.png", "quads-0.25.seed0.none.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in written)
    assert plot_analyses(tmp_path / "no_such_grid") == []


def test_the_warning_sweep_counts_warnings_before_collapses_and_false_alarms() -> None:
    from study_precisions import warning_onsets, warning_sweep_markdown

    from megatron_quads.rl.settings import GapMonitorConfig

    steps = 80
    rising = [1e-3 * 2 ** (i / 5) for i in range(steps)]  # doubles every 5 steps from the start
    collapse = [0.5] * 45 + [0.05] * 35
    runs = {"naive-nvfp4.seed0.none": {"metrics": [{"step": i, "reward": r, "mismatch/k3_kl": k}
                                                   for i, (r, k) in enumerate(zip(collapse, rising, strict=True))]},
            "quads-0.5.seed0.none": {"metrics": [{"step": i, "reward": 0.5, "mismatch/k3_kl": 1e-3} for i in range(steps)]}}
    onsets = warning_onsets(runs["naive-nvfp4.seed0.none"]["metrics"], GapMonitorConfig(window=20, threshold=1.0))
    assert onsets == [21]  # window full at step 19, over the threshold from there, warned after 3 steps in a row
    text = "\n".join(warning_sweep_markdown(runs))
    assert "| 20 | 1.0 | 1 of 1 | 0 of 1 | 0 |" in text


def test_a_run_another_process_holds_is_skipped_and_free_again_once_released(tmp_path: Path, monkeypatch) -> None:
    def must_not_train(*args, **kwargs):
        raise AssertionError("a claimed run was trained twice")

    monkeypatch.setattr(study_precisions.subprocess, "run", must_not_train)
    name = run_name("bf16", 0, "none")
    with claimed(tmp_path / "out" / f"{name}.lock") as first:
        assert first
        with claimed(tmp_path / "out" / f"{name}.lock") as second:
            assert not second
        assert study_precisions.train_one(name, [], 3, tmp_path / "out", tmp_path / "results") is False
    with claimed(tmp_path / "out" / f"{name}.lock") as again:
        assert again


def test_a_grids_overrides_are_named_in_its_report_and_other_overrides_are_refused_there(tmp_path: Path) -> None:
    results = tmp_path / "study_lr"
    record_overrides(results, ["grpo.optim.lr=0.001"])
    record_overrides(results, ["grpo.optim.lr=0.001"])
    with pytest.raises(SystemExit, match="its own --results"):
        record_overrides(results, [])
    records = [{"reward": 0.5, "mismatch/gap_max_abs": 0.1, "mismatch/gap_mean_abs": 0.01, "mismatch/k3_kl": 1e-3,
                "response_length": 4.0}] * 3
    _write_records(results / f"bf16.seed0.none{METRICS_SUFFIX}", records)
    text = report_markdown(load_results(results), STAMP, results)
    assert "with `grpo.optim.lr=0.001`" in text.splitlines()[0]


def test_a_grid_records_every_device_that_ran_it_and_its_report_names_them(tmp_path: Path) -> None:
    results = tmp_path / "study_gpu"
    record_overrides(results, [], device="NVIDIA H200")
    record_overrides(results, [], device="NVIDIA H200")
    record_overrides(results, [], device="NVIDIA H100")
    assert study_precisions.grid_devices(results) == ["NVIDIA H200", "NVIDIA H100"]
    with pytest.raises(SystemExit, match="its own --results"):
        record_overrides(results, ["grpo.optim.lr=0.001"], device="NVIDIA H200")
    records = [{"reward": 0.5, "mismatch/gap_max_abs": 0.1, "mismatch/gap_mean_abs": 0.01, "mismatch/k3_kl": 1e-3,
                "response_length": 4.0}] * 3
    _write_records(results / f"bf16.seed0.none{METRICS_SUFFIX}", records)
    title, _, body = report_markdown(load_results(results), STAMP, results).splitlines()[:3]
    assert title.endswith("NVIDIA H200, NVIDIA H100)") and STAMP["device"] not in title
    assert body.startswith("Runs on NVIDIA H200, NVIDIA H100. Command:") and f"(on {STAMP['device']})" in body


def test_a_grid_of_another_config_is_named_in_its_report_and_kept_apart(tmp_path: Path) -> None:
    results = tmp_path / "study_chain"
    config = study_precisions.REPO / "examples" / "collapse" / "chain_grpo_gpu.yaml"
    record_overrides(results, [], config)
    with pytest.raises(SystemExit, match="its own --results"):
        record_overrides(results, [])  # the embedded default's grid
    records = [{"reward": 0.5, "mismatch/gap_max_abs": 0.1, "mismatch/gap_mean_abs": 0.01, "mismatch/k3_kl": 1e-3,
                "response_length": 4.0}] * 3
    _write_records(results / f"bf16.seed0.none{METRICS_SUFFIX}", records)
    text = report_markdown(load_results(results), STAMP, results)
    assert text.splitlines()[0].startswith("# Precision study on `examples/collapse/chain_grpo_gpu.yaml` (")


def test_several_seeds_show_their_mean_and_spread(tmp_path: Path) -> None:
    for seed, reward in enumerate((0.5, 0.7)):
        _write_run(tmp_path, run_name("bf16", seed, "none"), [reward] * 60, 0.2 + seed * 0.2, [1e-3] * 60)
    text = report_markdown(load_results(tmp_path), STAMP, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| bf16 |"))
    assert "| 2 | 60 | 0.600 ± 0.141 | 0.600 ± 0.141 | 0.300 ± 0.141 |" in row


def test_analysis_reads_a_runs_own_task_when_its_config_names_one(tmp_path: Path) -> None:
    """The GPU collapse study's runs train on the chain task: ``analyze`` measures them on its held-out
    problems (``--tokens run-task`` with the run's config); a run of the embedded default on the embedded task's."""
    chain, default = tmp_path / "chain.seed0.none", tmp_path / "bf16.seed0.none"
    chain.mkdir()
    default.mkdir()
    (chain / "config.yaml").write_text("task:\n  kind: chain\n  options: {min_steps: 24}\n")
    (default / "config.yaml").write_text("task: null\nseed: 0\n")
    assert study_precisions._analysis_tokens(chain) == ["--tokens", "run-task", "--run-config", str(chain / "config.yaml")]
    assert study_precisions._analysis_tokens(default) == ["--tokens", "embedded-task"]


def test_seeds_that_stopped_at_different_steps_show_the_range_of_steps(tmp_path: Path) -> None:
    for seed, steps in enumerate((60, 45)):
        _write_run(tmp_path, run_name("naive-nvfp4", seed, "none"), [0.5] * steps, 0.2, [1e-3] * steps)
    text = report_markdown(load_results(tmp_path), STAMP, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| naive-nvfp4 |"))
    assert "| 2 | 45–60 |" in row
    assert "the steps column gives the range" in text


def test_the_entropy_section_puts_each_runs_entropy_beside_its_gap_per_token_and_per_response(tmp_path: Path) -> None:
    steps = 4
    _write_run(tmp_path, run_name("bf16", 0, "none"), [0.5] * steps, 0.1, [1e-4] * steps)  # recorded no entropy
    records = [{"step": i, "reward": 0.5, "mismatch/gap_max_abs": 0.5, "mismatch/gap_mean_abs": 0.002,
                "mismatch/k3_kl": k3, "response_length": length, "policy/entropy": h, "mismatch/gap_high_entropy_share": share}
               for i, (k3, length, h, share) in enumerate([(2e-4, 200.0, 0.01, 0.9), (4e-4, 300.0, 0.03, 0.7)])]
    _write_records(tmp_path / f"{run_name('naive-nvfp4', 0, 'none')}{METRICS_SUFFIX}", records)
    text = report_markdown(load_results(tmp_path), STAMP, tmp_path)
    assert "## Policy entropy and the gap" in text
    # entropy per response: mean of 0.01 x 200 and 0.03 x 300; k3 KL per response: mean of 2e-4 x 200 and 4e-4 x 300
    assert "| naive-nvfp4.seed0.none | 2 | 250.0 | 0.020 | 5.50 | 0.00200 | 3.0e-04 | 0.0800 | 0.80 |" in text
    assert "| bf16.seed0.none | 4 | 4.0 | not recorded | not recorded | 0.01000 | 1.0e-04 | 0.0004 | not recorded |" in text
