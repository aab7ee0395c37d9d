"""``megatron-quads`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _cmd_demo(args: argparse.Namespace) -> int:
    from megatron_quads.demo import demo_tensors, error_table

    tensors = demo_tensors(args.rows, args.cols, args.seed)
    table = Table(title=f"NVFP4 quantization error ({args.rows}x{args.cols}, bf16)")
    for column in ("tensor", "blocks", "relative error", "SQNR (dB)", "max |error|"):
        table.add_column(column, justify="left" if column in ("tensor", "blocks") else "right")
    for row in error_table(tensors):
        table.add_row(
            row.tensor, row.blocking, f"{row.relative_error:.4f}", f"{row.sqnr_db:.2f}", f"{row.max_abs_error:.4g}"
        )
    Console().print(table)
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from megatron_quads.analyze import run, table_rows
    from megatron_quads.rollout.rac import ChannelStatistic

    report = run(
        Path(args.out),
        checkpoint=args.checkpoint,
        hf_model=args.hf_model,
        ratios=tuple(args.ratios),
        statistics=tuple(ChannelStatistic(s) for s in args.statistics),
        num_sequences=args.sequences,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    table = Table(title=f"rollout vs trainer gap: {report['model']}, {report['tokens']} tokens")
    for column in ("pair", "max |Δlogp|", "mean |Δlogp|", "k3 KL", "weight err", "activation err"):
        table.add_column(column, justify="left" if column == "pair" else "right")
    for row in table_rows(report):
        table.add_row(*row)
    Console().print(table)
    Console().print(f"wrote {Path(args.out) / 'analysis.json'} and {Path(args.out) / 'analysis.png'}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_quads.controller.config import ConfigError, check_runnable, load_config
    from megatron_quads.controller.run import TrainerFailure, run

    try:
        cfg = load_config(args.config, args.overrides)
        check_runnable(cfg)
    except ConfigError as err:
        Console(stderr=True).print(f"[red]{err}[/red]")
        return 2
    try:
        metrics = run(cfg)
    except TrainerFailure as err:
        Console(stderr=True).print(f"[red]training stopped: {err}[/red]")
        return 1
    Console().print(f"metrics: {metrics}\nplots:   {metrics.with_name('metrics.png')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="megatron-quads", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="quantize sample tensors to NVFP4 and print the error table")
    demo.add_argument("--rows", type=int, default=256)
    demo.add_argument("--cols", type=int, default=1024, help="a multiple of 16")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)

    train = sub.add_parser("train", help="run GRPO (config YAML plus dotted key=value overrides)")
    train.add_argument("config", nargs="?", default=None, help="YAML config (default: the embedded default)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.steps=3 precision.mode=quads")
    train.set_defaults(func=_cmd_train)

    analyze = sub.add_parser("analyze", help="decompose the rollout-vs-trainer gap into weight and activation error")
    analyze.add_argument("--out", default="runs/analysis", help="output directory (analysis.json, analysis.png)")
    analyze.add_argument("--checkpoint", default=None, help="Megatron dist checkpoint of the tiny model (default: random init)")
    analyze.add_argument("--hf-model", default=None, help="local Hugging Face Qwen3-MoE-format model directory")
    analyze.add_argument("--ratios", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0], help="RAC ratios")
    analyze.add_argument(
        "--statistics", nargs="+", default=["output_error", "activation_magnitude"],
        choices=["output_error", "residual_energy", "activation_magnitude"], help="RAC channel rankings to compare",
    )
    analyze.add_argument("--sequences", type=int, default=8)
    analyze.add_argument("--seq-len", type=int, default=64)
    analyze.add_argument("--seed", type=int, default=0)
    analyze.set_defaults(func=_cmd_analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-quads``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
