"""Per-channel activation statistics for choosing RAC channel sets, from hooks or online.

Two ways to fill them, one accumulator:

- calibration: attach :class:`RacCalibrator` to a model's linears (forward pre-hooks), run sample
  batches, then :meth:`RacCalibrator.select` the channels;
- online: a rollout engine keeps a calibrator attached with ``momentum`` (an exponential moving
  average) while it generates, and re-selects the channels at every weight sync with the new weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.rollout.rac import DEFAULT_RATIO, ChannelStatistic, num_residual_channels, select_channels
from megatron_quads.rollout.w4a4 import ActivationScale, activation_amax


class ChannelStats:
    """Running per-input-channel means of ``r^2`` (quantization residual) and ``|x|`` for one linear,
    and ``amax``, the largest ``|x|`` seen (over all batches, also with ``momentum``)."""

    def __init__(self, in_features: int, momentum: float | None = None) -> None:
        if momentum is not None and not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1] (weight of the newest batch), got {momentum}")
        self.in_features = in_features
        self.momentum = momentum
        self.tokens = 0
        self.residual_sq = torch.zeros(in_features, dtype=torch.float64)
        self.abs_activation = torch.zeros(in_features, dtype=torch.float64)
        self.amax = 0.0

    @torch.no_grad()
    def update(self, x: torch.Tensor, mode: ActivationScale = ActivationScale.PER_TOKEN) -> None:
        """Add a batch of inputs ``x [..., K]`` (quantized as the rollout quantizes them)."""
        x2 = x.detach().reshape(-1, x.shape[-1])
        if x2.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        if not x2.shape[0]:
            return
        amax = activation_amax(x2, ActivationScale.PER_TENSOR if mode == ActivationScale.STATIC else mode)
        xq = quantize(x2, global_amax=amax).dequantize(torch.float32)
        batch_r2 = (x2.float() - xq).double().square().mean(0).cpu()
        batch_abs = x2.double().abs().mean(0).cpu()
        n = x2.shape[0]
        self.amax = max(self.amax, float(x2.abs().amax()))
        if self.momentum is None:  # exact running mean over all tokens seen
            total = self.tokens + n
            self.residual_sq += (batch_r2 - self.residual_sq) * (n / total)
            self.abs_activation += (batch_abs - self.abs_activation) * (n / total)
        elif self.tokens == 0:
            self.residual_sq.copy_(batch_r2)
            self.abs_activation.copy_(batch_abs)
        else:
            self.residual_sq.lerp_(batch_r2, self.momentum)
            self.abs_activation.lerp_(batch_abs, self.momentum)
        self.tokens += n

    def scores(self, statistic: ChannelStatistic, weight: torch.Tensor | NVFP4Tensor | None = None) -> torch.Tensor:
        """Per-channel score for ``statistic``; OUTPUT_ERROR needs the (quantized) weight ``[N, K]``."""
        if statistic == ChannelStatistic.RESIDUAL_ENERGY:
            return self.residual_sq.clone()
        if statistic == ChannelStatistic.ACTIVATION_MAGNITUDE:
            return self.abs_activation.clone()
        if weight is None:
            raise ValueError("the output_error statistic needs the layer's weight")
        dense = weight.dequantize(torch.float32) if isinstance(weight, NVFP4Tensor) else weight.detach().float()
        column_sq = dense.double().square().sum(0).cpu()
        return self.residual_sq * column_sq


STACK_UPDATE_ELEMENTS = 2**24
"""Rows of :meth:`StackChannelStats.update` are taken in chunks of about this many elements (their float64
residuals: 128 MiB), so that a long calibration prefill's working set stays bounded."""


class StackChannelStats:
    """:class:`ChannelStats` of every expert of one projection, kept as ``[experts, K]`` tensors on the
    inputs' device: a batch of routed rows updates all experts at once without a host sync, and
    :meth:`per_expert` hands the statistics over once, at the end. Each expert's statistics follow
    :meth:`ChannelStats.update` on its rows of the batch (per-token activation scales, exact running
    means); rows whose expert id is ``experts`` (e.g. another rank's experts) are not recorded."""

    def __init__(self, experts: int, in_features: int, device: torch.device | str = "cpu") -> None:
        self.experts = experts
        self.in_features = in_features
        # one extra row takes the rows not recorded, so that no boolean mask reaches the host
        self.residual_sq = torch.zeros(experts + 1, in_features, dtype=torch.float64, device=device)
        self.abs_activation = torch.zeros_like(self.residual_sq)
        self.tokens = torch.zeros(experts + 1, dtype=torch.int64, device=device)
        self.amax = torch.zeros(experts + 1, dtype=torch.float32, device=device)

    @torch.no_grad()
    def update(self, rows: torch.Tensor, experts: torch.Tensor) -> None:
        """Add routed rows ``rows [R, K]`` of experts ``experts [R]`` (ids in ``[0, experts]``)."""
        if rows.shape[-1] != self.in_features or rows.dim() != 2 or experts.shape != rows.shape[:1]:
            raise ValueError(f"expected rows [R, {self.in_features}] and their expert ids [R], got "
                             f"{tuple(rows.shape)} and {tuple(experts.shape)}")
        if not rows.shape[0]:
            return
        rows = rows.detach()
        ids = experts.to(device=self.tokens.device, dtype=torch.int64)
        count = torch.zeros_like(self.tokens).index_add_(0, ids, torch.ones_like(ids))
        batch_r2, batch_abs = torch.zeros_like(self.residual_sq), torch.zeros_like(self.abs_activation)
        amax = torch.zeros_like(self.amax)
        step = max(1, STACK_UPDATE_ELEMENTS // self.in_features)
        for start in range(0, rows.shape[0], step):  # float64 working sets of bounded size
            part, part_ids = rows[start:start + step], ids[start:start + step]
            xq = quantize(part, global_amax=activation_amax(part, ActivationScale.PER_TOKEN)).dequantize(torch.float32)
            batch_r2.index_add_(0, part_ids, (part.float() - xq).double().square())
            batch_abs.index_add_(0, part_ids, part.double().abs())
            amax.scatter_reduce_(0, part_ids, part.abs().amax(-1).float(), "amax")
        total = self.tokens + count
        # the running mean's step n / total, applied to the batch mean sum / n: 0 where no row came
        weight = (count.double() / total.clamp(min=1).double()).unsqueeze(1)
        batch_count = count.clamp(min=1).double().unsqueeze(1)
        self.residual_sq += (batch_r2 / batch_count - self.residual_sq) * weight
        self.abs_activation += (batch_abs / batch_count - self.abs_activation) * weight
        self.amax = torch.maximum(self.amax, amax)
        self.tokens = total

    def token_counts(self) -> list[int]:
        """Rows recorded per expert (one host read)."""
        return self.tokens[: self.experts].tolist()

    def per_expert(self) -> list[ChannelStats]:
        """Each expert's statistics as a CPU :class:`ChannelStats` (one host copy of each tensor)."""
        residual, absolute = self.residual_sq[: self.experts].cpu(), self.abs_activation[: self.experts].cpu()
        tokens, amax = self.token_counts(), self.amax[: self.experts].tolist()
        out = []
        for e in range(self.experts):
            stats = ChannelStats(self.in_features)
            stats.residual_sq, stats.abs_activation = residual[e].clone(), absolute[e].clone()
            stats.tokens, stats.amax = tokens[e], amax[e]
            out.append(stats)
        return out


class RacCalibrator:
    """Collects :class:`ChannelStats` for named modules through forward pre-hooks on their input."""

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        in_features: Mapping[str, int],
        momentum: float | None = None,
        mode: ActivationScale = ActivationScale.PER_TOKEN,
    ) -> None:
        self.mode = mode
        self.stats = {name: ChannelStats(in_features[name], momentum) for name in modules}
        self._handles = [
            module.register_forward_pre_hook(self._hook(name)) for name, module in modules.items()
        ]

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.stats[name].update(args[0], self.mode)

        return hook

    def detach(self) -> None:
        """Remove the hooks (statistics are kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def select(
        self,
        ratio: float = DEFAULT_RATIO,
        statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR,
        weights: Mapping[str, torch.Tensor | NVFP4Tensor] | None = None,
        pools: Mapping[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Residual channels (sorted, int32) per module: :func:`select_from_stats` of the hooks' statistics."""
        return select_from_stats(self.stats, ratio, statistic, weights, pools)


def select_from_stats(
    stats: Mapping[str, ChannelStats],
    ratio: float = DEFAULT_RATIO,
    statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR,
    weights: Mapping[str, torch.Tensor | NVFP4Tensor] | None = None,
    pools: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Residual channels (sorted, int32) per module from its statistics.

    A module that saw no input is skipped, unless ``pools`` puts it in a group (e.g. one MoE
    layer's experts of one projection, which read the same hidden states): it then gets the
    channels of the group's pooled statistics (token-weighted means over the modules that saw input).
    """
    pooled = _pooled(stats, pools) if pools else {}
    chosen = {}
    for name, module_stats in stats.items():
        if module_stats.tokens == 0:
            module_stats = pooled.get(pools.get(name)) if pools else None
            if module_stats is None:
                continue
        weight = None if weights is None else weights.get(name)
        chosen[name] = select_channels(module_stats.scores(statistic, weight), ratio)
    return chosen


STACK_SCORE_BYTES = 256 * 2**20
"""The float64 working set of :func:`select_stack_channels`' output-error scores: experts are scored in
chunks of about this many bytes of ``[experts, N, K]``."""


def select_stack_channels(stats: Sequence[ChannelStats], weight: NVFP4Tensor, ratio: float = DEFAULT_RATIO,
                          statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> torch.Tensor | None:
    """The residual channels ``[experts, |S|]`` (int32, CPU) of one projection's experts from their
    statistics and stacked weight ``[experts, N, K]``, all experts at once: each row is what
    :func:`select_from_stats` chooses for that expert with the experts pooled (an expert that saw no
    input takes the pooled statistics of those that did). None when no expert saw input."""
    if len(stats) != weight.shape[0]:
        raise ValueError(f"{len(stats)} experts' statistics for a stack of {weight.shape[0]} experts")
    pooled = pool_stats(stats)
    if pooled.tokens == 0:
        return None
    chosen = [s if s.tokens else pooled for s in stats]
    if statistic == ChannelStatistic.RESIDUAL_ENERGY:
        scores = torch.stack([s.residual_sq for s in chosen])
    elif statistic == ChannelStatistic.ACTIVATION_MAGNITUDE:
        scores = torch.stack([s.abs_activation for s in chosen])
    else:
        scores = torch.stack([s.residual_sq for s in chosen]) * _column_energy(weight)
    count = num_residual_channels(scores.shape[-1], ratio)
    # stable descending order per expert: equal scores keep index order, as select_channels does
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :count]
    return torch.sort(order, dim=-1).values.to(torch.int32)


def _column_energy(weight: NVFP4Tensor) -> torch.Tensor:
    """``sum_n q(W)[e, n, k]^2`` per expert and input channel, float64 on the CPU ``[experts, K]``."""
    experts, rows, columns = weight.shape
    decode = weight.weight_scale_2.reshape(-1).expand(experts) if weight.weight_scale_2.numel() == 1 else \
        weight.weight_scale_2.reshape(experts)
    chunk = max(1, STACK_SCORE_BYTES // (8 * rows * columns))
    parts = []
    for start in range(0, experts, chunk):
        stop = min(start + chunk, experts)
        part = NVFP4Tensor(codes=weight.codes[start:stop], scales=weight.scales[start:stop],
                           weight_scale_2=decode[start:stop].reshape(-1, 1),  # one decode scale per expert
                           shape=torch.Size((stop - start, rows, columns)), dtype=weight.dtype)
        parts.append(part.dequantize(torch.float32).double().square().sum(-2).cpu())
    return torch.cat(parts)


def pool_stats(stats: Sequence[ChannelStats]) -> ChannelStats:
    """One :class:`ChannelStats` for modules that read the same input: token-weighted means of the
    statistics, the largest ``amax`` and the total token count (modules that saw no input add nothing)."""
    if not stats:
        raise ValueError("pool_stats needs at least one ChannelStats")
    total = ChannelStats(stats[0].in_features)
    for part in stats:
        if part.in_features != total.in_features:
            raise ValueError(f"cannot pool statistics of {total.in_features} and {part.in_features} input features")
        if part.tokens == 0:
            continue
        weight = part.tokens / (total.tokens + part.tokens)
        total.residual_sq += (part.residual_sq - total.residual_sq) * weight
        total.abs_activation += (part.abs_activation - total.abs_activation) * weight
        total.amax = max(total.amax, part.amax)
        total.tokens += part.tokens
    return total


def _pooled(all_stats: Mapping[str, ChannelStats], pools: Mapping[str, str]) -> dict[str, ChannelStats]:
    """Token-weighted statistics of each group over its modules that saw input."""
    groups: dict[str, list[ChannelStats]] = {}
    for name, stats in all_stats.items():
        group = pools.get(name)
        if group is not None and stats.tokens:
            groups.setdefault(group, []).append(stats)
    pooled = {}
    for group, members in groups.items():
        try:
            pooled[group] = pool_stats(members)
        except ValueError as err:
            raise ValueError(f"pool {group!r} mixes modules of different widths: {err}") from None
    return pooled
