"""The precision study: long GRPO runs of every precision mode, several seeds, with and without an
importance-sampling correction, and the report that reads them.

    python benchmarks/study_precisions.py run [--config FILE] [--steps 300] [--seeds 0 1 2] [--modes ...]
                                              [--corrections ...] [--max-minutes M] [key=value ...]
    python benchmarks/study_precisions.py analyze RUN [RUN ...]
    python benchmarks/study_precisions.py report

``run`` trains each (mode, seed, correction) of the grid on ``--config`` (the embedded default), one
``megatron-quads train`` process at a time (a process per run: a crash or a kill loses at most the
steps since its last checkpoint), under ``--out`` (``runs/study/<run>``). A run directory that
holds a config resumes from its newest checkpoint; a run whose records are complete is skipped, so
the command can be stopped and started again (``--max-minutes`` stops launching new runs after that
long). Several ``run`` processes can share a grid: each claims a run with a lock file
(``<out>/<run>.lock``) and skips the runs another one holds. Each finished run's ``metrics.jsonl``
and ``eval.jsonl`` are copied, gzip-compressed, to ``--results``
(``benchmarks/results/study/<run>.{metrics,eval}.jsonl.gz``),
the files the report reads. A grid given overrides of its own (``key=value`` after ``run``) needs
its own ``--out`` and ``--results``; they, the config and the devices that ran the grid are recorded
in ``<results>/grid.json``.

``analyze`` runs ``megatron-quads analyze`` on runs' final checkpoints over the task's held-out
problems with their answers (the gap split into weight and activation error per layer, and AQAT
against W4A4 + RAC at each ratio) into
``benchmarks/results/study/analysis/<run>.{json,png}``.

``report`` writes ``benchmarks/results/<results folder>.md`` (``study.md`` by default: per mode and
correction, means over seeds: reward, held-out pass@1, max and mean |Δlogp| and k3 KL over the last
steps; whether and when the reward collapsed; the early warning's lead and false alarms; per run the
policy's entropy beside the gap; the RAC ratio sweep of the max gap; the grid's overrides and devices) and ``<results folder>_curves.png`` beside it, and
draws each analysis's plot ``analysis/<run>.png`` from its ``analysis/<run>.json`` (git keeps the
JSON only).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench_device import device_name, record_stamp

from megatron_quads.atomic_io import save_figure_atomic, write_atomic, write_text_atomic
from megatron_quads.controller.report import read_records
from megatron_quads.rl.gap_monitor import GapMonitor
from megatron_quads.rl.settings import GapMonitorConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "embedded_default.yaml"
CLI = [sys.executable, "-m", "megatron_quads.cli"]
"""``megatron-quads`` run by this interpreter (also where the package is installed with ``pip --target``,
which puts the console script elsewhere)."""
RESULTS = Path(__file__).parent / "results" / "study"
MODES: dict[str, list[str]] = {
    "bf16": ["precision.mode=bf16"],
    "naive-nvfp4": ["precision.mode=naive-nvfp4"],
    "w4a16": ["precision.mode=w4a16"],
    "aqat": ["precision.mode=aqat"],
    "quads-0.25": ["precision.mode=quads", "precision.rac_ratio=0.25"],
    "quads-0.5": ["precision.mode=quads", "precision.rac_ratio=0.5"],
    "quads-1.0": ["precision.mode=quads", "precision.rac_ratio=1.0"],
}
"""Mode name -> its overrides (aqat is W4A4 without residual channels: RAC ratio 0)."""
CORRECTIONS: dict[str, list[str]] = {
    "none": ["grpo.loss.correction.mode=none"],
    "tis": ["grpo.loss.correction.mode=token_tis"],
    "mis": ["grpo.loss.correction.mode=token_mis"],
}
ANALYZE_RATIOS = (0.125, 0.25, 0.5, 0.75, 1.0)
"""The RAC ratios ``analyze`` measures on a trained checkpoint (the paper's sweep)."""
ANALYZE_SEQUENCES, ANALYZE_SEQ_LEN = 16, 64
"""``analyze`` measures on this many rows of this many tokens of the task's held-out problems with
their answers (and calibrates on as many others)."""
WARNING_SWEEP = ((20, 0.5), (20, 1.0), (20, 2.0), (50, 0.5), (50, 1.0), (50, 2.0))
"""(window, threshold) pairs the report replays the early warning at."""
RAC_SWEEP = {"aqat": 0.0, "quads-0.25": 0.25, "quads-0.5": 0.5, "quads-1.0": 1.0}
TAIL_STEPS = 50
"""The report's table averages the last this many steps of each run."""
COLLAPSE_WINDOW, COLLAPSE_FRACTION = 10, 0.5
"""A run collapsed at the first step where its reward's rolling mean over this many steps fell
below this fraction of the highest rolling mean before it."""


def run_name(mode: str, seed: int, correction: str) -> str:
    """``<mode>.seed<seed>.<correction>``: the run's directory and results-file stem."""
    return f"{mode}.seed{seed}.{correction}"


def parse_run_name(name: str) -> tuple[str, int, str]:
    """``(mode, seed, correction)`` of a :func:`run_name` (modes may hold dots: quads-0.5)."""
    mode, _, rest = name.rpartition(".seed")
    seed, _, correction = rest.partition(".")
    return mode, int(seed), correction


def _copy_atomic(source: Path, target: Path) -> None:
    write_atomic(target, lambda tmp: shutil.copyfile(source, tmp))


def _copy_compressed(source: Path, target: Path) -> None:
    """``source`` gzip-compressed into ``target``, atomically (``mtime=0``: the same bytes every time)."""
    write_atomic(target, lambda tmp: Path(tmp).write_bytes(gzip.compress(source.read_bytes(), mtime=0)))


METRICS_SUFFIX, EVAL_SUFFIX = ".metrics.jsonl.gz", ".eval.jsonl.gz"
"""The results files of a run, beside its name."""


@contextlib.contextmanager
def claimed(lock_path: Path) -> Iterator[bool]:
    """Whether this process holds ``lock_path``'s exclusive lock (held until the block ends; released by
    the kernel if the process dies), so several ``run`` processes can share one grid."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def train_one(name: str, overrides: list[str], steps: int, out: Path, results: Path, config: Path = CONFIG) -> bool:
    """Train (or resume, or skip) one run of ``config``; True when its records are complete and copied to
    ``results``. A run another process is training (its ``<out>/<name>.lock`` held) is skipped."""
    with claimed(out / f"{name}.lock") as mine:
        if not mine:
            print(f"[study] {name}: another process is training it; skipped", flush=True)
            return False
        return _train_claimed(name, overrides, steps, out, results, config)


def _train_claimed(name: str, overrides: list[str], steps: int, out: Path, results: Path, base: Path) -> bool:
    if len(read_records(results / f"{name}{METRICS_SUFFIX}")) >= steps:  # done, maybe by another process
        return True
    run_dir = out / name
    saved = run_dir / "config.yaml"
    config = saved if saved.is_file() else base
    settings = [f"grpo.steps={steps}"] + ([] if saved.is_file() else [f"run_dir={run_dir}", *overrides])
    command = [*CLI, "train", str(config), *settings]
    print(f"[study] {name}: {' '.join(command)}", flush=True)
    if subprocess.run(command, check=False).returncode != 0:
        print(f"[study] {name} failed; run the same command again to resume it", flush=True)
        return False
    if len(read_records(run_dir / "metrics.jsonl")) < steps:
        return False
    results.mkdir(parents=True, exist_ok=True)
    _copy_compressed(run_dir / "metrics.jsonl", results / f"{name}{METRICS_SUFFIX}")
    if (run_dir / "eval.jsonl").is_file():
        _copy_compressed(run_dir / "eval.jsonl", results / f"{name}{EVAL_SUFFIX}")
    return True


GRID_FILE = "grid.json"
"""Beside a grid's results: the overrides every run of it was given (the report names them)."""


def _config_name(config: Path) -> str:
    """How grid.json names a grid's config: relative to the repository where it lies inside it."""
    resolved = config.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def record_overrides(results: Path, overrides: list[str], config: Path = CONFIG, device: str | None = None) -> None:
    """Record the grid's config, own overrides and the devices that ran it (``device``, default this
    machine's) in ``results``; a results folder holds one grid, so another config or other overrides than
    those recorded there are refused (give such a grid its own ``--results`` and ``--out``)."""
    path = results / GRID_FILE
    grid = {"overrides": overrides, "config": _config_name(config)}
    devices = [device or device_name()]
    if path.is_file():
        recorded = json.loads(path.read_text())
        recorded.setdefault("config", _config_name(CONFIG))
        known = recorded.pop("devices", [])
        if recorded != grid:
            raise SystemExit(f"{results} holds a grid run with {recorded}, not {grid}: give this grid its own --results "
                             "and --out")
        if devices[0] in known:
            return
        devices = known + devices
    results.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({**grid, "devices": devices}) + "\n")


def grid_overrides(results: Path) -> list[str]:
    """The overrides recorded for the grid in ``results`` (none recorded: none)."""
    path = results / GRID_FILE
    return json.loads(path.read_text())["overrides"] if path.is_file() else []


def grid_devices(results: Path) -> list[str]:
    """The devices recorded as having run the grid in ``results`` (none recorded: an empty list)."""
    path = results / GRID_FILE
    return json.loads(path.read_text()).get("devices", []) if path.is_file() else []


def grid_config(results: Path) -> str:
    """The base config recorded for the grid in ``results`` (none recorded: the embedded default's)."""
    path = results / GRID_FILE
    return json.loads(path.read_text()).get("config", _config_name(CONFIG)) if path.is_file() else _config_name(CONFIG)


def run_grid(args: argparse.Namespace) -> None:
    """Train the grid, seed by seed (every mode's first seed before any second one)."""
    start = time.monotonic()
    shared = ["checkpoint.every=10", "logging.wandb=disabled", f"eval.every={args.eval_every}", *args.overrides]
    record_overrides(args.results, list(args.overrides), args.config)
    for seed in args.seeds:
        for correction in args.corrections:
            for mode in args.modes:
                if args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
                    print(f"[study] {args.max_minutes} minutes passed: stopping; run the command again to go on")
                    return
                overrides = [*MODES[mode], *CORRECTIONS[correction], f"seed={seed}", *shared]
                train_one(run_name(mode, seed, correction), overrides, args.steps, args.out, args.results, args.config)


# ------------------------------------------------------------------------------------------------ report


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values (fewer at the start) at every step."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def collapse_step(rewards: Sequence[float]) -> int | None:
    """The first step whose rolling mean reward fell below :data:`COLLAPSE_FRACTION` of the best rolling
    mean before it (None: no collapse)."""
    smooth = rolling_mean(rewards, COLLAPSE_WINDOW)
    best = float("-inf")
    for step, value in enumerate(smooth):
        if step >= COLLAPSE_WINDOW and best > 0 and value < COLLAPSE_FRACTION * best:
            return step
        best = max(best, value)
    return None


def deepest_fall(rewards: Sequence[float]) -> tuple[float, int] | None:
    """The lowest ratio of the rolling mean reward to the best rolling mean before it, and its step,
    over the steps :func:`collapse_step` judges (a collapse is a ratio below :data:`COLLAPSE_FRACTION`);
    None for a run too short to judge."""
    smooth = rolling_mean(rewards, COLLAPSE_WINDOW)
    best, deepest = float("-inf"), None
    for step, value in enumerate(smooth):
        if step >= COLLAPSE_WINDOW and best > 0 and (deepest is None or value / best < deepest[0]):
            deepest = (value / best, step)
        best = max(best, value)
    return deepest


def run_row(name: str, metrics: list[dict], evals: list[dict]) -> str:
    """One run's line of the per-run table: steps, reward over its first and last :data:`TAIL_STEPS`
    steps, held-out pass@1 at the first evaluation / the lowest after it / the last, the gap measures
    averaged over every step, and :func:`deepest_fall`."""
    rewards = [r["reward"] for r in metrics]
    first = statistics.fmean(rewards[:TAIL_STEPS])
    last = statistics.fmean(rewards[-TAIL_STEPS:])
    if evals:
        lowest = min(evals[1:] or evals, key=lambda e: e["eval/pass@1"])
        pass1 = (f"{evals[0]['eval/pass@1']:.3f}, {lowest['eval/pass@1']:.3f} (step {lowest['step']}), "
                 f"{evals[-1]['eval/pass@1']:.3f} (step {evals[-1]['step']})")
    else:
        pass1 = "none recorded"
    gaps = {key: statistics.fmean(r[key] for r in metrics)
            for key in ("mismatch/gap_mean_abs", "mismatch/gap_max_abs", "mismatch/k3_kl")}
    fall = deepest_fall(rewards)
    fell = f"{fall[0]:.2f} (step {fall[1]})" if fall else ""
    return (f"| {name} | {len(metrics)} | {first:.3f} | {last:.3f} | {pass1} | {gaps['mismatch/gap_mean_abs']:.5f} | "
            f"{gaps['mismatch/gap_max_abs']:.2f} | {gaps['mismatch/k3_kl']:.1e} | {fell} |")


def entropy_row(name: str, metrics: list[dict]) -> str:
    """One run's line of the entropy table, means over its steps: the policy's entropy per response token and
    per response, the mean gap, the k3 KL per token and per response (the per-token mean times the response
    length: the KL between the two sides' response distributions), and the gap's share on the most uncertain
    fifth of tokens. Entropy columns read "not recorded" for runs without ``policy/entropy``."""
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in metrics)

    per_response = statistics.fmean(r["mismatch/k3_kl"] * r["response_length"] for r in metrics)
    if all("policy/entropy" in r for r in metrics):
        entropy = (f"{mean('policy/entropy'):.3f} | "
                   f"{statistics.fmean(r['policy/entropy'] * r['response_length'] for r in metrics):.2f}")
        share = f"{mean('mismatch/gap_high_entropy_share'):.2f}"
    else:
        entropy, share = "not recorded | not recorded", "not recorded"
    return (f"| {name} | {len(metrics)} | {mean('response_length'):.1f} | {entropy} | {mean('mismatch/gap_mean_abs'):.5f} | "
            f"{mean('mismatch/k3_kl'):.1e} | {per_response:.4f} | {share} |")


def entropy_markdown(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The policy's entropy beside the gap, a line per run (:func:`entropy_row`)."""
    return ["", "## Policy entropy and the gap", "",
            "Means over every step. A token the policy is sure of keeps its log-prob near 0 whatever the rollout's "
            "precision does to the logits: the gap lives where the policy is uncertain. Gap share: of the summed "
            "|Δlogp|, the part on the fifth of each step's tokens with the highest entropy (0.2 when the gap does "
            "not depend on the entropy).", "",
            "| run | steps | response tokens | entropy per token (nats) | entropy per response | mean \\|Δlogp\\| | "
            "k3 KL per token | k3 KL per response | gap share, most uncertain fifth |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *(entropy_row(name, runs[name]["metrics"]) for name in sorted(runs))]


def first_warning(records: Sequence[dict], config: GapMonitorConfig | None = None) -> int | None:
    """The first step where the early warning (``config``, default: the run config's default) turns
    on, replayed over a run's records (None: never)."""
    onsets = warning_onsets(records, config or GapMonitorConfig())
    return onsets[0] if onsets else None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_results(results: Path) -> dict[str, dict[str, list[dict]]]:
    """``{run name: {"metrics": records, "eval": records}}`` of every run in ``results``."""
    out = {}
    for path in sorted(results.glob(f"*{METRICS_SUFFIX}")):
        name = path.name[: -len(METRICS_SUFFIX)]
        out[name] = {"metrics": read_records(path), "eval": read_records(results / f"{name}{EVAL_SUFFIX}")}
    return out


def _tail_mean(records: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in records[-TAIL_STEPS:])


def _groups(runs: dict[str, dict[str, list[dict]]]) -> dict[tuple[str, str], list[str]]:
    """``{(mode, correction): [run names over seeds]}``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in runs:
        mode, _, correction = parse_run_name(name)
        groups.setdefault((mode, correction), []).append(name)
    return groups


def with_spread(values: Sequence[float], digits: int) -> str:
    """The mean of ``values``, and ``± sd`` over them (sample standard deviation) when there are several."""
    mean = f"{statistics.fmean(values):.{digits}f}"
    return mean if len(values) < 2 else f"{mean} ± {statistics.stdev(values):.{digits}f}"


def steps_cell(lengths: Sequence[int]) -> str:
    """The steps its runs reached: one number where they agree, else ``fewest–most``."""
    low, high = min(lengths), max(lengths)
    return str(low) if low == high else f"{low}–{high}"


def report_markdown(runs: dict[str, dict[str, list[dict]]], stamp: dict[str, str], results: Path = RESULTS) -> str:
    """The study's tables: per mode and correction, seed means; collapses and early warnings; the RAC sweep."""
    overrides = grid_overrides(results)
    given = f" with {', '.join(f'`{o}`' for o in overrides)}" if overrides else ""
    config = grid_config(results)
    subject = "the embedded default" if config == _config_name(CONFIG) else f"`{config}`"
    ran_on = ", ".join(grid_devices(results)) or stamp["device"]
    lines = [f"# Precision study on {subject}{given} ({stamp['date']}, {ran_on})", "",
             f"Runs on {ran_on}. Command: `{stamp['command']}` (on {stamp['device']}), over the runs in "
             f"{_shown(results)}. Means over seeds of "
             f"the last {TAIL_STEPS} steps of each run (± the standard deviation over seeds, with several); where a "
             "mode's runs stopped at different steps, the steps column gives the range and each run's own last steps "
             "count. The early "
             f"warning is replayed over the recorded metrics with the default `monitor` settings (window {GapMonitorConfig().window}, threshold "
             f"{GapMonitorConfig().threshold}, patience {GapMonitorConfig().patience}, `{GapMonitorConfig().metric}`).", "",
             "| mode | correction | seeds | steps | reward | held-out pass@1 (last) | max \\|Δlogp\\| | mean \\|Δlogp\\| | "
             "k3 KL | collapsed | early warning |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for (mode, correction), names in sorted(_groups(runs).items()):
        metrics = [runs[n]["metrics"] for n in names]
        evals = [runs[n]["eval"][-1]["eval/pass@1"] for n in names if runs[n]["eval"]]
        pass1 = with_spread(evals, 3) if evals else ""
        tails = {key: [_tail_mean(m, key) for m in metrics]
                 for key in ("reward", "mismatch/gap_max_abs", "mismatch/gap_mean_abs", "mismatch/k3_kl")}
        collapses = [collapse_step([r["reward"] for r in m]) for m in metrics]
        warnings = [first_warning(m) for m in metrics]
        collapsed = ", ".join(f"step {c}" if c is not None else "no" for c in collapses)
        warned = ", ".join(
            "no" if w is None else (f"step {w} ({c - w} steps before)" if c is not None and w <= c else
                                    f"step {w}" + (" (false alarm)" if c is None else " (after)"))
            for w, c in zip(warnings, collapses, strict=True))
        lines.append(f"| {mode} | {correction} | {len(names)} | {steps_cell([len(m) for m in metrics])} | "
                     f"{with_spread(tails['reward'], 3)} | {pass1} | {with_spread(tails['mismatch/gap_max_abs'], 3)} | "
                     f"{statistics.fmean(tails['mismatch/gap_mean_abs']):.4f} | "
                     f"{statistics.fmean(tails['mismatch/k3_kl']):.2e} | {collapsed} | {warned} |")
    lines += ["", "## Each run", "",
              f"Reward: the mean over the run's first and last {TAIL_STEPS} steps. Held-out pass@1: at the first "
              "evaluation, the lowest after it, the last. The gap columns: means over every step. Deepest fall: the "
              f"lowest {COLLAPSE_WINDOW}-step mean reward as a fraction of the best before it (a collapse is below "
              f"{COLLAPSE_FRACTION}).", "",
              "| run | steps | reward, first steps | reward, last steps | held-out pass@1: first, lowest, last | "
              "mean \\|Δlogp\\| | max \\|Δlogp\\| | k3 KL | deepest fall |",
              "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    lines += [run_row(name, runs[name]["metrics"], runs[name]["eval"]) for name in sorted(runs)]
    lines += entropy_markdown(runs)
    sweep = []
    for mode, ratio in RAC_SWEEP.items():
        names = [n for (m, c), group in _groups(runs).items() if m == mode and c == "none" for n in group]
        if names:
            gap = statistics.fmean(statistics.fmean(r["mismatch/gap_max_abs"] for r in runs[n]["metrics"]) for n in names)
            sweep.append((ratio, gap, len(names)))
    if len(sweep) > 1:
        gaps = [g for _, g, _ in sweep]
        monotone = all(a >= b for a, b in zip(gaps, gaps[1:]))
        lines += ["", "## RAC ratio sweep (no correction; max |Δlogp| averaged over every step and seed)", "",
                  "| RAC ratio | max \\|Δlogp\\| | seeds |", "|---:|---:|---:|"]
        lines += [f"| {ratio} | {gap:.3f} | {n} |" for ratio, gap, n in sweep]
        lines += ["", f"The max gap {'falls' if monotone else 'does not fall'} monotonically with the ratio."]
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, dict[str, list[dict]]], path: Path) -> None:
    """Reward, held-out pass@1, max |Δlogp| and k3 KL per step: each (mode, correction)'s mean over
    seeds (per-step values as rolling means); a colour per mode, a line style per correction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("reward", f"reward ({COLLAPSE_WINDOW}-step mean)"), ("eval/pass@1", "held-out pass@1"),
            ("mismatch/gap_max_abs", f"max |Δlogp| (nats, {COLLAPSE_WINDOW}-step mean)"),
            ("mismatch/k3_kl", f"k3 KL ({COLLAPSE_WINDOW}-step mean)")]
    colours = {mode: f"C{i}" for i, mode in enumerate(MODES)}
    styles = {"none": "-", "tis": "--", "mis": ":"}
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.5))
    for (mode, correction), names in sorted(_groups(runs).items()):
        style = {"color": colours.get(mode), "linestyle": styles.get(correction, "-."), "label": f"{mode} ({correction})"}
        length = min(len(runs[n]["metrics"]) for n in names)
        for ax, (key, title) in zip(axes, keys, strict=True):
            ax.set(xlabel="step", title=title)
            if key.startswith("eval/"):
                evals = [runs[n]["eval"] for n in names if runs[n]["eval"]]
                if evals:
                    count = min(len(e) for e in evals)
                    ax.plot([evals[0][i]["step"] for i in range(count)],
                            [statistics.fmean(e[i][key] for e in evals) for i in range(count)], **style)
                continue
            per_step = [statistics.fmean(runs[n]["metrics"][i][key] for n in names) for i in range(length)]
            ax.plot(range(length), rolling_mean(per_step, COLLAPSE_WINDOW), **style)
    axes[-1].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)


def warning_onsets(records: Sequence[dict], config: GapMonitorConfig) -> list[int]:
    """The steps where a monitor with ``config``, replayed over a run's records, turns its warning on."""
    monitor, onsets = GapMonitor(config), []
    for record in records:
        was_on = monitor.warning
        monitor.update(record, log=False)
        if monitor.warning and not was_on:
            onsets.append(record["step"])
    return onsets


def warning_sweep_markdown(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The early warning replayed over every run at other windows and thresholds: warnings before a
    collapse, and on runs without one (false alarms)."""
    lines = ["", "## The early warning at other settings (replayed over the recorded metrics, "
             f"`{GapMonitorConfig().metric}`, patience {GapMonitorConfig().patience})", "",
             "| window | threshold | collapsed runs warned before the collapse | runs without a collapse that warned | "
             "warnings on runs without a collapse |", "|---:|---:|---|---|---:|"]
    collapses = {name: collapse_step([r["reward"] for r in run["metrics"]]) for name, run in runs.items()}
    for window, threshold in WARNING_SWEEP:
        config = GapMonitorConfig(window=window, threshold=threshold)
        onsets = {name: warning_onsets(run["metrics"], config) for name, run in runs.items()}
        collapsed = [n for n, c in collapses.items() if c is not None]
        warned_before = [n for n in collapsed if any(o <= collapses[n] for o in onsets[n])]
        stable = [n for n, c in collapses.items() if c is None]
        false_runs = [n for n in stable if onsets[n]]
        lines.append(f"| {window} | {threshold} | {len(warned_before)} of {len(collapsed)} | {len(false_runs)} of "
                     f"{len(stable)} | {sum(len(onsets[n]) for n in stable)} |")
    return lines


def _analysis_tokens(run: Path) -> list[str]:
    """``analyze``'s token rows for a run: its task's held-out problems where its config names a task
    (the GPU collapse study's chain task), else the embedded task's."""
    import yaml

    config = run / "config.yaml"
    saved = yaml.safe_load(config.read_text()) if config.exists() else {}
    if (saved or {}).get("task"):
        return ["--tokens", "run-task", "--run-config", str(config)]
    return ["--tokens", "embedded-task"]


def analyze_runs(args: argparse.Namespace) -> None:
    """``megatron-quads analyze`` on each named run's final checkpoint, into ``results/analysis/<run>.{json,png}``."""
    target = args.results / "analysis"
    for name in args.runs:
        steps = sorted((args.out / name / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        if not steps:
            raise SystemExit(f"{args.out / name} has no checkpoint: train it first (`run`)")
        work = args.out / name / "analysis"
        command = [*CLI, "analyze", "--checkpoint", str(steps[-1]), "--out", str(work), *_analysis_tokens(args.out / name),
                   "--sequences", str(ANALYZE_SEQUENCES),
                   "--seq-len", str(ANALYZE_SEQ_LEN), "--ratios", *map(str, ANALYZE_RATIOS)]
        print(f"[study] {name}: {' '.join(command)}", flush=True)
        subprocess.run(command, check=True)
        target.mkdir(parents=True, exist_ok=True)
        for suffix in ("json", "png"):
            _copy_atomic(work / f"analysis.{suffix}", target / f"{name}.{suffix}")


def analysis_summary_markdown(docs: dict[str, dict]) -> list[str]:
    """One row per analysed checkpoint: the layers' mean weight and activation error, the mean |Δlogp|
    of weights alone (BF16 vs W4A16) and of activations alone (AQAT vs W4A4), and AQAT vs W4A4 + RAC's
    at each ratio (the mean, not the max or k3 KL, which a few tokens decide)."""
    if not docs:
        return []
    ratios = list(next(iter(docs.values()))["ratios"])
    lines = ["", "## Gap decomposition of the analysed checkpoints (`megatron-quads analyze`; mean |Δlogp|)", "",
             "| checkpoint | weight error (rel., layer mean) | activation error (rel., layer mean) | weights alone | "
             "activations alone | " + " | ".join(f"RAC {r:g}" for r in ratios) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(ratios)]
    for name, doc in docs.items():
        pairs = doc["pairs"]
        layers = pairs["bf16 vs w4a4"]["layers"].values()
        rac = [f"{pairs[f'aqat vs quads@{r:g} (output_error)']['gap']['mean_abs']:.4f}" for r in ratios]
        lines.append(f"| {name} | {statistics.fmean(v['weight_rel'] for v in layers):.4f} | "
                     f"{statistics.fmean(v['activation_rel'] for v in layers):.4f} | "
                     f"{pairs['bf16 vs w4a16']['gap']['mean_abs']:.4f} | {pairs['aqat vs w4a4']['gap']['mean_abs']:.4f} | "
                     + " | ".join(rac) + " |")
    return lines


def analysis_markdown(results: Path) -> list[str]:
    """Per analysed checkpoint: each layer's weight and activation error (BF16 vs W4A4) and the gap of
    AQAT vs W4A4 + RAC by ratio (channels by output error), from ``results/analysis/*.json``."""
    docs = {path.stem: json.loads(path.read_text()) for path in sorted((results / "analysis").glob("*.json"))}
    lines = analysis_summary_markdown(docs)
    for name, doc in docs.items():
        pairs = doc["pairs"]
        lines += ["", f"## Gap decomposition of {name}'s final checkpoint (`megatron-quads analyze`, "
                  f"{doc['tokens']} tokens)", "",
                  "| layer | weight error (rel.) | activation error (rel.) |", "|---|---:|---:|"]
        lines += [f"| {layer} | {v['weight_rel']:.4f} | {v['activation_rel']:.4f} |"
                  for layer, v in pairs["bf16 vs w4a4"]["layers"].items()]
        lines += ["", "| pair | max \\|Δlogp\\| | mean \\|Δlogp\\| | k3 KL |", "|---|---:|---:|---:|"]
        lines += [f"| {label} | {v['gap']['max_abs']:.3f} | {v['gap']['mean_abs']:.4f} | {v['gap']['k3_kl']:.2e} |"
                  for label, v in pairs.items() if "activation_magnitude" not in label]
    return lines


def report(args: argparse.Namespace) -> None:
    """Write the study's Markdown report and curves from the results files."""
    runs = load_results(args.results)
    if not runs:
        raise SystemExit(f"no results in {args.results}: run `python benchmarks/study_precisions.py run` first")
    out = args.results.parent
    sections = warning_sweep_markdown(runs) + analysis_markdown(args.results)
    text = report_markdown(runs, record_stamp(), args.results) + "".join(line + "\n" for line in sections)
    report_path, curves_path = out / f"{args.results.name}.md", out / f"{args.results.name}_curves.png"
    write_text_atomic(report_path, text)
    plot_curves(runs, curves_path)
    print(f"wrote {report_path} and {curves_path}")
    for plot_path in plot_analyses(args.results):
        print(f"wrote {plot_path}")


def plot_analyses(results: Path) -> list[Path]:
    """Draw ``analysis/<run>.png`` from each ``analysis/<run>.json`` of ``results`` (what
    ``megatron-quads analyze`` plots beside its JSON); returns the plots written."""
    documents = sorted((results / "analysis").glob("*.json"))
    if not documents:
        return []
    from megatron_quads.analyze import plot

    for document in documents:
        plot(json.loads(document.read_text()), document.with_suffix(".png"))
    return [document.with_suffix(".png") for document in documents]


def main() -> None:
    """``run`` the grid or ``report`` on it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grid = sub.add_parser("run", help="train the grid (resumable)")
    grid.add_argument("--config", type=Path, default=CONFIG, help="the runs' base config (default: the embedded default)")
    grid.add_argument("--steps", type=int, default=300)
    grid.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    grid.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    grid.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=["none", "tis"])
    grid.add_argument("--eval-every", type=int, default=25, help="held-out pass@1 every N steps")
    grid.add_argument("--max-minutes", type=float, default=0.0, help="stop launching runs after this long (0: never)")
    grid.add_argument("--out", type=Path, default=Path("runs/study"))
    grid.add_argument("--results", type=Path, default=RESULTS)
    grid.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    ana = sub.add_parser("analyze", help="decompose the gap on trained runs' final checkpoints")
    ana.add_argument("runs", nargs="+", help="run names, e.g. naive-nvfp4.seed0.none")
    ana.add_argument("--out", type=Path, default=Path("runs/study"))
    ana.add_argument("--results", type=Path, default=RESULTS)
    rep = sub.add_parser("report", help="tables and curves from the results files")
    rep.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    {"run": run_grid, "analyze": analyze_runs, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
