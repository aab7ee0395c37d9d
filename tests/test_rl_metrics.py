"""Rollout-vs-trainer mismatch metrics: hand-computed gap, k3 KL, ratio range, the entropy split; empty batches."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.rl import (
    MISMATCH_KEYS,
    CorrectionConfig,
    compute_correction,
    entropy_metrics,
    mismatch_metrics,
)

# log r = logp_trainer - logp_rollout on valid tokens: 0.1, -0.2, 0.0, 0.3; the rest is padding
LOGP_ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, float("nan"), -3.0]])
LOG_R = torch.tensor([[0.1, -0.2, 0.0], [0.3, 5.0, -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_metrics_by_hand() -> None:
    m = mismatch_metrics(LOGP_ROLLOUT, LOGP_ROLLOUT + LOG_R, MASK)
    assert set(m) == set(MISMATCH_KEYS)
    assert float(m["gap_max_abs"]) == pytest.approx(0.3, abs=1e-6)
    assert float(m["gap_mean_abs"]) == pytest.approx(0.15, abs=1e-6)  # (0.1 + 0.2 + 0 + 0.3) / 4
    # k3 = exp(x) - 1 - x: 0.0051709 + 0.0187308 + 0 + 0.0498588, over 4 tokens
    assert float(m["k3_kl"]) == pytest.approx(0.0184401, abs=1e-6)
    assert float(m["ratio_min"]) == pytest.approx(0.818731, abs=1e-6)  # exp(-0.2)
    assert float(m["ratio_max"]) == pytest.approx(1.349859, abs=1e-6)  # exp(0.3)
    assert int(m["num_tokens"]) == 4
    assert float(m["is_masked_frac"]) == 0.0 and float(m["is_truncated_frac"]) == 0.0


def test_k3_is_accurate_for_tiny_gaps() -> None:
    # exp(x) - 1 - x ~ x^2 / 2 = 5e-9 for x = 1e-4: no float32 cancellation
    logp = torch.full((1, 8), -1.0)
    m = mismatch_metrics(logp, logp + 1e-4, torch.ones(1, 8))
    assert float(m["k3_kl"]) == pytest.approx(5e-9, rel=0.02)


def test_metrics_report_the_correction() -> None:
    logp_trainer = LOGP_ROLLOUT + LOG_R
    corr = compute_correction(logp_trainer, LOGP_ROLLOUT, MASK, CorrectionConfig(mode="token_mis", c_high=1.2))
    m = mismatch_metrics(LOGP_ROLLOUT, logp_trainer, MASK, corr)
    # log 1.2 = 0.1823: -0.2 and 0.3 leave the loss
    assert float(m["is_masked_frac"]) == pytest.approx(0.5)
    corr = compute_correction(logp_trainer, LOGP_ROLLOUT, MASK, CorrectionConfig(mode="token_tis", c_high=1.2))
    m = mismatch_metrics(LOGP_ROLLOUT, logp_trainer, MASK, corr)
    assert float(m["is_truncated_frac"]) == pytest.approx(0.25) and float(m["is_masked_frac"]) == 0.0


def test_matches_the_rollout_analysis_gap() -> None:
    from megatron_quads.rollout.analysis import logprob_gap

    logp_rollout = -torch.rand(4, 16) * 3
    logp_trainer = logp_rollout + 0.05 * torch.randn(4, 16)
    mask = torch.rand(4, 16) > 0.3
    ours = mismatch_metrics(logp_rollout, logp_trainer, mask)
    theirs = logprob_gap(logp_trainer, logp_rollout, mask)
    assert float(ours["gap_max_abs"]) == pytest.approx(theirs["max_abs"], rel=1e-6)
    assert float(ours["gap_mean_abs"]) == pytest.approx(theirs["mean_abs"], rel=1e-6)
    assert float(ours["k3_kl"]) == pytest.approx(theirs["k3_kl"], rel=1e-5)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (2, 3)])
def test_empty_or_fully_masked_batches_are_finite(shape: tuple[int, int]) -> None:
    m = mismatch_metrics(torch.full(shape, float("nan")), torch.full(shape, float("-inf")), torch.zeros(shape))
    assert all(bool(torch.isfinite(v)) for v in m.values())
    assert float(m["ratio_min"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert all(float(m[k]) == 0.0 for k in MISMATCH_KEYS if not k.startswith("ratio"))


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="logp_trainer"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_entropy_metrics_by_hand() -> None:
    # valid tokens: entropies 0.5, 2.0, 0.1, 1.0 with gaps 0.1, 0.2, 0.0, 0.3; 4 tokens -> the top fifth is 1
    entropy = torch.tensor([[0.5, 2.0, 0.1], [1.0, float("nan"), 9.0]])
    m = entropy_metrics(entropy, LOGP_ROLLOUT, LOGP_ROLLOUT + LOG_R, MASK)
    assert float(m["entropy"]) == pytest.approx(0.9, abs=1e-6)  # (0.5 + 2.0 + 0.1 + 1.0) / 4
    assert float(m["gap_high_entropy_share"]) == pytest.approx(0.2 / 0.6, abs=1e-6)


def test_a_gap_that_ignores_the_entropy_puts_a_fifth_of_it_on_the_top_fifth() -> None:
    entropy = torch.rand(4, 25, generator=torch.Generator().manual_seed(0))
    logp = torch.full((4, 25), -1.0)
    m = entropy_metrics(entropy, logp, logp + 0.3, torch.ones(4, 25))
    assert float(m["gap_high_entropy_share"]) == pytest.approx(0.2, abs=1e-6)
    assert float(m["entropy"]) == pytest.approx(float(entropy.mean()), abs=1e-6)


@pytest.mark.parametrize("shape", [(0, 3), (2, 3)])
def test_entropy_metrics_of_empty_or_gapless_batches_are_zero(shape: tuple[int, int]) -> None:
    m = entropy_metrics(torch.ones(shape), torch.zeros(shape), torch.zeros(shape), torch.zeros(shape))
    assert float(m["entropy"]) == 0.0 and float(m["gap_high_entropy_share"]) == 0.0
    m = entropy_metrics(torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    assert float(m["entropy"]) == 1.0 and float(m["gap_high_entropy_share"]) == 0.0
    with pytest.raises(ValueError, match="entropy"):
        entropy_metrics(torch.ones(2, 4), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
