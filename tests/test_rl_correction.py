"""Rollout/trainer importance-sampling corrections: hand-computed weights, masks and fractions."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from megatron_quads.rl import CorrectionConfig, compute_correction

NAN = float("nan")
# log w = logp_old - logp_rollout per token; row 1 and 2 end in padding, row 3 is all padding
LOG_W = torch.tensor(
    [
        [0.5, 1.0, -1.0, 0.0],  # geometric mean exp(0.125): kept by seq_mis
        [0.2, 0.8, -0.3, 9.0],  # exp(0.2333): kept
        [0.9, 0.8, 0.7, NAN],  # exp(0.8) > 2: masked by seq_mis
        [NAN, NAN, NAN, NAN],
    ]
)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)


def _correction(mode: str, **kw: float):
    logp_rollout = torch.full_like(LOG_W, -1.5)
    return compute_correction(logp_rollout + LOG_W, logp_rollout, MASK, CorrectionConfig(mode=mode, **kw))


def test_none_changes_nothing() -> None:
    c = _correction("none")
    assert torch.equal(c.weight, torch.ones(4, 4)) and torch.equal(c.mask, MASK)
    assert float(c.masked_frac) == 0.0 and float(c.truncated_frac) == 0.0
    assert int(c.num_tokens) == 10 and int(c.num_seqs) == 3


def test_token_tis_truncates_at_c() -> None:
    c = _correction("token_tis", c_high=2.0)
    expected = torch.tensor(
        [
            [1.648721, 2.0, 0.367879, 1.0],  # exp(0.5), min(e, 2), exp(-1), 1
            [1.221403, 2.0, 0.740818, 1.0],  # exp(0.2), min(exp(0.8), 2), exp(-0.3), padding
            [2.0, 2.0, 2.0, 1.0],
            [1.0, 1.0, 1.0, 1.0],
        ]
    )
    assert torch.allclose(c.weight, expected, atol=1e-6)
    assert torch.equal(c.mask, MASK)  # TIS masks nothing
    assert int(c.num_truncated) == 5 and float(c.truncated_frac) == pytest.approx(0.5)
    assert float(c.masked_frac) == 0.0
    assert not c.weight.requires_grad


def test_token_mis_masks_tokens_outside_the_interval() -> None:
    c = _correction("token_mis", c_high=2.0)  # [1/2, 2]: |log w| <= 0.6931
    keep = torch.tensor([[1, 0, 0, 1], [1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(c.mask, keep)
    assert torch.equal(c.weight, torch.ones(4, 4))
    assert int(c.num_masked) == 6 and float(c.masked_frac) == pytest.approx(0.6)
    assert int(c.num_masked_seqs) == 1 and float(c.masked_seq_frac) == pytest.approx(1 / 3)


def test_token_mis_with_explicit_bounds() -> None:
    c = _correction("token_mis", c_low=0.5, c_high=3.0)  # log bounds [-0.6931, 1.0986]
    keep = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(c.mask, keep)
    assert float(c.masked_frac) == pytest.approx(0.1)


def test_seq_mis_uses_the_geometric_mean() -> None:
    c = _correction("seq_mis", c_high=2.0)
    keep = MASK.clone()
    keep[2] = False
    assert torch.equal(c.mask, keep)
    assert int(c.num_masked) == 3 and float(c.masked_frac) == pytest.approx(0.3)
    assert float(c.masked_seq_frac) == pytest.approx(1 / 3)


def test_seq_mis_is_length_independent() -> None:
    # 20 tokens at log w = 0.1: product exp(2) = 7.4 would be out of [1/2, 2]; geometric mean 1.105 is not
    logp_rollout = torch.zeros(1, 20)
    c = compute_correction(logp_rollout + 0.1, logp_rollout, torch.ones(1, 20), CorrectionConfig(mode="seq_mis"))
    assert bool(c.mask.all()) and float(c.masked_frac) == 0.0


@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mis", "seq_mis"])
@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 3)])
def test_empty_and_fully_masked(mode: str, shape: tuple[int, int]) -> None:
    logp = torch.full(shape, NAN)
    c = compute_correction(logp, torch.full(shape, float("inf")), torch.zeros(shape), CorrectionConfig(mode=mode))
    for value in (c.masked_frac, c.truncated_frac, c.masked_seq_frac):
        assert float(value) == 0.0
    assert not bool(c.mask.any())
    assert bool(torch.isfinite(c.weight).all()) and bool(torch.isfinite(c.log_ratio).all())


def test_weights_do_not_carry_gradient() -> None:
    logp_old = torch.tensor([[0.3, -0.2]], requires_grad=True)
    logp_rollout = torch.zeros(1, 2, requires_grad=True)
    c = compute_correction(logp_old, logp_rollout, torch.ones(1, 2), CorrectionConfig(mode="token_tis"))
    assert not c.weight.requires_grad and not c.log_ratio.requires_grad
    assert torch.allclose(c.weight, torch.tensor([[math.exp(0.3), math.exp(-0.2)]]))


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValidationError, match="c_high"):
        CorrectionConfig(mode="token_tis", c_high=0.5)
    with pytest.raises(ValidationError, match="c_low"):
        CorrectionConfig(mode="token_mis", c_low=1.5)
    with pytest.raises(ValidationError, match="mode"):
        CorrectionConfig(mode="seq_tis")
    with pytest.raises(ValidationError, match="threshold"):
        CorrectionConfig(threshold=2.0)
    assert CorrectionConfig(c_high=4.0).bounds == (0.25, 4.0)
