"""The GRPO/PPO clipped policy loss, as the trainer's per-token ``(loss_sum, count, metrics)`` triple.

Per response token ``t`` (only ``logp`` carries gradient; everything else is detached):

    ratio_t = exp(logp_t - logp_old_t)
    pg_t    = -min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t)
    pg_t    = min(pg_t, -c A_t)                    if dual_clip = c and A_t < 0
    pg_t   *= correction weight (token_tis)
    kl_t    = exp(d_t) - d_t - 1,  d_t = logp_ref_t - logp_t              (k3)
    loss_t  = pg_t + kl_beta kl_t

and the tokens in the loss are the response tokens a correction did not mask out. Aggregation
(``count`` is what the trainer divides the global sum of ``loss_sum`` by):

| aggregation           | loss_sum                              | count                    |
|-----------------------|---------------------------------------|--------------------------|
| token_mean            | sum_i sum_t loss_it                   | tokens in the loss       |
| seq_mean_token_sum    | sum_i sum_t loss_it                   | sequences with a token   |
| seq_mean_token_mean   | sum_i (sum_t loss_it) / n_i           | sequences with a token   |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megatron_quads.rl._tensor import as_mask, check_shape, masked, per_token, safe_div
from megatron_quads.rl.correction import Correction, compute_correction
from megatron_quads.rl.metrics import mismatch_metrics
from megatron_quads.rl.settings import (  # noqa: F401 (re-exported)
    BatchKeys,
    CorrectionConfig,
    CorrectionMode,
    LossAggregation,
    PolicyLossConfig,
)

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""(loss summed over the micro-batch, units it is normalised by, metrics as sums over those units)."""


@dataclass(frozen=True)
class TokenLoss:
    """Per-token clipped policy-gradient loss and which clip was active (all ``[B, T]``)."""

    loss: torch.Tensor
    """``pg_t`` (with gradient through ``logp``), 0 outside the mask."""
    ratio: torch.Tensor
    """``exp(logp - logp_old)``, detached, 1 outside the mask."""
    clipped_low: torch.Tensor
    """``A < 0`` and ``ratio < 1 - eps_low``: the clipped term is active (no gradient)."""
    clipped_high: torch.Tensor
    """``A > 0`` and ``ratio > 1 + eps_high``: the clipped term is active (no gradient)."""
    dual_clipped: torch.Tensor
    """``A < 0`` and the dual clip ``-c A`` bounds the loss (no gradient)."""


@dataclass(frozen=True)
class PolicyLossResult:
    """A micro-batch's loss: ``loss_sum`` and ``count`` for the trainer, and micro-batch means in ``stats``."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Means over this micro-batch (0 when it has no tokens); ``stats['loss'] = loss_sum / count``."""
    correction: Correction | None = None

    def trainer_metrics(self) -> dict[str, torch.Tensor]:
        """``stats`` times ``count``: the trainer divides summed metrics by summed counts."""
        return {k: v.detach() * self.count.to(v.dtype) for k, v in self.stats.items()}

    def as_tuple(self) -> LossOutput:
        """``(loss_sum, count, trainer_metrics())``, what ``PolicyWorker.train_step``'s ``loss_fn`` returns."""
        return self.loss_sum, self.count, self.trainer_metrics()


def clipped_token_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> TokenLoss:
    """Per-token PPO loss ``-min(r A, clip(r) A)`` (with dual clip); ``advantages`` is ``[B]`` or ``[B, T]``."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    check_shape("logp_old", logp_old, logp.shape)
    valid = as_mask(mask, logp.shape)
    adv = masked(per_token("advantages", advantages, logp.shape).detach().to(logp.dtype), valid)
    ratio = masked(logp - logp_old.detach().to(logp.dtype), valid).exp()
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(surr, surr_clipped)
    negative = valid & (adv < 0)
    dual_clipped = torch.zeros_like(valid)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual_clipped = negative & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    r = ratio.detach()
    return TokenLoss(
        loss=masked(loss, valid),
        ratio=r,
        clipped_low=negative & (r < 1.0 - eps_low),
        clipped_high=valid & (adv > 0) & (r > 1.0 + eps_high),
        dual_clipped=dual_clipped,
    )


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 ``exp(d) - d - 1`` with ``d = logp_ref - logp`` (gradient through ``logp``), 0 outside ``mask``."""
    check_shape("logp_ref", logp_ref, logp.shape)
    valid = as_mask(mask, logp.shape)
    d = masked(logp_ref.detach().to(logp.dtype) - logp, valid)
    return masked(torch.expm1(d) - d, valid)


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)`` of ``token_loss [B, T]`` over ``mask``; ``count`` is int64, 0 for no tokens."""
    valid = as_mask(mask, token_loss.shape)
    mode = LossAggregation(aggregation)
    per_seq = masked(token_loss, valid).sum(-1)
    n = valid.sum(-1)
    if mode == LossAggregation.TOKEN_MEAN:
        return per_seq.sum(), n.sum()
    if mode == LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = safe_div(per_seq, n)
    return per_seq.sum(), (n > 0).sum()


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    logp_rollout: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
) -> PolicyLossResult:
    """The configured loss of one micro-batch; all tensors ``[B, T]`` (``advantages`` may be ``[B]``)."""
    cfg = config or PolicyLossConfig()
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    check_shape("logp_old", logp_old, logp.shape)
    valid = as_mask(mask, logp.shape)
    if cfg.kl_beta > 0 and logp_ref is None:
        raise ValueError("kl_beta > 0 needs logp_ref (the reference policy's log-probs)")
    corr = None
    if logp_rollout is not None:
        corr = compute_correction(logp_old, logp_rollout, valid, cfg.correction)
    elif cfg.correction.mode != CorrectionMode.NONE:
        raise ValueError(f"correction.mode={cfg.correction.mode.value!r} needs logp_rollout")
    keep = valid if corr is None else corr.mask
    tok = clipped_token_loss(
        logp, logp_old, advantages, keep, eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip
    )
    pg = tok.loss if corr is None else tok.loss * corr.weight.to(tok.loss.dtype)
    pg_sum, count = aggregate(pg, keep, cfg.aggregation)
    loss_sum = pg_sum
    stats = {"pg_loss": safe_div(pg_sum.detach(), count)}
    if logp_ref is not None:
        kl_sum, _ = aggregate(k3_kl(logp, logp_ref, keep), keep, cfg.aggregation)
        if cfg.kl_beta > 0:
            loss_sum = loss_sum + cfg.kl_beta * kl_sum
        stats["kl"] = safe_div(kl_sum.detach(), count)
    stats["loss"] = safe_div(loss_sum.detach(), count)
    n_keep = keep.sum()
    stats["clip_frac_low"] = safe_div(tok.clipped_low.sum().float(), n_keep)
    stats["clip_frac_high"] = safe_div(tok.clipped_high.sum().float(), n_keep)
    stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
    if cfg.dual_clip is not None:
        stats["dual_clip_frac"] = safe_div(tok.dual_clipped.sum().float(), n_keep)
    stats["ratio_mean"] = safe_div(masked(tok.ratio, keep).sum(), n_keep)
    if corr is not None:
        gap = mismatch_metrics(logp_rollout, logp_old, valid, corr)
        stats["mismatch_mean_abs"] = gap["gap_mean_abs"]
        stats["mismatch_k3_kl"] = gap["k3_kl"]
        if cfg.correction.mode != CorrectionMode.NONE:
            stats["is_masked_frac"] = gap["is_masked_frac"]
            stats["is_truncated_frac"] = gap["is_truncated_frac"]
            stats["is_weight_mean"] = safe_div(masked(corr.weight, keep).sum(), n_keep)
    return PolicyLossResult(loss_sum=loss_sum, count=count, stats={k: v.float() for k, v in stats.items()}, correction=corr)


class PolicyLoss:
    """``loss_fn(logprobs [b, s-1], micro_batch) -> (loss_sum, count, metrics)`` for ``PolicyWorker.train_step``.

    Per-token micro-batch tensors may be ``[b, s-1]`` (aligned with ``logprobs``) or ``[b, s]``
    (aligned with ``tokens``; their first column is dropped); advantages may also be ``[b]``.
    """

    def __init__(self, config: PolicyLossConfig | None = None, keys: BatchKeys | None = None) -> None:
        self.config = config or PolicyLossConfig()
        self.keys = keys or BatchKeys()

    def __call__(self, logprobs: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]) -> LossOutput:
        """The trainer's loss triple for one micro-batch."""
        k, cfg = self.keys, self.config
        need_rollout = cfg.correction.mode != CorrectionMode.NONE
        return policy_loss(
            logprobs,
            logprobs.detach() if k.logp_old is None else self._get(micro_batch, k.logp_old, logprobs),
            self._get(micro_batch, k.advantages, logprobs, per_sequence_ok=True),
            self._get(micro_batch, k.mask, logprobs),
            cfg,
            logp_rollout=self._get(micro_batch, k.logp_rollout, logprobs, required=need_rollout),
            logp_ref=self._get(micro_batch, k.logp_ref, logprobs, required=cfg.kl_beta > 0),
        ).as_tuple()

    @staticmethod
    def _get(
        mb: Mapping[str, torch.Tensor],
        key: str,
        logprobs: torch.Tensor,
        *,
        required: bool = True,
        per_sequence_ok: bool = False,
    ) -> torch.Tensor | None:
        """``mb[key]`` aligned with ``logprobs`` (``None`` if absent and not required)."""
        if key not in mb:
            if required:
                raise KeyError(f"micro-batch has no {key!r} (keys: {sorted(mb)})")
            return None
        x = mb[key]
        b, t = logprobs.shape
        if per_sequence_ok and x.dim() == 1:
            return x
        if x.dim() == 2 and x.shape[0] == b and x.shape[1] == t + 1:
            return x[:, 1:]
        check_shape(key, x, logprobs.shape)
        return x
