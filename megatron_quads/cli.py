"""``megatron-quads`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from megatron_quads.tasks import Task


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


def _run_held_out(path: str | None) -> Task:
    """The held-out problems of the run config at ``path`` (``--tokens run-task``), in the embedded tokenizer."""
    from megatron_quads.controller.config import load_config
    from megatron_quads.controller.evaluation import eval_task

    if path is None:
        raise ValueError("tokens 'run-task' take the run's task from its config: give --run-config RUN_DIR/config.yaml")
    cfg = load_config(path)
    if cfg.model.hf_path:
        raise ValueError(f"{path} trains a Hugging Face model (model.hf_path), whose tokenizer analyze does not "
                         "encode with: use tokens 'random'")
    held_out = eval_task(cfg)
    if held_out is None:
        raise ValueError(f"{path}: task {cfg.task.kind!r} has no held-out split (task.eval_options): use tokens 'random'")
    return held_out


def _analysis_rows(args: argparse.Namespace) -> dict:
    """``analyze``'s token rows for ``--tokens`` (random: left to the analysis, which knows the vocabulary)."""
    if args.tokens == "random":
        return {}
    from megatron_quads import embedded

    held_out = _run_held_out(args.run_config) if args.tokens == "run-task" else None
    rows = (embedded.task_token_rows(args.sequences, args.seq_len, 2 * args.seed, held_out),
            embedded.task_token_rows(args.sequences, args.seq_len, 2 * args.seed + 1, held_out))
    return {"rows": rows, "token_source": args.tokens, "rows_vocab_size": embedded.model_config_fields()["vocab_size"]}


def _cmd_analyze(args: argparse.Namespace) -> int:
    from megatron_quads.analyze import run, table_rows
    from megatron_quads.rollout.rac import ChannelStatistic

    try:
        report = run(
            Path(args.out),
            checkpoint=args.checkpoint,
            hf_model=args.hf_model,
            ratios=tuple(args.ratios),
            statistics=tuple(ChannelStatistic(s) for s in args.statistics),
            num_sequences=args.sequences,
            seq_len=args.seq_len,
            seed=args.seed,
            **_analysis_rows(args),
        )
    except (ValueError, FileNotFoundError) as err:  # bad input: a refused checkpoint, a missing model, ...
        Console(stderr=True).print(f"[red]analyze: {escape(str(err))}[/red]", soft_wrap=True)
        return 2
    table = Table(title=f"rollout vs trainer gap: {report['model']}, {report['tokens']} tokens ({args.tokens})")
    for column in ("pair", "max |Δlogp|", "mean |Δlogp|", "k3 KL", "weight err", "activation err"):
        table.add_column(column, justify="left" if column == "pair" else "right")
    for row in table_rows(report):
        table.add_row(*row)
    Console().print(table)
    Console().print(f"wrote {Path(args.out) / 'analysis.json'} and {Path(args.out) / 'analysis.png'}")
    return 0


def load_run_config(path: str | None, overrides: list[str]):
    """The run config of ``path`` + ``overrides``, validated; every problem is a :class:`ConfigError`,
    raised before torch, Megatron, Ray or vLLM is imported."""
    from megatron_quads.controller.config import validate_config
    from megatron_quads.controller.config_file import read_config

    return validate_config(read_config(path, overrides))


def _cmd_train(args: argparse.Namespace) -> int:
    """``train``: exit 0 when the run ends, 1 when it stops on a failure (a trainer rank, the storage, the
    reward function), 2
    for a config or run directory it cannot take, 128 + the signal's number when SIGTERM / SIGINT
    stopped it (143 / 130); every stop but a config error names the command that resumes."""
    from megatron_quads.controller.config_file import ConfigError

    try:
        cfg = load_run_config(args.config, args.overrides)
        from megatron_quads.controller.config import check_runnable

        check_runnable(cfg)
    except ConfigError as err:
        return _fail(str(err), 2)
    from megatron_quads.controller.run_dir import RunDirError, prepare_run_dir

    if cfg.model.checkpoint and Path(cfg.model.checkpoint).is_dir():
        # Imports torch, so only when there is a checkpoint to audit; before the run dir exists so a
        # refused checkpoint leaves nothing behind (the audit is cached for run()).
        from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError, audit_dist_checkpoint

        try:
            audit_dist_checkpoint(cfg.model.checkpoint)
        except UnsafeCheckpointError as err:
            return _fail(str(err), 2)
    try:
        prepare_run_dir(cfg.run_dir)  # a file where it belongs, a read-only filesystem: before anything heavy
    except RunDirError as err:
        return _fail(str(err), 2)
    try:
        return _train(cfg, args.force_config)
    except KeyboardInterrupt:  # outside the run's own handlers (start-up, or a second Ctrl-C while it stops)
        return _fail("interrupted by SIGINT; the same command resumes from the last complete checkpoint (or starts "
                     "the run when there is none)", 130)


def _train(cfg, force_config: bool) -> int:
    """Run ``cfg`` (a validated RunConfig) and turn how it ended into the exit code and its message."""
    from megatron_quads.controller.custom_reward import RewardFunctionError
    from megatron_quads.controller.failures import TrainerFailure
    from megatron_quads.controller.faults import StorageError
    from megatron_quads.controller.hf_model import HfConversionError
    from megatron_quads.controller.placement import PlacementError
    from megatron_quads.controller.preemption import RunStopped
    from megatron_quads.controller.run import run
    from megatron_quads.controller.run_dir import RunDirError
    from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError

    try:
        metrics = run(cfg, force_config=force_config)
    except (RunDirError, PlacementError, UnsafeCheckpointError, HfConversionError) as err:  # run_dir in use,
        # unusable or of another config; a small cluster; a model.checkpoint whose pickles could run code; a
        # model.hf_path that does not convert
        return _fail(str(err), 2)
    except (TrainerFailure, StorageError, RewardFunctionError) as err:  # RewardFunctionError: names the row
        return _fail(f"training stopped: {err}", 1)
    except RunStopped as err:
        return _fail(str(err), err.exit_code, style="yellow")
    Console().print(f"metrics: {metrics}\nplots:   {metrics.with_name('metrics.png')}")
    return 0


def _fail(message: str, code: int, style: str = "red") -> int:
    Console(stderr=True).print(f"[{style}]{escape(message)}[/{style}]", soft_wrap=True)
    return code


def _parse_bytes(text: str) -> int:
    """``2GB`` / ``500MB`` / ``1.5GiB`` / ``123`` -> bytes (``pydantic.ByteSize``: KB, MB, GB, TB are
    decimal, as Hugging Face's shard sizes; KiB, MiB, GiB, TiB binary; any case)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text.strip()))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB, 1GiB)") from None


def _parallel(args: argparse.Namespace):
    from megatron_quads.trainer.model import ParallelConfig

    return ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep, expert_tensor_parallel=args.etp)


def _model_config_file(path: str):
    """The architecture in a ``model_config.json`` or in a run's ``config.yaml`` (its model section)."""
    import json

    from megatron_quads.trainer.model import PolicyModelConfig

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model config {file} does not exist")
    if file.suffix in (".yaml", ".yml"):
        from megatron_quads.controller.workers import policy_model_config

        return policy_model_config(load_run_config(str(file), []))
    return PolicyModelConfig(**json.loads(file.read_text()))


def _cmd_convert(args: argparse.Namespace) -> int:
    model_config = getattr(args, "model_config", None)
    if model_config and Path(model_config).suffix in (".yaml", ".yml"):  # a run's config: its file errors at once
        from megatron_quads.controller.config_file import ConfigError, read_config

        try:
            read_config(model_config, [])
        except ConfigError as err:
            Console(stderr=True).print(f"[red]convert {args.convert}: {escape(str(err))}[/red]", soft_wrap=True)
            return 2
    from megatron_quads.convert import commands
    from megatron_quads.convert.megatron_writer import ConversionError

    try:
        model = _model_config_file(args.model_config) if getattr(args, "model_config", None) else None
        if args.convert == "hf-to-megatron":
            out = commands.hf_to_megatron(args.source, args.out, _parallel(args), overwrite=args.overwrite,
                                          allow_nonfinite=args.allow_nonfinite)
        elif args.convert == "megatron-to-hf":
            out = commands.megatron_to_hf(args.source, args.out, model, hf_base=args.hf_base,
                                          max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                                          allow_nonfinite=args.allow_nonfinite)
        elif args.convert == "reshard":
            out = commands.reshard(args.source, args.out, _parallel(args), model, overwrite=args.overwrite,
                                   allow_nonfinite=args.allow_nonfinite)
        else:
            from megatron_quads.convert.to_quads import to_quads

            out = to_quads(
                args.source, args.out, args.ratio, calibration_file=args.calibration,
                calibration_prompts=args.calibration_prompts, input_scales=args.input_scales, scope=args.scope,
                model=model, tokenizer=args.tokenizer, overwrite=args.overwrite, seed=args.seed,
            )
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, ConversionError) as err:
        Console(stderr=True).print(f"[red]convert {args.convert}: {escape(str(err))}[/red]", soft_wrap=True)
        return 2
    Console().print(f"wrote {out}")
    return 0


def _add_convert(sub) -> None:
    convert = sub.add_parser("convert", help="convert and reshard checkpoints (Hugging Face, Megatron, NVFP4-plus-residual)")
    kinds = convert.add_subparsers(dest="convert", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("source", help="input directory")
        parser.add_argument("out", help="output directory (written atomically)")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        parser.set_defaults(func=_cmd_convert)

    def layout(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the saved layout")
        parser.add_argument("--ep", type=int, default=1, help="expert parallel size of the saved layout")
        parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")

    def nonfinite(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--allow-nonfinite", action="store_true",
                            help="copy tensors holding NaN or Inf as they are (default: stop, naming the tensor)")

    def model_config(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model-config", default=None,
                            help="architecture of the checkpoint (model_config.json or a run's config.yaml) when it "
                                 "has no model_config.json beside it")

    hf_to_megatron = kinds.add_parser("hf-to-megatron", help="HF Qwen3-MoE directory -> Megatron dist checkpoint")
    common(hf_to_megatron)
    layout(hf_to_megatron)
    nonfinite(hf_to_megatron)
    megatron_to_hf = kinds.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> HF safetensors (offline)")
    common(megatron_to_hf)
    model_config(megatron_to_hf)
    nonfinite(megatron_to_hf)
    megatron_to_hf.add_argument("--hf-base", default=None,
                                help="HF directory whose config fields and tokenizer files the output keeps "
                                     "(default: the checkpoint's hf_base/)")
    megatron_to_hf.add_argument("--max-shard-size", type=_parse_bytes, default="1GB",
                                help="close a safetensors shard once it holds this much (default: 1GB)")
    reshard = kinds.add_parser("reshard", help="Megatron dist checkpoint -> the same in another TP/EP layout")
    common(reshard)
    layout(reshard)
    model_config(reshard)
    nonfinite(reshard)
    to_quads = kinds.add_parser("to-quads", help="HF directory or Megatron checkpoint -> NVFP4-plus-residual (vLLM)")
    common(to_quads)
    model_config(to_quads)
    to_quads.add_argument("--ratio", type=float, default=None,
                          help="RAC residual-channel ratio (0 to 1); default: the --quads-rac-ratio a Megatron-LM "
                               "checkpoint recorded (required otherwise)")
    calibration = to_quads.add_mutually_exclusive_group()
    calibration.add_argument("--calibration", default=None,
                             help="calibration prompts: a text file (one per line) or JSONL with a 'prompt' or 'text' field")
    calibration.add_argument("--calibration-prompts", type=int, default=None,
                             help="calibrate on this many prompts of the built-in arithmetic task (default: 64)")
    to_quads.add_argument("--input-scales", choices=["static", "dynamic"], default="dynamic",
                          help="static: an input_scale per linear from calibration amaxes; dynamic: per-token scales")
    to_quads.add_argument("--scope", default="routed_experts", metavar="{routed_experts,routed_experts_and_attention}",
                          help="which linears are NVFP4: the routed experts' (default), or those and attention q/k/v/o")
    to_quads.add_argument("--tokenizer", default=None,
                          help="tokenizer of the calibration prompts: an HF tokenizer directory, or 'char' (the embedded "
                               "model's); default: the source's tokenizer files")
    to_quads.add_argument("--seed", type=int, default=0, help="seed of the sampled calibration prompts")


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
    train.add_argument("--force-config", action="store_true",
                       help="continue the run in run_dir under this config although it differs from the saved "
                            "config.yaml in keys a resume may not change (the saved one is kept as config.<time>.yaml)")
    train.set_defaults(func=_cmd_train)

    analyze = sub.add_parser("analyze", help="decompose the rollout-vs-trainer gap into weight and activation error")
    analyze.add_argument("--out", default="runs/analysis", help="output directory (analysis.json, analysis.png)")
    analyze.add_argument("--checkpoint", default=None, help="Megatron dist checkpoint (its model_config.json is the architecture; default: the tiny model, random init)")
    analyze.add_argument("--hf-model", default=None, help="local Hugging Face Qwen3-MoE-format model directory")
    analyze.add_argument("--ratios", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0], help="RAC ratios")
    analyze.add_argument(
        "--statistics", nargs="+", default=["output_error", "activation_magnitude"],
        choices=["output_error", "residual_energy", "activation_magnitude"], help="RAC channel rankings to compare",
    )
    analyze.add_argument("--tokens", choices=["random", "embedded-task", "run-task"], default="random",
                         help="random ids (any model), the embedded task's held-out problems and answers (the embedded "
                         "model), or those of the task of --run-config (a run on the embedded tokenizer)")
    analyze.add_argument("--run-config", default=None, help="a run's config.yaml (--tokens run-task)")
    analyze.add_argument("--sequences", type=int, default=8)
    analyze.add_argument("--seq-len", type=int, default=64)
    analyze.add_argument("--seed", type=int, default=0)
    analyze.set_defaults(func=_cmd_analyze)
    _add_convert(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-quads``."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "train" and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra  # overrides after --force-config
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
