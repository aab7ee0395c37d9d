"""A GRPO step's record: how long each phase took and what the step measured, as one flat dict of
the keys ``metrics.jsonl`` holds (docs/controller.md)."""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """The seconds of a step's phases, each timed from the end of the one before (the first from the
    clock's start)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str | None) -> None:
        """End the phase running now and record its seconds as ``phase`` (None: not recorded)."""
        now = time.perf_counter()
        if phase is not None:
            self.seconds[phase] = now - self._last
        self._last = now


def step_record(step: int, *, rewards: torch.Tensor, mask: torch.Tensor, skipped_prompts: int,
                mismatch: dict[str, float], train: dict[str, float], clock: PhaseClock,
                calibration: dict[str, float] | None, sync: dict[str, float], restarts: int, freed_bytes: int,
                reward_metrics: dict[str, float] | None = None) -> dict:
    """Step ``step``'s record: mean reward and response length (``mask``: the response tokens), prompts
    skipped as too long, the rollout-vs-trainer ``mismatch``, the policy updates' metrics (``train/*``),
    each phase's seconds (``time/*``), the RAC calibration's prompt tokens (``calibration`` None: the
    step kept the last channels, and ``time/calibrate`` and ``calibration/tokens`` are 0), the engines
    restarted so far, the weight sync's figures (``sync/*``), the GPU bytes the engines released for
    training and the reward function's extra metrics (``reward/*``, each averaged over the step's
    responses)."""
    times = clock.seconds
    return {
        "step": step, "reward": float(rewards.mean()), **(reward_metrics or {}),
        "response_length": float(mask.sum(1).mean()),
        "prompts/skipped_too_long": float(skipped_prompts),
        **mismatch,
        **{f"train/{k}": v for k, v in train.items()},
        "time/sync": times["sync"], "time/calibrate": times["calibrate"] if calibration is not None else 0.0,
        "time/generate": times["generate"], "time/reward": times["reward"],
        "calibration/tokens": calibration["calibration_tokens"] if calibration is not None else 0.0,
        "time/logprobs": times["logprobs"], "time/train": times["train"],
        "rollout_restarts": restarts,
        **{f"sync/{k}": v for k, v in sync.items()}, "rollout/gpu_bytes_released": float(freed_bytes),
    }
