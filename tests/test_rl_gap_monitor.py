"""The collapse early warning: a robust trend of the gap, raised after a sustained rise, resumable."""

from __future__ import annotations

import math

import pytest

from megatron_quads.rl.gap_monitor import TREND_KEY, WARNING_KEY, GapMonitor, theil_sen_slope
from megatron_quads.rl.settings import GapMonitorConfig


def test_the_theil_sen_slope_ignores_a_single_spike() -> None:
    line = [0.5 * i + 2.0 for i in range(11)]
    assert theil_sen_slope(line) == pytest.approx(0.5)
    line[7] += 100.0  # one outlier step: a least-squares fit would move, the median of slopes does not
    assert theil_sen_slope(line) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2 points"):
        theil_sen_slope([1.0])


def test_the_theil_sen_slope_is_the_median_of_the_pairwise_slopes() -> None:
    values = [math.sin(3.7 * i) + 0.05 * i * i for i in range(9)]
    pairwise = sorted((values[j] - values[i]) / (j - i) for i in range(9) for j in range(i + 1, 9))
    middle = len(pairwise) // 2  # 36 pairs: the mean of the two middle ones
    assert theil_sen_slope(values) == pytest.approx((pairwise[middle - 1] + pairwise[middle]) / 2)


def _records(values: list[float], metric: str = "mismatch/k3_kl") -> list[dict[str, float]]:
    return [{"step": i, metric: v} for i, v in enumerate(values)]


def test_a_flat_gap_never_warns_and_the_trend_starts_once_a_window_is_full() -> None:
    monitor = GapMonitor(GapMonitorConfig(window=5, threshold=0.5, patience=2))
    noisy_flat = [1e-3 * (1 + 0.1 * math.sin(i)) for i in range(40)]
    outputs = [monitor.update(r) for r in _records(noisy_flat)]
    assert all(TREND_KEY not in o and o[WARNING_KEY] == 0.0 for o in outputs[:4])
    assert all(abs(o[TREND_KEY]) < 0.5 and o[WARNING_KEY] == 0.0 for o in outputs[4:])


def test_a_sustained_rise_warns_after_the_patience_and_rearms_when_it_stops() -> None:
    window, patience = 6, 3
    monitor = GapMonitor(GapMonitorConfig(window=window, threshold=1.0, patience=patience))
    flat, rising = [1e-3] * 10, [1e-3 * 2 ** (i / 3) for i in range(1, 16)]  # doubles every 3 steps
    calm_again = [rising[-1]] * 12
    outputs = [monitor.update(r) for r in _records(flat + rising + calm_again)]
    warned = [i for i, o in enumerate(outputs) if o[WARNING_KEY] == 1.0]
    # over a 6-step window the fitted rise is 2^(5/3) - 1 = 2.17 > 1 once the window holds rising steps only
    first_full_rise = len(flat) + window - 1
    assert warned and warned[0] <= first_full_rise + patience - 1
    assert outputs[first_full_rise][TREND_KEY] == pytest.approx(2 ** (5 / 3) - 1, rel=1e-5)  # the floor moves it a little
    assert outputs[-1][WARNING_KEY] == 0.0 and outputs[-1][TREND_KEY] == pytest.approx(0.0)  # flat again: re-armed


def test_the_step_that_turns_the_warning_on_logs_it_once_and_a_replay_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = GapMonitorConfig(window=4, threshold=0.5, patience=2)
    records = _records([1e-3] * 4 + [1e-3 * 2 ** i for i in range(1, 12)])
    monitor = GapMonitor(config)
    with caplog.at_level("WARNING", logger="megatron_quads.rl.gap_monitor"):
        outputs = [monitor.update(r) for r in records]
        onset = next(i for i, o in enumerate(outputs) if o[WARNING_KEY] == 1.0)
        assert [m for m in caplog.messages if "collapse early warning" in m] == [
            next(m for m in caplog.messages if f"at step {onset}:" in m)]
        caplog.clear()
        GapMonitor(config).replay(records)
        assert caplog.messages == []


def test_a_resumed_monitor_replays_the_kept_records_to_the_same_state() -> None:
    config = GapMonitorConfig(window=4, threshold=0.2, patience=2, metric="mismatch/gap_max_abs")
    values = [0.3, 0.31, 0.35, 0.4, 0.5, 0.62, 0.8, 1.0, 1.3]
    straight = GapMonitor(config)
    expected = [straight.update(r) for r in _records(values, config.metric)]
    resumed = GapMonitor(config)
    resumed.replay(_records(values[:5], config.metric))
    assert [resumed.update(r) for r in _records(values, config.metric)[5:]] == expected[5:]


def test_a_missing_or_non_finite_metric_is_refused_naming_it() -> None:
    monitor = GapMonitor(GapMonitorConfig())
    with pytest.raises(ValueError, match=r"watches 'mismatch/k3_kl'.*mismatch/gap_max_abs"):
        monitor.update({"mismatch/gap_max_abs": 0.5})
    with pytest.raises(ValueError, match=r"'mismatch/k3_kl' is nan"):
        monitor.update({"mismatch/k3_kl": float("nan")})
