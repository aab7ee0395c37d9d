"""Config checks for what the engines and the trainer would refuse mid-run: each is a ConfigError naming
the key and the fix, raised when the config loads (no worker, no Ray, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_quads.controller.config import ConfigError, load_config
from megatron_quads.controller.config_checks import learning_signal_warnings

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"
"""The embedded default: a 64-position model, arithmetic prompts of at most 7 tokens (``<bos>99-99=``)."""


def _refused(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(EXAMPLE, overrides)


@pytest.mark.parametrize("run_dir", ["''", "'   '"])
def test_an_empty_run_dir_is_refused(run_dir: str) -> None:
    _refused([f"run_dir={run_dir}"], r"run_dir is empty: .* into the current directory; .* e\.g\. run_dir=runs/my_run")
    assert load_config(EXAMPLE, ["run_dir=runs/x"]).run_dir == "runs/x"


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["rollout.engine=vllm", "rollout.temperature=20"],
         r"rollout\.temperature=20\.0 with rollout\.engine=vllm: vLLM refuses temperatures above 2 .* set "
         r"rollout\.temperature <= 2, or use rollout\.engine=torch"),
        (["rollout.engine=vllm", "rollout.temperature=0.005"],
         r"vLLM raises temperatures below 0\.01 to 0\.01, so its log-probs would not be the ones the trainer computes"),
        (["rollout.engine=torch", "rollout.temperature=.inf"], r"rollout\.temperature=inf is not a finite number"),
        (["rollout.engine=vllm", "eval.every=1", "eval.temperature=3"], r"eval\.temperature=3\.0 .* vLLM refuses"),
    ],
)
def test_temperatures_an_engine_refuses_or_changes_are_refused(overrides: list[str], pattern: str) -> None:
    _refused(overrides, pattern)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.engine=vllm", "rollout.temperature=2"], ["rollout.engine=vllm", "rollout.temperature=0.01"],
        ["rollout.engine=vllm", "rollout.temperature=0"], ["rollout.engine=torch", "rollout.temperature=20"],
        ["rollout.engine=torch", "rollout.temperature=0.005"],
        ["rollout.engine=vllm", "eval.every=1", "eval.temperature=0.005"],  # evaluation reads no log-probs
        ["rollout.engine=vllm", "eval.temperature=3"],  # no evaluation: a setting without effect, warned about
    ],
)
def test_temperatures_the_engine_takes_pass(overrides: list[str]) -> None:
    load_config(EXAMPLE, overrides)


def test_sampling_that_makes_every_group_identical_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        greedy = load_config(EXAMPLE, ["rollout.temperature=0"])
    (warning,) = learning_signal_warnings(greedy)
    assert warning.startswith("rollout.temperature=0 decodes greedily") and "advantages zero" in warning
    assert warning in caplog.text
    # the embedded vocabulary has 32 tokens: a nucleus of at most 1/32 holds the most likely token alone
    (narrow,) = learning_signal_warnings(load_config(EXAMPLE, ["rollout.engine=torch", "rollout.top_p=0.03"]))
    assert narrow.startswith("rollout.top_p=0.03 <= 1 / vocab_size (1/32)")
    for sampled in (["rollout.temperature=1"], ["rollout.engine=torch", "rollout.top_p=0.05"]):
        assert learning_signal_warnings(load_config(EXAMPLE, sampled)) == []


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["rollout.max_new_tokens=58"],
         r"rollout\.max_new_tokens=58 plus the task's longest prompt \(7 tokens\) needs 65 positions, over the run's 64 "
         r"\(the embedded model's max_sequence_length = 64\); set rollout\.max_new_tokens <= 57"),
        (["eval.every=1", "eval.max_new_tokens=58"], r"eval\.max_new_tokens=58 .* set eval\.max_new_tokens <= 57"),
        (["rollout.vllm.max_model_len=32", "rollout.max_new_tokens=26"],
         r"over the run's 32 \(rollout\.vllm\.max_model_len = 32\); set rollout\.max_new_tokens <= 25, or raise "
         r"rollout\.vllm\.max_model_len"),
        (["rollout.vllm.max_model_len=65"],
         r"rollout\.vllm\.max_model_len=65 exceeds the model's 64 positions .* vLLM refuses to start"),
        # level 5: four operands of three digits, 3 operators and '=' (16 characters) and <bos>
        (["task.kind=arithmetic", "task.options.level=5", "rollout.max_new_tokens=48"],
         r"longest prompt \(17 tokens\) needs 65 positions, .* <= 47"),
        (["task.kind=arithmetic", "task.options.levle=5"], r"task\.options: .*levle"),
    ],
)
def test_responses_must_fit_the_positions_the_prompts_leave(overrides: list[str], pattern: str) -> None:
    _refused(overrides, pattern)


def test_room_for_responses_that_fits_passes() -> None:
    load_config(EXAMPLE, ["rollout.max_new_tokens=57"])
    load_config(EXAMPLE, ["rollout.vllm.max_model_len=32", "rollout.max_new_tokens=25"])
    load_config(EXAMPLE, ["rollout.engine=torch", "rollout.vllm.max_model_len=32", "rollout.max_new_tokens=57"])
    load_config(EXAMPLE, ["eval.max_new_tokens=58"])  # no evaluation


def test_a_data_files_prompts_need_at_least_one_position() -> None:
    """A data file's prompt lengths are known once tokenized (the run skips those too long); the config
    only knows a prompt has a token."""
    model = ["model.embedded_default=false", "model.architecture.max_sequence_length=16", "task.kind=qa",
             "task.options.path=/data/qa.jsonl", "rollout.engine=torch"]
    _refused([*model, "rollout.max_new_tokens=16"],
             r"rollout\.max_new_tokens=16 leaves no position for a prompt: .* 16 positions "
             r"\(model\.architecture\.max_sequence_length = 16\); set rollout\.max_new_tokens <= 15")
    load_config(EXAMPLE, [*model, "rollout.max_new_tokens=15"])


LAYOUT = ["trainer_world_size=4", "parallel.tensor_parallel=2", "parallel.expert_parallel=2",
          "parallel.sequence_parallel=true", "rollout.engine=torch"]


def test_a_layout_gloo_cannot_gather_is_refused_on_cpu_trainer_ranks() -> None:
    _refused(LAYOUT, r"parallel\.expert_parallel=2 with expert tensor parallel 2 .* cannot run on gloo \(CPU trainer "
                     r"ranks\): .* set parallel\.expert_tensor_parallel=1, or model\.architecture\.moe_token_dispatcher="
                     r"allgather, or run the trainer on GPUs")
    load_config(EXAMPLE, [*LAYOUT, "parallel.expert_tensor_parallel=1"])
    load_config(EXAMPLE, [*LAYOUT, "placement.trainer_gpus_per_worker=1"])  # NCCL gathers unequal parts
    load_config(EXAMPLE, ["trainer_world_size=2", "parallel.tensor_parallel=2", "rollout.engine=torch"])  # EP 1
    allgather = ["model.embedded_default=false", "model.architecture.moe_token_dispatcher=allgather",
                 "model.architecture.max_sequence_length=64"]
    load_config(EXAMPLE, [*LAYOUT, *allgather])


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["grpo.prompts_per_step=1", "grpo.responses_per_prompt=3"],
         r"= 3 sequences in grpo\.mini_batches=1 update\(s\) give an update 3 sequence\(s\), fewer than the 4 "
         r"data-parallel trainer replicas .* at least 4, lower grpo\.mini_batches"),
        (["grpo.prompts_per_step=2", "grpo.responses_per_prompt=4", "grpo.mini_batches=3"],
         r"give an update 2 sequence\(s\), fewer than the 4 .* at least 12"),
    ],
)
def test_every_data_parallel_replica_needs_a_sequence_of_every_update(overrides: list[str], pattern: str) -> None:
    _refused(["trainer_world_size=4", "rollout.engine=torch", *overrides], pattern)


def test_updates_the_replicas_do_not_divide_pass() -> None:
    load_config(EXAMPLE, ["trainer_world_size=4", "rollout.engine=torch", "grpo.prompts_per_step=2",
                          "grpo.responses_per_prompt=3"])  # 6 sequences over 4 replicas: 2, 2, 1, 1
    load_config(EXAMPLE, ["trainer_world_size=4", "parallel.tensor_parallel=2", "rollout.engine=torch",
                          "grpo.prompts_per_step=1", "grpo.responses_per_prompt=2"])  # 2 replicas


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["grpo.prompts_per_step=3", "grpo.responses_per_prompt=3"],
         r"= 9 sequences do not split into grpo\.mini_batches=1 update\(s\) of equal shares for the 2 data-parallel "
         r"ranks: .* multiple of 2"),
        (["grpo.prompts_per_step=4", "grpo.responses_per_prompt=4", "grpo.mini_batches=3"], r"multiple of 6"),
    ],
)
def test_expert_parallel_ranks_need_equal_shares_of_every_update(overrides: list[str], pattern: str) -> None:
    _refused(["trainer_world_size=2", "parallel.expert_parallel=2", *overrides], pattern)


def test_equal_shares_or_one_replica_per_expert_group_pass() -> None:
    load_config(EXAMPLE, ["trainer_world_size=2", "parallel.expert_parallel=2", "grpo.prompts_per_step=3",
                          "grpo.responses_per_prompt=4", "grpo.mini_batches=3"])
    # TP 2 x EP 2 at expert-TP 1 on two ranks: each expert group is one replica's TP ranks, which share the batch
    load_config(EXAMPLE, ["trainer_world_size=2", "parallel.tensor_parallel=2", "parallel.expert_parallel=2",
                          "parallel.expert_tensor_parallel=1", "grpo.prompts_per_step=3", "grpo.responses_per_prompt=3"])


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["eval.every=2", "task.kind=qa", "task.options.path=/data/qa.jsonl"],
         r"eval\.every=2 needs held-out problems, and task kind 'qa' has no held-out split: set task\.eval_options\.path"),
        (["eval.every=2", "task.kind=gsm8k", "task.options.path=/data/train.jsonl", "task.eval_options.limit=8"],
         r"task\.eval_options has no path: .* set task\.eval_options\.path"),
    ],
)
def test_evaluation_without_held_out_problems_is_refused(overrides: list[str], pattern: str) -> None:
    _refused(overrides, pattern)


def test_evaluation_with_held_out_problems_passes() -> None:
    load_config(EXAMPLE, ["eval.every=2"])  # the embedded default's eval split
    load_config(EXAMPLE, ["eval.every=2", "task.kind=arithmetic"])  # arithmetic's eval split
    load_config(EXAMPLE, ["eval.every=2", "task.kind=qa", "task.options.path=/data/qa.jsonl",
                          "task.eval_options.path=/data/test.jsonl"])
    load_config(EXAMPLE, ["task.kind=qa", "task.options.path=/data/qa.jsonl"])  # no evaluation


SMALL_HEADS = ["model.embedded_default=false", "model.architecture.hidden_size=64",
               "model.architecture.num_attention_heads=4"]  # head dim 16


def test_a_head_dim_vllm_on_cpu_cannot_serve_is_refused() -> None:
    _refused([*SMALL_HEADS, "rollout.engine=vllm"],
             r"rollout\.engine=vllm on CPU cannot serve the model's head dim 16 \(model\.architecture\): vLLM's CPU "
             r"attention takes head dims 32, 64, 80, .* use rollout\.engine=torch")
    _refused(["model.embedded_default=false", "model.architecture.kv_channels=15", "rollout.engine=torch"],
             r"the model's head dim is 15 \(model\.architecture\): rotary embeddings need an even head dim")


def test_head_dims_the_engine_serves_pass() -> None:
    load_config(EXAMPLE, [*SMALL_HEADS, "rollout.engine=torch"])  # the built-in engine: any even head dim
    load_config(EXAMPLE, ["model.embedded_default=false", "model.architecture.kv_channels=80", "rollout.engine=vllm"])
    load_config(EXAMPLE, [*SMALL_HEADS, "rollout.engine=vllm", "rollout.num_gpus_per_worker=1"])  # not vLLM's CPU backend
