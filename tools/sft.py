#!/usr/bin/env python3
"""Supervised warm-start of any policy architecture on a synthetic task (CPU, or one GPU when present).

    python tools/sft.py --out runs/chain_sft [--model arch.yaml] [--set num_layers=8 ...]
        [--task chain] [--task-option max_steps=40 ...] [--steps 2000] [--batch 64] [--lr 3e-3] [--seed 0]

The architecture is the embedded default's, overlaid with ``--model`` (a YAML mapping of
``PolicyModelConfig`` fields) and then each ``--set key=value``. The task is ``make_task(--task,
**--task-option)``; training draws its train split, evaluation its eval split. Loss is on the
completion (and ``<eos>``); every ``--eval-every`` steps greedy accuracy on held-out problems is
measured with the built-in engine. Writes ``<out>/checkpoint`` (model-only Megatron dist checkpoint
with a sha256 manifest) and ``<out>/metrics.jsonl`` (one record per step).
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
from megatron_quads.tasks import Task, make_task
from megatron_quads.trainer.distributed import init_trainer_distributed
from megatron_quads.trainer.hf_export import qwen3_moe_config
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig, PolicyWorker, PolicyWorkerConfig

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
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    model_cfg = model_config(args.model, key_values(args.set, "--set"))
    options = key_values(args.task_option, "--task-option")
    train_task = make_task(args.task, **{**options, "split": "train"})
    heldout = make_task(args.task, **{**options, "split": "eval"})
    tok = embedded.tokenizer()
    max_new_tokens = check_fits(model_cfg, train_task, tok.vocab_size)

    init_trainer_distributed(1, 0, ParallelConfig(), seed=args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = PolicyWorker(PolicyWorkerConfig(model=model_cfg, optim=OptimConfig(lr=args.lr, weight_decay=0.01),
                                             micro_batch_size=args.batch, seed=args.seed))
    pairs = train_task.iter_sft_pairs(seed=args.seed)
    records, accuracy, start = [], 0.0, time.time()
    for step in range(1, args.steps + 1):
        metrics = worker.train_step(sft_batch([next(pairs) for _ in range(args.batch)], tok), masked_nll)
        record = {"step": step, "nll": metrics["nll"], "time_s": time.time() - start}
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            accuracy = embedded.greedy_accuracy(dict(worker.export_hf_weights()), qwen3_moe_config(model_cfg),
                                                n=args.eval_problems, heldout=heldout, max_new_tokens=max_new_tokens,
                                                device=device)
            record["heldout_greedy_accuracy"] = accuracy
            logger.info("step %d nll %.3f held-out accuracy %.3f (%.0fs)", step, metrics["nll"], accuracy,
                        record["time_s"])
        else:
            logger.info("step %d nll %.3f", step, metrics["nll"])
        records.append(record)
    save_model(worker, args.out, {
        "steps": args.steps, "heldout_greedy_accuracy": accuracy, "command": "python tools/sft.py",
        "model": model_cfg.model_dump(), "task": {"kind": args.task, "options": options},
        "batch": args.batch, "lr": args.lr, "seed": args.seed, "device": device,
    }, files={"metrics.jsonl": "".join(json.dumps(r) + "\n" for r in records)})
    logger.info("wrote %s (held-out greedy accuracy %.3f after %d steps)", args.out, accuracy, args.steps)


if __name__ == "__main__":
    main()
