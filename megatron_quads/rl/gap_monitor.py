"""The collapse early warning: a robust trend of the rollout-vs-trainer gap, and when it rises.

Naive NVFP4 rollouts drift from the trainer before rewards fall: the gap (``mismatch/k3_kl`` by
default) grows step over step. Each step the monitor fits ``log(metric + floor)`` over the last
``window`` steps with the Theil-Sen estimator (the median of the pairwise slopes: a spike of one
step moves it little) and reports the fitted rise over one window,
``gap_trend = exp(slope * (window - 1)) - 1`` (1.0: the metric doubled across the window). The
warning is raised (and logged) when ``gap_trend`` exceeds ``threshold`` for ``patience`` consecutive
steps, and re-armed once it falls back below. The state is the metric's history, so a resumed run
rebuilds it from the records it kept; the slope is ``scipy.stats.theilslopes``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping

from megatron_quads.rl.settings import GapMonitorConfig

logger = logging.getLogger(__name__)

TREND_KEY = "monitor/gap_trend"
WARNING_KEY = "monitor/gap_warning"


def theil_sen_slope(values: list[float]) -> float:
    """Median of ``(values[j] - values[i]) / (j - i)`` over all pairs ``i < j`` (equally spaced points)."""
    from scipy.stats import theilslopes  # imported when first fitted: scipy.stats takes a while to load

    if len(values) < 2:
        raise ValueError(f"a slope needs at least 2 points, got {len(values)}")
    return float(theilslopes(values).slope)


class GapMonitor:
    """Watches one per-step metric; :meth:`update` returns the step's ``gap_trend`` and warning state."""

    def __init__(self, config: GapMonitorConfig) -> None:
        self.config = config
        self._history: deque[float] = deque(maxlen=config.window)
        self._above = 0
        self.warning = False

    def replay(self, records: Iterable[Mapping[str, float]]) -> None:
        """Feed earlier steps' records (a resumed run's kept ones), in step order."""
        for record in records:
            self.update(record, log=False)

    def update(self, record: Mapping[str, float], log: bool = True) -> dict[str, float]:
        """Take one step's record; ``{TREND_KEY, WARNING_KEY}`` (only the warning, 0, until a window is
        full). The step that turns the warning on logs it (``log``).

        A record without the metric, or with a non-finite one, raises ValueError naming it.
        """
        name = self.config.metric
        if name not in record:
            raise ValueError(f"the gap monitor watches '{name}', which the step's record lacks; set monitor.metric to "
                             f"one of {sorted(k for k in record if k.startswith('mismatch/'))}")
        value = float(record[name])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the gap monitor's metric '{name}' is {value}; it needs a finite value >= 0")
        self._history.append(math.log(value + self.config.floor))
        if len(self._history) < self.config.window:
            return {WARNING_KEY: 0.0}
        trend = math.expm1(theil_sen_slope(list(self._history)) * (self.config.window - 1))
        self._above = self._above + 1 if trend > self.config.threshold else 0
        warned, self.warning = self.warning, self._above >= self.config.patience
        if log and self.warning and not warned:
            logger.warning("collapse early warning at step %s: %s rose by %.0f%% over the last %d steps (threshold %.0f%%, "
                           "%d steps in a row); the rollouts may be drifting from the trainer", record.get("step", "?"),
                           name, 100 * trend, self.config.window, 100 * self.config.threshold, self.config.patience)
        return {TREND_KEY: trend, WARNING_KEY: float(self.warning)}
