#!/usr/bin/env python3
"""Warm-start the embedded tiny GPT-MoE on synthetic arithmetic (supervised), reproducibly on CPU.

    python tools/train_tiny_sft.py [--steps 1500] [--out megatron_quads/assets/tiny_moe_sft]

Trains the Megatron policy (one CPU rank) on prompt/answer pairs with the loss on the answer,
measures greedy accuracy on held-out problems with the built-in engine after each evaluation
interval, and stops once accuracy passes ``--target`` (a start for GRPO well above zero and below
the ceiling). Writes a model-only Megatron dist checkpoint with a sha256 manifest.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

import torch

from megatron_quads import embedded
from megatron_quads.tasks import encode_sft_pair
from megatron_quads.trainer.distributed import init_trainer_distributed
from megatron_quads.trainer.hf_export import qwen3_moe_config
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig, PolicyWorker, PolicyWorkerConfig

logger = logging.getLogger("train_tiny_sft")


def sft_batch(pairs: list[tuple[str, str]], tok) -> dict[str, torch.Tensor]:
    """Right-padded token ids and a loss mask on the answer (and eos)."""
    encoded = [encode_sft_pair(tok, p, c) for p, c in pairs]
    width = max(len(ids) for ids, _ in encoded)
    tokens = torch.full((len(encoded), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width))
    for i, (ids, m) in enumerate(encoded):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"tokens": tokens, "mask": mask}


def masked_nll(logprobs: torch.Tensor, mb: dict) -> tuple:
    """Token-mean negative log-likelihood over the answer tokens (the (sum, count) contract)."""
    mask = mb["mask"][:, 1:]
    return -(logprobs * mask).sum(), mask.sum(), {"nll": -logprobs * mask}


def save_model(worker: PolicyWorker, out: Path, extra: dict, files: dict[str, str] | None = None) -> None:
    """Write ``out/checkpoint`` (model-only dist checkpoint with a manifest holding ``extra``) and
    ``files`` (name -> text) beside it; ``out`` is replaced whole, never left half-written."""
    staging = out.with_name(out.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    worker.save_checkpoint(staging / "checkpoint", with_optimizer=False)
    for rng_file in (staging / "checkpoint").glob("rng_rank*.pt"):
        rng_file.unlink()  # RNG state is not part of the shipped model
    embedded.write_manifest(staging / "checkpoint", extra)
    for name, text in (files or {}).items():
        (staging / name).write_text(text)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def main() -> None:
    """Train, evaluate, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.4, help="stop once held-out greedy accuracy reaches this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=embedded.ASSET_DIR)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    init_trainer_distributed(1, 0, ParallelConfig(), seed=args.seed)
    model_cfg = PolicyModelConfig(**embedded.model_config_fields())
    worker = PolicyWorker(PolicyWorkerConfig(model=model_cfg, optim=OptimConfig(lr=args.lr, weight_decay=0.01),
                                             micro_batch_size=args.batch, seed=args.seed))
    tok, pairs = embedded.tokenizer(), embedded.task(split="train").iter_sft_pairs(seed=args.seed)
    accuracy, start = 0.0, time.time()
    for step in range(1, args.steps + 1):
        batch = sft_batch([next(pairs) for _ in range(args.batch)], tok)
        metrics = worker.train_step(batch, masked_nll)
        if step % args.eval_every == 0:
            accuracy = embedded.greedy_accuracy(dict(worker.export_hf_weights()), qwen3_moe_config(model_cfg))
            logger.info("step %d nll %.3f held-out accuracy %.3f (%.0fs)", step, metrics["nll"], accuracy, time.time() - start)
            if accuracy >= args.target:
                break
    save_model(worker, args.out, {
        "steps": step, "heldout_greedy_accuracy": accuracy, "command": "python tools/train_tiny_sft.py",
        "model": embedded.model_config_fields(), "arithmetic_level": embedded.ARITHMETIC_LEVEL,
    })
    logger.info("wrote %s (held-out greedy accuracy %.3f after %d steps)", args.out, accuracy, step)


if __name__ == "__main__":
    main()
