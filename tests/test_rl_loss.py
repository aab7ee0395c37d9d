"""GRPO clipped policy loss: hand-computed clipping, aggregation, KL, corrections, gradients, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from megatron_quads.rl import (
    BatchKeys,
    PolicyLoss,
    PolicyLossConfig,
    aggregate,
    clipped_token_loss,
    k3_kl,
    policy_loss,
)

NAN = float("nan")
AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")


def _ratio_case(ratios: list[float], advantages: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp with grad, logp_old, advantages), one sequence, with exp(logp - logp_old) = ratios."""
    logp_old = torch.full((1, len(ratios)), -1.0)
    logp = (logp_old + torch.log(torch.tensor([ratios]))).requires_grad_()
    return logp, logp_old, torch.tensor([advantages])


# ---------------------------------------------------------------- per-token clipping


def test_clip_higher_is_asymmetric() -> None:
    # (A, ratio) -> -min(r A, clip(r, 0.8, 1.28) A)
    logp, logp_old, adv = _ratio_case([1.5, 1.25, 0.7, 1.5, 0.5, 0.9], [1.0, 1.0, -1.0, -1.0, 2.0, -0.5])
    tok = clipped_token_loss(logp, logp_old, adv, torch.ones(1, 6), eps_low=0.2, eps_high=0.28)
    # 1.5 -> clipped at 1.28; 1.25 inside [0.8, 1.28]; 0.7 -> clipped at 0.8 (A < 0); ratio 1.5 with
    # A < 0 is not clipped (min picks r A); A = 2, r = 0.5 is not clipped (min picks r A = 1);
    # 0.9 inside
    expected = torch.tensor([[-1.28, -1.25, 0.8, 1.5, -1.0, 0.45]])
    assert torch.allclose(tok.loss, expected, atol=1e-6)
    assert tok.clipped_high.tolist() == [[True, False, False, False, False, False]]
    assert tok.clipped_low.tolist() == [[False, False, True, False, False, False]]
    # symmetric eps 0.2 clips ratio 1.25 at 1.2 as well
    sym = clipped_token_loss(logp, logp_old, adv, torch.ones(1, 6), eps_low=0.2, eps_high=0.2)
    assert sym.loss[0, 1].item() == pytest.approx(-1.2, abs=1e-6)
    assert sym.clipped_high[0, 1]


def test_clipped_tokens_have_no_gradient() -> None:
    logp, logp_old, adv = _ratio_case([1.5, 1.25, 0.7, 1.5], [1.0, 1.0, -1.0, -1.0])
    tok = clipped_token_loss(logp, logp_old, adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.28)
    (grad,) = torch.autograd.grad(tok.loss.sum(), logp)
    # d(-r A)/d logp = -r A where not clipped
    assert torch.allclose(grad, torch.tensor([[0.0, -1.25, 0.0, 1.5]]), atol=1e-6)


def test_dual_clip_bounds_negative_advantage_losses() -> None:
    # A = -1, ratio 4 -> PPO loss 4, dual clip c = 3 caps it at 3; A = -2, ratio 1.2 -> 2.4 < 6 untouched;
    # A = +1, ratio 5 -> clipped at 1.2 as usual (dual clip is for A < 0 only)
    logp, logp_old, adv = _ratio_case([4.0, 1.2, 5.0], [-1.0, -2.0, 1.0])
    plain = clipped_token_loss(logp, logp_old, adv, torch.ones(1, 3))
    dual = clipped_token_loss(logp, logp_old, adv, torch.ones(1, 3), dual_clip=3.0)
    assert torch.allclose(plain.loss, torch.tensor([[4.0, 2.4, -1.2]]), atol=1e-5)
    assert torch.allclose(dual.loss, torch.tensor([[3.0, 2.4, -1.2]]), atol=1e-5)
    assert dual.dual_clipped.tolist() == [[True, False, False]]
    (grad,) = torch.autograd.grad(dual.loss.sum(), logp)
    assert torch.allclose(grad, torch.tensor([[0.0, 2.4, 0.0]]), atol=1e-5)


# ---------------------------------------------------------------- aggregation


TOKEN_LOSS = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0], [7.0, 7.0, 7.0]])
TOKEN_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    ("aggregation", "loss_sum", "count"),
    [
        ("token_mean", 15.0, 5),  # (1 + 2 + 3 + 4 + 5) / 5 tokens = 3
        ("seq_mean_token_sum", 15.0, 2),  # (3 + 12) / 2 sequences = 7.5
        ("seq_mean_token_mean", 5.5, 2),  # (3/2 + 12/3) / 2 sequences = 2.75
    ],
)
def test_aggregate_by_hand(aggregation: str, loss_sum: float, count: int) -> None:
    s, n = aggregate(TOKEN_LOSS, TOKEN_MASK, aggregation)
    assert float(s) == pytest.approx(loss_sum) and int(n) == count and n.dtype == torch.int64


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [("token_mean", 0.8), ("seq_mean_token_sum", 2.0), ("seq_mean_token_mean", 0.5)],
)
def test_policy_loss_aggregations_by_hand(aggregation: str, expected: float) -> None:
    # on-policy (ratio 1): token loss -A; seq 0 (A = 1) has 2 tokens, seq 1 (A = -2) 3, seq 2 none
    # token_mean (-1 - 1 + 2 + 2 + 2) / 5; seq_mean_token_sum (-2 + 6) / 2; seq_mean_token_mean (-1 + 2) / 2
    logp = torch.randn(3, 3, requires_grad=True)
    out = policy_loss(logp, logp.detach(), torch.tensor([1.0, -2.0, NAN]), TOKEN_MASK, PolicyLossConfig(aggregation=aggregation))
    assert float(out.loss_sum / out.count) == pytest.approx(expected, abs=1e-6)
    assert float(out.stats["loss"]) == pytest.approx(expected, abs=1e-6)


def test_on_policy_gradient_is_minus_advantage_over_count() -> None:
    logp = torch.randn(3, 3, requires_grad=True)
    out = policy_loss(logp, logp.detach(), torch.tensor([1.0, -2.0, 5.0]), TOKEN_MASK)
    (grad,) = torch.autograd.grad(out.loss_sum / out.count, logp)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]) / 5
    assert torch.allclose(grad, expected, atol=1e-6)


# ---------------------------------------------------------------- KL penalty


def test_k3_kl_by_hand() -> None:
    # d = logp_ref - logp = [log 2, -log 2, 0]: k3 = [1 - log 2, log 2 - 1/2, 0]; dk3/dlogp = 1 - exp(d)
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    logp_ref = logp.detach() + torch.tensor([[math.log(2), -math.log(2), 0.0]])
    kl = k3_kl(logp, logp_ref, torch.ones(1, 3))
    assert torch.allclose(kl, torch.tensor([[0.306853, 0.193147, 0.0]]), atol=1e-6)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.5, 0.0]]), atol=1e-6)


def test_kl_penalty_adds_beta_times_k3() -> None:
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    logp_ref = logp.detach() + torch.tensor([[math.log(2), -math.log(2), 0.0]])
    adv = torch.tensor([1.0])
    cfg = PolicyLossConfig(kl_beta=0.1)
    out = policy_loss(logp, logp.detach(), adv, torch.ones(1, 3), cfg, logp_ref=logp_ref)
    # pg = -1 per token; kl mean = (0.306853 + 0.193147) / 3 = 0.166667
    assert float(out.stats["pg_loss"]) == pytest.approx(-1.0, abs=1e-6)
    assert float(out.stats["kl"]) == pytest.approx(0.5 / 3, abs=1e-6)
    assert float(out.loss_sum / out.count) == pytest.approx(-1.0 + 0.1 * 0.5 / 3, abs=1e-6)
    # beta 0 with a reference: KL reported, not in the loss
    out0 = policy_loss(logp, logp.detach(), adv, torch.ones(1, 3), logp_ref=logp_ref)
    assert float(out0.stats["kl"]) == pytest.approx(0.5 / 3, abs=1e-6)
    assert float(out0.loss_sum / out0.count) == pytest.approx(-1.0, abs=1e-6)
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(logp, logp.detach(), adv, torch.ones(1, 3), cfg)


# ---------------------------------------------------------------- corrections in the loss


def _corrected(mode: str, log_w: list[list[float]], mask: list[list[int]] | None = None):
    logp = torch.full((len(log_w), len(log_w[0])), -2.0, requires_grad=True)
    logp_old = logp.detach()  # on-policy: ratio 1, token loss -A * weight
    logp_rollout = logp_old - torch.tensor(log_w)  # w = exp(logp_old - logp_rollout)
    m = torch.ones(logp.shape) if mask is None else torch.tensor(mask)
    cfg = PolicyLossConfig(correction={"mode": mode, "c_high": 2.0})
    return logp, policy_loss(logp, logp_old, torch.ones(len(log_w)), m, cfg, logp_rollout=logp_rollout)


def test_loss_with_no_correction_and_rollout_logprobs() -> None:
    _, out = _corrected("none", [[1.0, -1.0]])
    assert float(out.loss_sum) == pytest.approx(-2.0) and int(out.count) == 2
    assert float(out.stats["mismatch_mean_abs"]) == pytest.approx(1.0)
    assert "is_masked_frac" not in out.stats


def test_loss_with_token_tis() -> None:
    # weights min(e, 2) = 2 and exp(-1) = 0.367879: token mean -(2 + 0.367879) / 2
    logp, out = _corrected("token_tis", [[1.0, -1.0]])
    assert float(out.loss_sum / out.count) == pytest.approx(-1.183940, abs=1e-6)
    assert float(out.stats["is_truncated_frac"]) == pytest.approx(0.5)
    assert float(out.stats["is_weight_mean"]) == pytest.approx(1.183940, abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss_sum / out.count, logp)
    assert torch.allclose(grad, torch.tensor([[-1.0, -0.183940]]), atol=1e-6)


def test_loss_with_token_mis() -> None:
    # log w = 1.0 > log 2 leaves the loss and the count: one token left, loss -1
    logp, out = _corrected("token_mis", [[0.5, 1.0]])
    assert float(out.loss_sum) == pytest.approx(-1.0) and int(out.count) == 1
    assert float(out.stats["is_masked_frac"]) == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(out.loss_sum / out.count, logp)
    assert torch.equal(grad, torch.tensor([[-1.0, 0.0]]))


def test_loss_with_seq_mis() -> None:
    # row 0: geometric mean exp(0.5) kept; row 1: exp(0.9) > 2 masked (token 0.3 alone would pass)
    logp, out = _corrected("seq_mis", [[0.5, 0.5], [1.5, 0.3]])
    assert float(out.loss_sum) == pytest.approx(-2.0) and int(out.count) == 2
    assert float(out.stats["is_masked_frac"]) == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(out.loss_sum / out.count, logp)
    assert torch.equal(grad, torch.tensor([[-0.5, -0.5], [0.0, 0.0]]))


def test_correction_needs_rollout_logprobs() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    cfg = PolicyLossConfig(correction={"mode": "token_tis"})
    with pytest.raises(ValueError, match="logp_rollout"):
        policy_loss(logp, logp.detach(), torch.ones(1), torch.ones(1, 2), cfg)


# ---------------------------------------------------------------- gradient only through logp


@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mis", "seq_mis"])
def test_gradient_flows_only_through_logp(mode: str) -> None:
    b, t = 4, 6
    logp = (-torch.rand(b, t) * 2).requires_grad_()
    others = {
        "logp_old": (logp.detach() + 0.3 * torch.randn(b, t)).requires_grad_(),
        "advantages": torch.randn(b).requires_grad_(),
        "logp_rollout": (logp.detach() + 0.3 * torch.randn(b, t)).requires_grad_(),
        "logp_ref": (logp.detach() + 0.3 * torch.randn(b, t)).requires_grad_(),
    }
    cfg = PolicyLossConfig(eps_high=0.28, dual_clip=3.0, kl_beta=0.05, correction={"mode": mode})
    out = policy_loss(
        logp, others["logp_old"], others["advantages"], torch.ones(b, t), cfg,
        logp_rollout=others["logp_rollout"], logp_ref=others["logp_ref"],
    )
    grads = torch.autograd.grad(out.loss_sum, [logp, *others.values()], allow_unused=True)
    assert grads[0] is not None and bool(grads[0].abs().sum() > 0)
    assert all(g is None for g in grads[1:])
    assert out.correction is not None and not out.correction.weight.requires_grad
    assert all(not v.requires_grad for v in out.stats.values())


# ---------------------------------------------------------------- empty and masked batches


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mis", "seq_mis"])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (3, 4)])
def test_empty_or_fully_masked_gives_zero_loss_and_count(aggregation: str, mode: str, shape: tuple[int, int]) -> None:
    # every masked position holds NaN/inf: none of it may reach the loss, the metrics or the gradient
    logp = torch.full(shape, NAN).requires_grad_()
    cfg = PolicyLossConfig(aggregation=aggregation, dual_clip=3.0, kl_beta=0.1, correction={"mode": mode})
    out = policy_loss(
        logp, torch.full(shape, float("-inf")), torch.full(shape[:1], NAN), torch.zeros(shape), cfg,
        logp_rollout=torch.full(shape, float("inf")), logp_ref=torch.full(shape, NAN),
    )
    assert float(out.loss_sum) == 0.0 and int(out.count) == 0
    assert all(bool(torch.isfinite(v)) for v in out.trainer_metrics().values())
    (grad,) = torch.autograd.grad(out.loss_sum, logp)
    assert torch.equal(grad, torch.zeros(shape))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_sequences_and_padding_do_not_leak(aggregation: str) -> None:
    # seq 1 fully masked (a whole GRPO group could be), padding NaN: same result as dropping them
    logp = torch.tensor([[-1.0, -2.0, NAN], [NAN, NAN, NAN], [-0.5, -0.1, -3.0]], requires_grad=True)
    logp_old = torch.tensor([[-1.1, -1.9, NAN], [NAN, NAN, NAN], [-0.4, -0.1, -2.5]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([0.5, NAN, -1.0])
    cfg = PolicyLossConfig(aggregation=aggregation)
    out = policy_loss(logp, logp_old, adv, mask, cfg)
    keep = [0, 2]
    ref = policy_loss(
        logp[keep].nan_to_num(0.0), logp_old[keep].nan_to_num(0.0), adv[keep], mask[keep], cfg
    )
    assert float(out.loss_sum) == pytest.approx(float(ref.loss_sum), abs=1e-6) and int(out.count) == int(ref.count)
    (grad,) = torch.autograd.grad(out.loss_sum, logp)
    assert bool(torch.isfinite(grad).all()) and torch.equal(grad[1], torch.zeros(3))


# ---------------------------------------------------------------- the trainer's (sum, count) contract


def _random_batch(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[1] = 0.0  # a fully masked sequence
    logp = -torch.rand(b, t, generator=g) * 3
    return {
        "logp": logp,
        "logp_old": logp + 0.3 * torch.randn(b, t, generator=g),
        "logp_rollout": logp + 0.3 * torch.randn(b, t, generator=g),
        "logp_ref": logp + 0.1 * torch.randn(b, t, generator=g),
        "advantages": torch.randn(b, generator=g),
        "mask": mask,
    }


def _loss_and_grad(fn: PolicyLoss, batch: dict[str, torch.Tensor], mbs: int) -> tuple[float, torch.Tensor, dict]:
    """What train_step does: sum of loss_sums / sum of counts, and count-weighted metric averages."""
    logp = batch["logp"].clone().requires_grad_()
    sums, counts, metrics = [], [], {}
    for i in range(0, max(logp.shape[0], 1), mbs):  # an empty batch is one empty micro-batch
        mb = {k: v[i : i + mbs] for k, v in batch.items() if k != "logp"}
        s, c, m = fn(logp[i : i + mbs], mb)
        sums.append(s)
        counts.append(c)
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    total = torch.stack(counts).sum()
    loss = torch.stack(sums).sum() / total.clamp(min=1)
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss), grad, {k: float(v / total.clamp(min=1)) for k, v in metrics.items()}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", ["none", "token_tis", "token_mis", "seq_mis"])
def test_micro_batches_reproduce_the_whole_batch(aggregation: str, mode: str) -> None:
    batch = _random_batch(8, 12, seed=3)
    cfg = PolicyLossConfig(
        eps_high=0.28, dual_clip=3.0, kl_beta=0.05, aggregation=aggregation, correction={"mode": mode, "c_high": 1.5}
    )
    fn = PolicyLoss(cfg)
    loss_all, grad_all, metrics_all = _loss_and_grad(fn, batch, mbs=8)
    for mbs in (1, 3):  # 3: a ragged last micro-batch
        loss, grad, metrics = _loss_and_grad(fn, batch, mbs)
        assert loss == pytest.approx(loss_all, abs=1e-6)
        assert torch.allclose(grad, grad_all, atol=1e-7)
        if aggregation == "token_mean":  # metrics over loss tokens are exact token means
            for k in ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean"):
                assert metrics[k] == pytest.approx(metrics_all[k], abs=1e-6)
    # and the whole-batch number is the token mean itself
    if aggregation == "token_mean":
        out = policy_loss(
            batch["logp"], batch["logp_old"], batch["advantages"], batch["mask"], cfg,
            logp_rollout=batch["logp_rollout"], logp_ref=batch["logp_ref"],
        )
        keep = out.correction.mask
        assert loss_all == pytest.approx(float(out.loss_sum / keep.sum()), abs=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(0, 6),
    t=st.integers(0, 5),
    mbs=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    aggregation=st.sampled_from(AGGREGATIONS),
    mode=st.sampled_from(["none", "token_tis", "token_mis", "seq_mis"]),
)
def test_property_finite_and_micro_batch_invariant(b: int, t: int, mbs: int, seed: int, aggregation: str, mode: str) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.5

    def noise() -> torch.Tensor:
        return torch.where(mask, 0.5 * torch.randn(b, t, generator=g), torch.tensor(NAN))

    logp = -torch.rand(b, t, generator=g)
    batch = {
        "logp": torch.where(mask, logp, torch.tensor(NAN)),
        "logp_old": logp + noise(),
        "logp_rollout": logp + noise(),
        "logp_ref": logp + noise(),
        "advantages": torch.randn(b, generator=g),
        "mask": mask,
    }
    fn = PolicyLoss(PolicyLossConfig(dual_clip=2.0, kl_beta=0.1, aggregation=aggregation, correction={"mode": mode}))
    loss_all, grad_all, metrics = _loss_and_grad(fn, batch, mbs=max(b, 1))
    loss, grad, _ = _loss_and_grad(fn, batch, mbs)
    assert math.isfinite(loss_all) and bool(torch.isfinite(grad_all).all())
    assert all(math.isfinite(v) for v in metrics.values())
    assert loss == pytest.approx(loss_all, abs=1e-5)
    assert torch.allclose(grad, grad_all, atol=1e-6)


# ---------------------------------------------------------------- the callable


def test_policy_loss_callable_reads_the_micro_batch() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mb = {
        "tokens": torch.tensor([[5, 6, 7, 8]]),
        "mask": torch.tensor([[0, 1, 1, 0]]),  # [b, s], aligned with tokens: first column dropped
        "advantages": torch.tensor([2.0]),
    }
    loss_sum, count, metrics = PolicyLoss(PolicyLossConfig(), BatchKeys(logp_old=None))(logprobs, mb)
    assert float(loss_sum) == pytest.approx(-4.0) and int(count) == 2  # tokens 0, 1 of logprobs, -A each
    assert float(metrics["loss"] / count) == pytest.approx(-2.0)
    assert {"pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean"} <= set(metrics)
    with pytest.raises(KeyError, match="logp_old"):
        PolicyLoss()(logprobs, mb)
    with pytest.raises(KeyError, match="logp_rollout"):
        PolicyLoss(PolicyLossConfig(correction={"mode": "token_mis"}), BatchKeys(logp_old=None))(logprobs, mb)
    with pytest.raises(ValueError, match="mask"):
        PolicyLoss(keys=BatchKeys(logp_old=None))(logprobs, {**mb, "mask": torch.ones(1, 7)})


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValidationError, match="eps_low"):
        PolicyLossConfig(eps_low=1.0)
    with pytest.raises(ValidationError, match="eps_high"):
        PolicyLossConfig(eps_high=-0.1)
    with pytest.raises(ValidationError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValidationError, match="kl_beta"):
        PolicyLossConfig(kl_beta=-1.0)
    with pytest.raises(ValidationError, match="aggregation"):
        PolicyLossConfig(aggregation="seq_sum")
    with pytest.raises(ValidationError, match="correction.c_high"):
        PolicyLossConfig(correction={"mode": "token_tis", "c_high": 1.0})
    with pytest.raises(ValidationError, match="clip_eps"):
        PolicyLossConfig(clip_eps=0.2)
