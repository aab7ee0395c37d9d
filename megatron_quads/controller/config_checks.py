"""Checks of a run config against what its engines and trainer would refuse mid-run, each a function
that returns what is wrong and the fix (or None); :data:`RUN_CHECKS` runs when a config is
validated, before Ray starts. Also the warnings of sampling settings that leave GRPO nothing to learn."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_quads.trainer.settings import gloo_layout_problem

if TYPE_CHECKING:
    from megatron_quads.controller.config import RunConfig
    from megatron_quads.trainer.settings import PolicyModelConfig


VLLM_TEMPERATURES = (0.01, 2.0)
"""The sampling temperatures vLLM takes besides 0 (greedy): it refuses a request above 2 and raises a
temperature below 0.01 to 0.01 (``vllm/sampling_params.py``, vLLM 0.32)."""


def run_dir_problem(cfg: RunConfig) -> str | None:
    """An empty ``run_dir`` is refused: it would put the run's lock, config, checkpoints and records
    into the current directory."""
    if cfg.run_dir.strip():
        return None
    return ("run_dir is empty: the run would write its lock, config.yaml, checkpoints and metrics into the current "
            "directory; give the run a directory of its own, e.g. run_dir=runs/my_run")


def temperature_problem(cfg: RunConfig) -> str | None:
    """A sampling temperature the engine refuses or changes. The rule: every engine takes a finite
    temperature >= 0 (0: greedy), the built-in engine any such value; vLLM takes 0 or [0.01, 2] for
    rollouts (it raises a lower one to 0.01, so its log-probs would not be at the temperature the
    trainer divides by) and at most 2 for evaluation (which reads no log-probs)."""
    low, high = VLLM_TEMPERATURES
    temperatures = [("rollout.temperature", cfg.rollout.temperature, True)]
    if cfg.eval.every:
        temperatures.append(("eval.temperature", cfg.eval.temperature, False))
    for key, value, trains in temperatures:
        if not math.isfinite(value):
            return f"{key}={value} is not a finite number: give a temperature >= 0 (0: greedy)"
        if cfg.rollout.engine != "vllm":
            continue
        if value > high:
            return (f"{key}={value} with rollout.engine=vllm: vLLM refuses temperatures above {high:g} (it samples at 0, "
                    f"greedy, or in [{low:g}, {high:g}]); set {key} <= {high:g}, or use rollout.engine=torch (the built-in "
                    "engine takes any finite temperature >= 0)")
        if trains and 0 < value < low:
            return (f"{key}={value} with rollout.engine=vllm: vLLM raises temperatures below {low:g} to {low:g}, so its "
                    f"log-probs would not be the ones the trainer computes at {value}; set {key}=0 (greedy) or "
                    f">= {low:g}, or use rollout.engine=torch")
    return None


def sequence_positions(cfg: RunConfig) -> tuple[int, str] | None:
    """The longest sequence (prompt + response) the run takes, and the setting that fixes it: the
    model's ``max_sequence_length`` (its engines' ``max_position_embeddings``), or a smaller
    ``rollout.vllm.max_model_len`` of the vLLM engine; None when the architecture is not known."""
    arch = cfg.policy_architecture()
    if arch is None:
        return None
    if cfg.model.embedded_default:
        source = "the embedded model's max_sequence_length"
    elif cfg.model.architecture is not None:
        source = "model.architecture.max_sequence_length"
    elif cfg.model.hf_path:
        source = f"max_position_embeddings in {cfg.model.hf_path}/config.json"
    else:
        source = f"max_sequence_length in {cfg.model.checkpoint}/model_config.json"
    limit = (arch.max_sequence_length, f"{source} = {arch.max_sequence_length}")
    max_model_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine == "vllm" and max_model_len is not None and max_model_len < limit[0]:
        limit = (max_model_len, f"rollout.vllm.max_model_len = {max_model_len}")
    return limit


def vllm_max_model_len_problem(cfg: RunConfig) -> str | None:
    """``rollout.vllm.max_model_len`` above the model's positions: vLLM refuses to start such an engine."""
    arch = cfg.policy_architecture()
    max_model_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine != "vllm" or arch is None or max_model_len is None or max_model_len <= arch.max_sequence_length:
        return None
    return (f"rollout.vllm.max_model_len={max_model_len} exceeds the model's {arch.max_sequence_length} positions "
            "(max_sequence_length, the max_position_embeddings vLLM reads): vLLM refuses to start; set "
            f"rollout.vllm.max_model_len <= {arch.max_sequence_length}, or leave it unset")


def longest_task_prompt(cfg: RunConfig, evaluation: bool = False) -> int | None:
    """Tokens of the longest prompt the run's task (``evaluation``: its held-out problems) can draw, when
    the config alone fixes it: the arithmetic or chain task with the character tokenizer (``<bos>`` and one
    token per character). None otherwise: a data file's prompts are measured once tokenized, at run time."""
    from megatron_quads import embedded
    from megatron_quads.tasks import make_task

    if cfg.model.hf_path or cfg.data.apply_chat_template:  # a Hugging Face tokenizer, a chat template: measured at run time
        return None
    if cfg.task is None:
        return embedded.task(split="eval" if evaluation else "train").config.max_prompt_len + 1
    if cfg.task.kind not in ("arithmetic", "chain") or cfg.task.tokenizer != "char":
        return None
    key, options = "task.options", cfg.task.options
    if evaluation and cfg.task.eval_options is not None:
        key, options = "task.eval_options", cfg.task.eval_options
    try:
        task = make_task(cfg.task.kind, **dict(options))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{key}: {err}") from None
    return task.config.max_prompt_len + 1


def _more_positions(source: str) -> str:
    """How to give a run more positions than ``source`` (from :func:`sequence_positions`) allows."""
    if source.startswith("rollout.vllm.max_model_len"):
        return "raise rollout.vllm.max_model_len"
    return "use a model with more positions"


def response_room_problem(cfg: RunConfig) -> str | None:
    """``max_new_tokens`` (the rollouts', and the evaluation's when it runs) plus the longest prompt must
    fit in the run's positions (:func:`sequence_positions`). The longest prompt is known before the run
    for the arithmetic task with the character tokenizer (:func:`longest_task_prompt`); for a data file's
    prompts it is taken as one token here, and the run skips each prompt that leaves too little room."""
    limit = sequence_positions(cfg)
    if limit is None:
        return None
    positions, source = limit
    checks = [("rollout.max_new_tokens", cfg.rollout.max_new_tokens, longest_task_prompt(cfg))]
    if cfg.eval.every:
        key = "eval.max_new_tokens" if cfg.eval.max_new_tokens is not None else "rollout.max_new_tokens"
        checks.append((key, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, longest_task_prompt(cfg, True)))
    for key, new_tokens, prompt in checks:
        if prompt is None and new_tokens >= positions:
            return (f"{key}={new_tokens} leaves no position for a prompt: the run's sequences end at {positions} "
                    f"positions ({source}); set {key} <= {positions - 1}, or {_more_positions(source)}")
        if prompt is not None and prompt + new_tokens > positions:
            return (f"{key}={new_tokens} plus the task's longest prompt ({prompt} tokens) needs {prompt + new_tokens} "
                    f"positions, over the run's {positions} ({source}); set {key} <= {positions - prompt}, or "
                    f"{_more_positions(source)}")
    return None


def prompt_token_limit(cfg: RunConfig, evaluation: bool = False) -> int | None:
    """The most tokens a prompt may have so that it and ``max_new_tokens`` of response fit in the run's
    positions (``evaluation``: with the evaluation's ``max_new_tokens``); None when they are not known."""
    limit = sequence_positions(cfg)
    if limit is None:
        return None
    new_tokens = (cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens) if evaluation else cfg.rollout.max_new_tokens
    return limit[0] - new_tokens


def gloo_problem(cfg: RunConfig) -> str | None:
    """A trainer layout gloo cannot run, for trainer ranks on CPU (:func:`~megatron_quads.trainer.settings.gloo_layout_problem`)."""
    arch = cfg.policy_architecture()
    if cfg.placement.trainer_gpus_per_worker > 0 or arch is None:
        return None
    return gloo_layout_problem(arch, cfg.parallel)


def expert_parallel_batch_problem(cfg: RunConfig) -> str | None:
    """Under expert parallelism whose groups span several data-parallel replicas (expert-TP x EP ranks
    more than the TP ranks of one replica), every data-parallel rank must get an equal share of each
    update: the token dispatcher's all-to-all and all-gather run across those ranks in every micro-batch,
    so each must run as many micro-batches, and under the allgather dispatcher of equal sizes."""
    p = cfg.parallel
    etp = p.expert_tensor_parallel or p.tensor_parallel
    dp = cfg.trainer_world_size // (p.tensor_parallel * p.pipeline_parallel)
    if dp == 1 or etp * p.expert_parallel <= p.tensor_parallel:
        return None
    sequences, updates = cfg.grpo.prompts_per_step * cfg.grpo.responses_per_prompt, cfg.grpo.mini_batches
    if sequences % (updates * dp) == 0:
        return None
    return (f"grpo.prompts_per_step x grpo.responses_per_prompt = {sequences} sequences do not split into "
            f"grpo.mini_batches={updates} update(s) of equal shares for the {dp} data-parallel ranks: with "
            f"parallel.expert_parallel={p.expert_parallel} the ranks exchange tokens in every micro-batch (the "
            "token dispatcher's all-to-all or all-gather), so each must hold as many sequences; make the step's "
            f"sequences a multiple of {updates * dp}")


def data_parallel_batch_problem(cfg: RunConfig) -> str | None:
    """Every data-parallel trainer replica must get at least one sequence of every update (the step's
    sequences split into ``grpo.mini_batches`` updates, the first ones a sequence longer when they do
    not divide)."""
    p = cfg.parallel
    dp = cfg.trainer_world_size // (p.tensor_parallel * p.pipeline_parallel)
    sequences, updates = cfg.grpo.prompts_per_step * cfg.grpo.responses_per_prompt, cfg.grpo.mini_batches
    smallest = sequences // updates
    if smallest >= dp:
        return None
    return (f"grpo.prompts_per_step x grpo.responses_per_prompt = {sequences} sequences in grpo.mini_batches={updates} "
            f"update(s) give an update {smallest} sequence(s), fewer than the {dp} data-parallel trainer replicas "
            f"(trainer_world_size={cfg.trainer_world_size} / parallel.tensor_parallel={p.tensor_parallel}), so a "
            f"replica would have nothing to train on: make the step's sequences at least {updates * dp}, lower "
            "grpo.mini_batches, or use fewer data-parallel ranks")


FILE_TASK_KINDS = ("gsm8k", "math", "qa")
"""Task kinds whose problems come from a data file (``path``); they have no held-out split of their own."""


def eval_split_problem(cfg: RunConfig) -> str | None:
    """Evaluation (``eval.every`` > 0) needs held-out problems: the embedded default and the arithmetic
    task have their own eval split; a data-file task needs ``task.eval_options`` with the ``path`` of
    a held-out file (that it exists is checked before the run starts: ``preflight.check_eval_file``)."""
    if not cfg.eval.every or cfg.task is None or cfg.task.kind not in FILE_TASK_KINDS:
        return None
    options = cfg.task.eval_options
    if options is None:
        return (f"eval.every={cfg.eval.every} needs held-out problems, and task kind {cfg.task.kind!r} has no held-out "
                "split: set task.eval_options.path to a held-out file of the same fields (e.g. "
                "task.eval_options.path=data/test.jsonl), or eval.every=0")
    path = options.get("path")
    if path is None:
        return (f"task.eval_options has no path: task kind {cfg.task.kind!r} reads its held-out problems from a file; "
                "set task.eval_options.path (e.g. task.eval_options.path=data/test.jsonl)")
    return None


VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head dims vLLM's CPU attention backend serves (``CPUAttentionBackend.get_supported_head_sizes``
in ``vllm/v1/attention/backends/cpu_attn.py``, vLLM 0.32): any other is refused when the engine starts."""


def head_dim(arch: PolicyModelConfig) -> int:
    """An architecture's attention head dim: ``kv_channels``, else hidden_size / num_attention_heads."""
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def head_dim_problem(cfg: RunConfig) -> str | None:
    """A head dim the run's engines cannot serve. The rule: every engine needs an even head dim (rotary
    embeddings rotate the two halves of each head); vLLM on CPU (``rollout.engine=vllm`` without GPUs)
    serves only :data:`VLLM_CPU_HEAD_DIMS`. The built-in engine and the trainer take any even one."""
    arch = cfg.policy_architecture()
    if arch is None:
        return None
    dim, source = head_dim(arch), _architecture_source(cfg)
    if dim % 2:
        return (f"the model's head dim is {dim} ({source}): rotary embeddings need an even head dim; choose "
                "kv_channels or hidden_size / num_attention_heads even")
    if cfg.rollout.engine == "vllm" and not cfg.rollout_on_gpu() and dim not in VLLM_CPU_HEAD_DIMS:
        return (f"rollout.engine=vllm on CPU cannot serve the model's head dim {dim} ({source}): vLLM's CPU attention "
                f"takes head dims {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}; use rollout.engine=torch (the built-in "
                "engine takes any even head dim), or a model with one of those head dims")
    return None


def _architecture_source(cfg: RunConfig) -> str:
    """Where the run's architecture comes from, in words."""
    if cfg.model.embedded_default:
        return "the embedded model"
    if cfg.model.architecture is not None:
        return "model.architecture"
    return f"{cfg.model.checkpoint}/model_config.json"


RUN_CHECKS = (run_dir_problem, temperature_problem, vllm_max_model_len_problem, response_room_problem, gloo_problem,
              data_parallel_batch_problem, expert_parallel_batch_problem, eval_split_problem, head_dim_problem)
"""The checks a validated config passes (each returns what is wrong and the fix, or None), in order."""


def learning_signal_warnings(cfg: RunConfig) -> list[str]:
    """Sampling settings that make every GRPO group's responses identical, so every advantage and the
    policy-gradient loss are zero, each with why: greedy decoding (``rollout.temperature=0``), or a
    ``rollout.top_p`` of at most 1 / vocab_size (the most likely token alone always reaches it)."""
    n = cfg.grpo.responses_per_prompt
    consequence = (f"the grpo.responses_per_prompt={n} responses to a prompt are the same tokens, so every group's "
                   "rewards are equal, its advantages zero and the policy-gradient loss zero: the policy does not learn")
    roll = cfg.rollout
    if roll.temperature == 0:
        return [f"rollout.temperature=0 decodes greedily: {consequence}; sample with rollout.temperature > 0 (e.g. 1.0)"]
    arch = cfg.policy_architecture()
    if arch is not None and roll.top_p <= 1 / arch.vocab_size:
        return [f"rollout.top_p={roll.top_p} <= 1 / vocab_size (1/{arch.vocab_size}) keeps only the most likely token: "
                f"{consequence}; raise rollout.top_p (e.g. 1.0)"]
    return []
