#!/usr/bin/env python3
"""Run the embedded default in bf16, naive-nvfp4, w4a16 and quads, and plot reward and gap side by side.

    python examples/compare_precisions.py [--steps 20] [--out runs/compare] [key=value ...]

Each mode trains from the same warm-started checkpoint with the same seeds; extra ``key=value``
overrides apply to every run. Writes ``<out>/<mode>/metrics.jsonl`` and ``<out>/compare.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import ray

from megatron_quads.atomic_io import save_figure_atomic
from megatron_quads.controller.config import load_config
from megatron_quads.controller.run import run

MODES = ("bf16", "naive-nvfp4", "w4a16", "quads")
CONFIG = Path(__file__).with_name("embedded_default.yaml")


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Reward and max |Δlogp| per step for every mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_gap) = plt.subplots(1, 2, figsize=(12, 4))
    for mode, records in results.items():
        steps = [r["step"] for r in records]
        ax_reward.plot(steps, [r["reward"] for r in records], marker="o", label=mode)
        ax_gap.plot(steps, [r["mismatch/gap_max_abs"] for r in records], marker="o", label=mode)
    ax_reward.set(xlabel="step", ylabel="mean reward", title="reward")
    ax_gap.set(xlabel="step", ylabel="max |Δlogp| (nats)", title="rollout vs trainer gap")
    ax_reward.legend()
    ax_gap.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)


def main() -> None:
    """Run every mode, then plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    ray.init(include_dashboard=False, log_to_driver=False)
    results = {}
    for mode in MODES:
        cfg = load_config(CONFIG, [f"precision.mode={mode}", f"grpo.steps={args.steps}", f"run_dir={args.out / mode}",
                                   "checkpoint.every=0", "logging.wandb=disabled", *args.overrides])
        metrics = run(cfg)
        results[mode] = [json.loads(line) for line in metrics.read_text().splitlines()]
    plot(results, args.out / "compare.png")
    for mode, records in results.items():
        mean = lambda key: sum(r[key] for r in records) / len(records)  # noqa: E731
        print(f"{mode:12s} reward {mean('reward'):.3f}  max gap {mean('mismatch/gap_max_abs'):.3f}  "
              f"mean gap {mean('mismatch/gap_mean_abs'):.4f}")
    print(f"plot: {args.out / 'compare.png'}")


if __name__ == "__main__":
    main()
