"""Held-out evaluation: the run's held-out problems and the pass@1 of the engines' current weights on them."""

from __future__ import annotations

import logging
import time

from megatron_quads.controller.actor_groups import Rollouts
from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.prompts import prompt_limit, select_prompts
from megatron_quads.controller.rewards import decode_response
from megatron_quads.controller.sampling import eval_sampling
from megatron_quads.controller.task_settings import task_options
from megatron_quads.tasks import Task, Tokenizer

logger = logging.getLogger(__name__)


def eval_task(cfg: RunConfig) -> Task | None:
    """The held-out problems of the run's task (None when it has none and evaluation is off)."""
    from megatron_quads import embedded
    from megatron_quads.tasks import make_task

    if cfg.task is None:
        return embedded.task(split="eval")
    if cfg.task.eval_options is not None:
        return make_task(cfg.task.kind, **task_options(cfg, cfg.task.eval_options))
    if cfg.task.kind in ("arithmetic", "chain"):
        return make_task(cfg.task.kind, **{**dict(cfg.task.options), "split": "eval"})
    if cfg.eval.every:
        raise ValueError(f"eval.every is set but task kind {cfg.task.kind!r} has no held-out split: set "
                         "task.eval_options (e.g. path of the test file)")
    return None


def evaluate(cfg: RunConfig, rollouts: Rollouts, task: Task, tok: Tokenizer, step: int) -> dict[str, float]:
    """pass@1 of the engines' current weights on ``eval.prompts`` fixed held-out problems
    (``eval.samples`` responses each, at ``eval.temperature``): the mean correctness of the responses."""
    start = time.perf_counter()
    limit = prompt_limit(cfg, evaluation=True)
    held_out = select_prompts(task.sample_prompts(cfg.eval.prompts, seed=cfg.seed), tok, limit,
                              chat=cfg.data.apply_chat_template)  # too-long ones skipped
    if held_out.skipped:
        logger.warning("evaluation: skipped %d of %d held-out problems longer than %s", held_out.skipped,
                       cfg.eval.prompts, limit)
    problems, k = held_out.prompts, cfg.eval.samples
    ids = [p for p in held_out.ids for _ in range(k)]
    generations = rollouts.generate(ids, eval_sampling(cfg, tok, step))
    results = task.score_batch([p for p in problems for _ in range(k)], [decode_response(tok, g.token_ids) for g in generations])
    return {"step": step, "eval/pass@1": sum(r.correct for r in results) / len(results),
            "eval/reward": sum(r.reward for r in results) / len(results), "eval/skipped_too_long": float(held_out.skipped),
            "eval/response_length": sum(len(g.token_ids) for g in generations) / len(generations),
            "time/eval": time.perf_counter() - start}
