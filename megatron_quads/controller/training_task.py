"""The task a run trains on and its tokenizer."""

from __future__ import annotations

from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.task_settings import task_options, tokenizer_source
from megatron_quads.controller.workers import policy_model_config
from megatron_quads.tasks import Task, Tokenizer


def task_and_tokenizer(cfg: RunConfig) -> tuple[Task, Tokenizer]:
    """The run's task and tokenizer (the embedded default's when ``task`` is unset; the tokenizer of
    ``model.hf_path`` when it is set). Raises ValueError when the tokenizer has more tokens than the
    model's vocabulary."""
    from megatron_quads import embedded
    from megatron_quads.tasks import load_tokenizer, make_task

    task = embedded.task(split="train") if cfg.task is None else make_task(cfg.task.kind, **task_options(cfg, cfg.task.options))
    source = tokenizer_source(cfg)
    tok = embedded.tokenizer() if source is None else load_tokenizer(source)
    vocab = policy_model_config(cfg).vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab}: "
                         "set model.architecture.vocab_size >= the tokenizer's")
    return task, tok
