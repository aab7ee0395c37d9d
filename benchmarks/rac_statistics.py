"""Compare RAC channel-ranking statistics on linears with LLM-like outlier-channel activations.

    python benchmarks/rac_statistics.py [--out benchmarks/results/rac_statistics.md]

Synthetic layers: Gaussian activations with a few channels scaled by 10-50x (the outliers LLM
activations show), a Gaussian weight with some near-dead input columns. For each statistic and
ratio it reports the relative output error of W4A4+RAC against ``x q(W)^T`` (the AQAT trainer),
calibrated on one batch and measured on another. Results: benchmarks/results/rac_statistics.md.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from results_io import write_text_atomic

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.rollout.calibration import ChannelStats
from megatron_quads.rollout.rac import (
    ChannelStatistic,
    rac_linear,
    select_channels,
)

K, N, TOKENS, LAYERS = 1024, 512, 256, 8
RATIOS = (0.0, 0.0625, 0.125, 0.25, 0.5)


def layer(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(calibration batch, evaluation batch, weight) of one synthetic layer."""
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randperm(K, generator=gen)[:16]
    gains = torch.ones(K)
    gains[hot] = 10 + 40 * torch.rand(16, generator=gen)
    x_cal = (torch.randn(TOKENS, K, generator=gen) * gains).bfloat16()
    x_eval = (torch.randn(TOKENS, K, generator=gen) * gains).bfloat16()
    w = torch.randn(N, K, generator=gen) * 0.02
    w[:, torch.randperm(K, generator=gen)[:128]] *= 0.01  # near-dead input columns
    return x_cal, x_eval, w.bfloat16()


def main() -> None:
    """Average relative output error per statistic and ratio over the synthetic layers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rac_statistics.md"))
    args = parser.parse_args()
    errors = {(s, r): 0.0 for s in ChannelStatistic for r in RATIOS}
    for seed in range(LAYERS):
        x_cal, x_eval, w = layer(seed)
        wq = quantize(w)
        reference = x_eval.double() @ wq.dequantize(torch.float64).t()
        stats = ChannelStats(K)
        stats.update(x_cal)
        for statistic in ChannelStatistic:
            scores = stats.scores(statistic, wq)
            for ratio in RATIOS:
                channels = select_channels(scores, ratio)
                y = rac_linear(x_eval.float(), wq, channels, reblock_columns(wq, channels), accumulate_dtype=torch.float64)
                errors[(statistic, ratio)] += float((y.double() - reference).norm() / reference.norm()) / LAYERS
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        f"# RAC channel statistics on outlier-channel layers ({date}, CPU, torch {torch.__version__})", "",
        "Command: `python benchmarks/rac_statistics.py`. Relative output error of W4A4+RAC vs the AQAT trainer's "
        f"x q(W)^T, averaged over {LAYERS} synthetic layers (K={K}, N={N}, {TOKENS} tokens, 16 outlier channels x10-50, "
        "128 near-dead weight columns); channels calibrated on a separate batch.", "",
        "| statistic | " + " | ".join(f"ratio {r:g}" for r in RATIOS) + " |",
        "|---|" + "---:|" * len(RATIOS),
    ]
    for statistic in ChannelStatistic:
        lines.append(f"| {statistic.value} | " + " | ".join(f"{errors[(statistic, r)]:.4f}" for r in RATIOS) + " |")
    write_text_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
