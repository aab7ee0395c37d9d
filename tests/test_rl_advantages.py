"""GRPO group advantages: hand-computed values, std normalisation on/off, degenerate groups."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from megatron_quads.rl import AdvantageConfig, group_advantages, token_advantages


def test_grpo_advantages_by_hand() -> None:
    # mean 1.5; sample std sqrt(5/3) = 1.2910; (r - 1.5) / 1.2910
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), config=AdvantageConfig(eps=0.0))
    assert torch.allclose(adv, torch.tensor([[-1.161895, -0.387298, 0.387298, 1.161895]]), atol=1e-6)


def test_population_std_option() -> None:
    # population std sqrt(5/4) = 1.1180
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), config=AdvantageConfig(eps=0.0, unbiased_std=False))
    assert torch.allclose(adv, torch.tensor([[-1.341641, -0.447214, 0.447214, 1.341641]]), atol=1e-6)


def test_eps_is_added_to_the_std() -> None:
    # [0, 2]: mean 1, sample std sqrt(2); eps = 1 - sqrt(2) + 1 makes the denominator exactly 2
    eps = 2.0 - 2.0**0.5
    adv = group_advantages(torch.tensor([[0.0, 2.0]]), config=AdvantageConfig(eps=eps))
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.5]]), atol=1e-6)


def test_dr_grpo_no_std_division() -> None:
    adv = group_advantages(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), config=AdvantageConfig(normalize_std=False))
    assert torch.equal(adv, torch.tensor([[-1.5, -0.5, 0.5, 1.5]]))


def test_flat_rewards_with_group_size() -> None:
    # groups [1, 3] (mean 2, std sqrt 2) and [5, 5] (all equal)
    adv = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), group_size=2, config=AdvantageConfig(eps=0.0))
    assert adv.shape == (4,)
    assert torch.allclose(adv, torch.tensor([-0.707107, 0.707107, 0.0, 0.0]), atol=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_all_equal_rewards_give_exact_zeros(normalize_std: bool, eps: float) -> None:
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # 0.1 * 3 / 3 != 0.1 in floats
    adv = group_advantages(rewards, config=AdvantageConfig(normalize_std=normalize_std, eps=eps))
    assert torch.equal(adv, torch.zeros(3, 3))


def test_invalid_responses_leave_the_statistics_and_get_zero() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0, float("nan")], [4.0, 9.0, 9.0, 9.0], [3.0, 3.0, 7.0, 1.0]])
    valid = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    adv = group_advantages(rewards, config=AdvantageConfig(eps=0.0), valid=valid)
    # group 0: [1, 0] -> mean 0.5, sample std 0.7071; group 1: one valid response; group 2: none valid
    expected = torch.tensor([[0.707107, -0.707107, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("rewards", "group_size"),
    [(torch.zeros(0), 4), (torch.zeros(0, 4), None), (torch.zeros(3, 0), None)],
)
def test_empty_batches(rewards: torch.Tensor, group_size: int | None) -> None:
    adv = group_advantages(rewards, group_size)
    assert adv.shape == rewards.shape


def test_integer_rewards_give_float_advantages() -> None:
    adv = group_advantages(torch.tensor([[0, 1]]), config=AdvantageConfig(normalize_std=False))
    assert adv.dtype == torch.float32 and torch.equal(adv, torch.tensor([[-0.5, 0.5]]))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6))
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(2, 4), 3)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="valid"):
        group_advantages(torch.zeros(2, 4), valid=torch.ones(2, 3))


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValidationError, match="eps"):
        AdvantageConfig(eps=-1.0)
    with pytest.raises(ValidationError, match="normalise_std"):
        AdvantageConfig(normalise_std=False)


def test_token_broadcast() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    adv = token_advantages(torch.tensor([0.5, -2.0, float("nan")]), mask)
    assert torch.equal(adv, torch.tensor([[0.5, 0.5, 0.0], [0.0, -2.0, -2.0], [0.0, 0.0, 0.0]]))
    assert token_advantages(torch.zeros(0), torch.zeros(0, 5)).shape == (0, 5)
    with pytest.raises(ValueError, match="advantages"):
        token_advantages(torch.zeros(2), mask)
