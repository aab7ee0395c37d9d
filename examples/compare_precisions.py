#!/usr/bin/env python3
"""Run the embedded default in bf16, naive-nvfp4, w4a16 and quads, the two W4A4 modes also with router
replay (r3), and plot reward and gap side by side.

    python examples/compare_precisions.py [--steps 20] [--out runs/compare] [key=value ...]

Each run trains from the same warm-started checkpoint with the same seeds; extra ``key=value``
overrides apply to every run. Writes ``<out>/<run>/metrics.jsonl``, ``<out>/compare.png`` and
``<out>/summary.md`` (the means over the steps, with date, device and command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
from pathlib import Path

import ray

from megatron_quads.atomic_io import save_figure_atomic, write_text_atomic
from megatron_quads.controller.config import load_config
from megatron_quads.controller.run import run

RUNS: dict[str, list[str]] = {
    "bf16": ["precision.mode=bf16"],
    "naive-nvfp4": ["precision.mode=naive-nvfp4"],
    "naive-nvfp4+r3": ["precision.mode=naive-nvfp4", "rollout.router_replay=r3"],
    "w4a16": ["precision.mode=w4a16"],
    "quads": ["precision.mode=quads"],
    "quads+r3": ["precision.mode=quads", "rollout.router_replay=r3"],
}
"""Run name -> its overrides."""
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


def summarize(results: dict[str, list[dict]], command: str) -> str:
    """Markdown table of each run's means over its steps: reward, max and mean |Δlogp| and, under
    router replay, the fraction of routes the trainer's own top-k would have chosen otherwise."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"# Precision modes on the embedded default ({now}, {platform.machine()} CPU, {os.cpu_count()} cores)", "",
             f"Command: `{command}`. Means over the steps of each run.", "",
             "| run | reward | max \\|Δlogp\\| | mean \\|Δlogp\\| | routes replayed elsewhere |", "|---|---:|---:|---:|---:|"]
    for name, records in results.items():
        mean = lambda key: sum(r[key] for r in records) / len(records)  # noqa: E731
        routing = f"{mean('mismatch/routing_disagreement'):.4f}" if "mismatch/routing_disagreement" in records[0] else ""
        lines.append(f"| {name} | {mean('reward'):.3f} | {mean('mismatch/gap_max_abs'):.3f} | "
                     f"{mean('mismatch/gap_mean_abs'):.4f} | {routing} |")
    return "\n".join(lines) + "\n"


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
    for name, overrides in RUNS.items():
        cfg = load_config(CONFIG, [*overrides, f"grpo.steps={args.steps}", f"run_dir={args.out / name}",
                                   "checkpoint.every=0", "logging.wandb=disabled", *args.overrides])
        metrics = run(cfg)
        results[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    plot(results, args.out / "compare.png")
    summary = summarize(results, " ".join(["python", *sys.argv]))
    write_text_atomic(args.out / "summary.md", summary)
    print(summary)
    print(f"plot: {args.out / 'compare.png'}")


if __name__ == "__main__":
    main()
