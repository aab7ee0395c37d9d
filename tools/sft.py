#!/usr/bin/env python3
"""Supervised warm-start of any policy architecture on a synthetic task (CPU, or one GPU when present).

    python tools/sft.py --out runs/chain_sft [--model arch.yaml] [--set num_layers=8 ...]
        [--task chain] [--task-option max_steps=40 ...] [--steps 2000] [--batch 64] [--lr 3e-3] [--seed 0]
        [--schedule cosine --warmup 100 --min-lr 1e-4] [--init runs/earlier_sft/checkpoint] [--save-every 250]
        [--eval-every 50 --eval-problems 50 --stop-at-accuracy 0.5]

The architecture is the embedded default's, overlaid with ``--model`` (a YAML mapping of
``PolicyModelConfig`` fields) and then each ``--set key=value``. The task is ``make_task(--task,
**--task-option)``; training draws its train split, evaluation its eval split. Loss is on the
completion (and ``<eos>``); every ``--eval-every`` steps greedy accuracy on held-out problems is
measured with the built-in engine. Writes ``<out>/checkpoint`` (model-only Megatron dist checkpoint
with a sha256 manifest; ``finished`` in it is true once the run has ended, ``steps_done`` the steps it
took) and ``<out>/metrics.jsonl`` (one record per step); with ``--save-every`` also every that many
steps, each write replacing ``<out>`` whole, so a run that is stopped keeps its last one.
``--stop-at-accuracy A`` ends the run at the first evaluation whose held-out greedy accuracy is at
least A: a warm start of a stated capability (GRPO needs rewards that vary), whatever the run-to-run
spread of the steps it takes to get there.

The lr is constant, or (``--schedule cosine``) rises over ``--warmup`` steps and falls to ``--min-lr``
at the last step. ``--init`` starts from another run's model-only checkpoint (the same architecture)
with a fresh optimizer and schedule: a warm-start carried from another machine continues this way.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from train_tiny_sft import masked_nll, save_model, sft_batch

from megatron_quads import embedded
from megatron_quads.controller.config import architecture_differences
from megatron_quads.tasks import Task, make_task
from megatron_quads.trainer.distributed import init_trainer_distributed
from megatron_quads.trainer.hf_export import qwen3_moe_config
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig, PolicyWorker, PolicyWorkerConfig
from megatron_quads.trainer.settings import load_model_config

logger = logging.getLogger("sft")


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``, each value read as YAML."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: expected key=value")
        out[key] = yaml.safe_load(value)
    return out


def model_config(path: Path | None, overrides: dict[str, Any]) -> PolicyModelConfig:
    """The embedded default's fields, then the YAML file's, then ``overrides``."""
    fields = embedded.model_config_fields()
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"--model {path}: expected a mapping of PolicyModelConfig fields")
        fields.update(loaded)
    return PolicyModelConfig(**{**fields, **overrides})


def check_fits(model: PolicyModelConfig, task: Task, vocab_size: int) -> int:
    """The task's longest completion in tokens; exits when the tokenizer or the longest sequence does not fit."""
    if vocab_size > model.vocab_size:
        raise SystemExit(f"vocab_size={model.vocab_size} is under the tokenizer's {vocab_size}: "
                         f"--set vocab_size={vocab_size}")
    cfg = task.config  # synthetic tasks state their longest prompt and answer
    longest = cfg.max_prompt_len + cfg.max_answer_len + 2  # <bos>, <eos>
    if longest > model.max_sequence_length:
        raise SystemExit(f"the task's longest sequence is {longest} tokens, over max_sequence_length="
                         f"{model.max_sequence_length}: --set max_sequence_length={longest} (or shorten the task)")
    return cfg.max_answer_len


def optim_config(args: argparse.Namespace) -> OptimConfig:
    """The optimizer and lr schedule of the command line (cosine decays over the run's ``--steps``)."""
    if args.schedule == "cosine" and args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be under --steps {args.steps} with --schedule cosine")
    try:
        return OptimConfig(lr=args.lr, weight_decay=0.01, lr_warmup_steps=args.warmup, lr_schedule=args.schedule,
                           min_lr=args.min_lr if args.schedule == "cosine" else 0.0,
                           lr_decay_steps=args.steps if args.schedule == "cosine" else None)
    except ValueError as err:
        raise SystemExit(f"bad lr schedule: {err}") from None


def check_init(path: Path, model: PolicyModelConfig) -> None:
    """Exits unless ``path`` is a model-only checkpoint of ``model``'s architecture (before any heavy work)."""
    if not (path / "metadata.json").exists():
        raise SystemExit(f"--init {path}: not a Megatron dist checkpoint (no metadata.json): give a previous "
                         "run's <out>/checkpoint")
    stored = load_model_config(path)
    if stored is not None:
        differ = {k: (getattr(stored, k), getattr(model, k)) for k in architecture_differences(stored, model)}
        if differ:
            raise SystemExit(f"--init {path}: its architecture differs from this run's in {differ} "
                             "(stored, asked): use the same --model and --set")


def main() -> None:
    """Train, evaluate, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="YAML mapping of PolicyModelConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a PolicyModelConfig field")
    parser.add_argument("--task", default="chain", help="a task kind of megatron_quads.tasks.make_task")
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100, help="0: only after the last step")
    parser.add_argument("--eval-problems", type=int, default=100)
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--warmup", type=int, default=0, help="steps over which the lr rises to --lr")
    parser.add_argument("--min-lr", type=float, default=0.0, help="cosine: the lr at the last step")
    parser.add_argument("--init", type=Path, help="a model-only checkpoint to start from (a previous run's <out>/checkpoint)")
    parser.add_argument("--save-every", type=int, default=0, help="also write <out> every this many steps (0: at the end only)")
    parser.add_argument("--stop-at-accuracy", type=float, metavar="A",
                        help="end the run at the first evaluation with held-out greedy accuracy >= A (0 < A <= 1)")
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: give at least 1")
    if args.stop_at_accuracy is not None and not 0.0 < args.stop_at_accuracy <= 1.0:
        raise SystemExit(f"--stop-at-accuracy {args.stop_at_accuracy}: give an accuracy in (0, 1]")
    if args.stop_at_accuracy is not None and args.eval_every == 0:
        raise SystemExit("--stop-at-accuracy needs --eval-every N > 0 (the run evaluates only after its last step "
                         "otherwise)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    model_cfg = model_config(args.model, key_values(args.set, "--set"))
    options = key_values(args.task_option, "--task-option")
    train_task = make_task(args.task, **{**options, "split": "train"})
    heldout = make_task(args.task, **{**options, "split": "eval"})
    tok = embedded.tokenizer()
    max_new_tokens = check_fits(model_cfg, train_task, tok.vocab_size)

    optim = optim_config(args)
    if args.init is not None:
        check_init(args.init, model_cfg)

    init_trainer_distributed(1, 0, ParallelConfig(), seed=args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = PolicyWorker(PolicyWorkerConfig(model=model_cfg, optim=optim, micro_batch_size=args.batch, seed=args.seed))
    if args.init is not None:
        worker.load_checkpoint(args.init, with_optimizer=False)
    pairs = train_task.iter_sft_pairs(seed=args.seed)
    records, accuracy, start = [], 0.0, time.time()

    def save(steps_done: int, finished: bool) -> None:
        save_model(worker, args.out, {
            "steps": args.steps, "steps_done": steps_done, "finished": finished,
            "stop_at_accuracy": args.stop_at_accuracy, "heldout_greedy_accuracy": accuracy,
            "command": "python tools/sft.py", "model": model_cfg.model_dump(),
            "task": {"kind": args.task, "options": options}, "batch": args.batch, "lr": args.lr,
            "schedule": {"kind": args.schedule, "warmup": args.warmup, "min_lr": args.min_lr},
            "init": None if args.init is None else str(args.init), "seed": args.seed, "device": device,
        }, files={"metrics.jsonl": "".join(json.dumps(r) + "\n" for r in records)})

    for step in range(1, args.steps + 1):
        metrics = worker.train_step(sft_batch([next(pairs) for _ in range(args.batch)], tok), masked_nll)
        record = {"step": step, "nll": metrics["nll"], "lr": metrics["lr"], "time_s": time.time() - start}
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            accuracy = embedded.greedy_accuracy(dict(worker.export_hf_weights()), qwen3_moe_config(model_cfg),
                                                n=args.eval_problems, heldout=heldout, max_new_tokens=max_new_tokens,
                                                device=device)
            record["heldout_greedy_accuracy"] = accuracy
            logger.info("step %d nll %.4f held-out accuracy %.3f (%.0fs)", step, metrics["nll"], accuracy,
                        record["time_s"])
        else:
            logger.info("step %d nll %.4f", step, metrics["nll"])
        records.append(record)
        reached = (args.stop_at_accuracy is not None and "heldout_greedy_accuracy" in record
                   and accuracy >= args.stop_at_accuracy)
        finished = step == args.steps or reached
        if finished or (args.save_every and step % args.save_every == 0):
            save(step, finished)
        if finished:
            break
    logger.info("wrote %s (held-out greedy accuracy %.3f after %d steps)", args.out, accuracy, step)


if __name__ == "__main__":
    main()
