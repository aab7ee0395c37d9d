"""Run outputs a person reads: the record files, wandb, TensorBoard, and the plot of the run."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from megatron_quads.atomic_io import append_whole, save_figure_atomic
from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.run_dir import keep_records_before, start_records
from megatron_quads.controller.samples import SAMPLE_COLUMNS, markdown_table
from megatron_quads.controller.tensorboard_log import TensorBoardLog
from megatron_quads.controller.wandb_log import start_wandb
from megatron_quads.rl.gap_monitor import GapMonitor


class MetricsSink:
    """Per-step metrics to JSONL (always), to wandb (offline unless configured otherwise; a resume
    continues the run's wandb run) and to TensorBoard (``logging.tensorboard``)."""

    def __init__(self, cfg: RunConfig, path: Path, eval_path: Path | None = None, samples_path: Path | None = None,
                 resumed_at: int | None = None, stamp: str = "") -> None:
        self.path, self.eval_path, self.samples_path = path, eval_path, samples_path
        self.wandb_run = start_wandb(cfg, resumed_at is not None) if cfg.logging.wandb != "disabled" else None
        self.tensorboard = TensorBoardLog(Path(cfg.run_dir), resumed_at, stamp) if cfg.logging.tensorboard else None

    def log(self, record: dict) -> None:
        """Append one step's record, whole or not at all (a full disk raises ``OSError`` naming the file
        and leaves no part of the line)."""
        append_whole(self.path, (json.dumps(record) + "\n").encode())
        self._to_dashboards(record)

    def log_eval(self, record: dict) -> None:
        """Append one evaluation's record (``step``: the updates its weights had) to the eval JSONL, whole
        or not at all."""
        append_whole(self.eval_path, (json.dumps(record) + "\n").encode())
        self._to_dashboards(record)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Append a step's sample generations to the samples JSONL (a line each, all whole or none), to
        wandb as a table (``samples``) and to TensorBoard as a Markdown table."""
        append_whole(self.samples_path, "".join(json.dumps(row) + "\n" for row in rows).encode())
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[row[c] for c in SAMPLE_COLUMNS] for row in rows])
            self.wandb_run.log({"samples": table}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.text("samples", markdown_table(rows), step)

    def _to_dashboards(self, record: dict) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.scalars(record, record["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        """Flush wandb and TensorBoard."""
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class RunRecords:
    """The run's records in its directory: a line per step in ``metrics.jsonl`` (with the collapse
    monitor's trend when ``monitor.enabled``), a line per evaluation in ``eval.jsonl``, a line per sample
    generation in ``samples.jsonl`` (every ``logging.samples_every`` steps); the plot of the metrics
    (``metrics.png``) every ``logging.plot_every`` steps and at the end.

    A fresh run moves an earlier run's record files aside; a run resumed at step ``resumed_at`` moves
    aside the lines of the steps it does again, and its monitor continues from the lines it keeps.
    """

    def __init__(self, cfg: RunConfig, resumed_at: int | None) -> None:
        run_dir = Path(cfg.run_dir)
        self.metrics_path, self.eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.plot_path = run_dir / "metrics.png"
        self._samples_every, self._plot_every = cfg.logging.samples_every, cfg.logging.plot_every
        self.samples_per_step = cfg.logging.samples_per_step
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # names every record file it moves aside
        for path in (self.metrics_path, self.eval_path, self.samples_path):
            if resumed_at is None:
                start_records(path, stamp)
            else:
                keep_records_before(path, resumed_at, stamp)
        self._sink = MetricsSink(cfg, self.metrics_path, self.eval_path, self.samples_path, resumed_at, stamp)
        self._monitor = GapMonitor(cfg.monitor) if cfg.monitor.enabled else None
        if self._monitor is not None:
            self._monitor.replay(read_records(self.metrics_path))

    def samples_due(self, step: int) -> bool:
        """Whether step ``step``'s sample generations are logged (every ``logging.samples_every`` steps
        from step 0)."""
        return self._samples_every > 0 and step % self._samples_every == 0

    def log_step(self, record: dict) -> dict:
        """Append a step's record, with the monitor's trend added (which warns of a collapse); redraw the
        plot when due; returns the record."""
        if self._monitor is not None:
            record.update(self._monitor.update(record))
        self._sink.log(record)
        if self._plot_every and (record["step"] + 1) % self._plot_every == 0:
            plot_run(self.metrics_path, self.plot_path, self.eval_path)
        return record

    def log_eval(self, record: dict) -> None:
        """Append an evaluation's record."""
        self._sink.log_eval(record)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Append step ``step``'s sample generations."""
        self._sink.log_samples(step, rows)

    def close(self) -> Path:
        """Flush wandb and TensorBoard and plot the run; returns the metrics file."""
        self._sink.close()
        plot_run(self.metrics_path, self.plot_path, self.eval_path)
        return self.metrics_path


def read_records(path: Path | None) -> list[dict]:
    """The records of a JSONL record file (gzip-compressed when its name ends in ``.gz``), in order
    (none if it does not exist)."""
    if path is None or not path.exists():
        return []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plot_run(metrics_path: Path, out_path: Path, eval_path: Path | None = None) -> Path:
    """Reward (and held-out pass@1, when evaluated), rollout-vs-trainer gap and (when recorded) the policy's
    entropy over steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    steps = [r["step"] for r in records]
    with_entropy = bool(records) and "policy/entropy" in records[0]
    fig, axes = plt.subplots(1, 3 if with_entropy else 2, figsize=(16 if with_entropy else 11, 4))
    ax_reward, ax_gap = axes[:2]
    ax_reward.plot(steps, [r["reward"] for r in records], marker="o", label="train reward")
    evals = read_records(eval_path)
    if evals:
        ax_reward.plot([r["step"] for r in evals], [r["eval/pass@1"] for r in evals], marker="s", label="held-out pass@1")
        ax_reward.legend()
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("mean reward")
    ax_reward.set_title("reward")
    ax_gap.plot(steps, [r["mismatch/gap_max_abs"] for r in records], marker="o", label="max |Δlogp|")
    ax_gap.plot(steps, [r["mismatch/gap_mean_abs"] for r in records], marker="o", label="mean |Δlogp|")
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("nats")
    ax_gap.set_title("rollout vs trainer gap")
    ax_gap.legend()
    if with_entropy:
        axes[2].plot(steps, [r.get("policy/entropy", float("nan")) for r in records], marker="o")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("nats per response token")
        axes[2].set_title("policy entropy")
    fig.tight_layout()
    save_figure_atomic(fig, out_path)
    plt.close(fig)
    return out_path
