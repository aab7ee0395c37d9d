"""``megatron-quads`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-quads``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
