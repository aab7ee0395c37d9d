"""The chain task (worked solutions, reward, lengths, held-out split) and tools/sft.py on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_quads.tasks import ChainConfig, ChainTask, CharTokenizer, RewardReason, make_task
from megatron_quads.tasks.arithmetic_chain import apply_step, parse_chain

ROOT = Path(__file__).resolve().parents[1]


def _check_worked_solution(prompt_text: str, target: str, answer: int) -> None:
    """Every line applies its step to the previous line's value; the last value is the answer."""
    start, steps = parse_chain(prompt_text)
    assert target.endswith(";")
    *lines, final = target[:-1].split(" ")
    assert final == f"({answer})"
    assert len(lines) == len(steps)
    value = start
    for line, (op, operand) in zip(lines, steps, strict=True):
        assert line == f"{value}{op}{operand}={apply_step(value, op, operand)}"
        value = apply_step(value, op, operand)
    assert value == answer


def _direct(prompt_text: str) -> int:
    """The chain evaluated left to right with Python's own operators (bracketing every step)."""
    start, steps = parse_chain(prompt_text)
    expression = str(start)
    for op, operand in steps:
        expression = f"({expression}{op}{operand})"
    return eval(expression)  # noqa: S307 -- digits, operators and brackets only


def test_the_worked_solution_is_right() -> None:
    task = ChainTask(ChainConfig(min_steps=1, max_steps=30))
    for prompt in task.sample_prompts(200, seed=5):
        assert int(prompt.answer) == _direct(prompt.text)
        _check_worked_solution(prompt.text, task.target(prompt), int(prompt.answer))


def test_forked_targets_write_commutative_steps_in_either_order_and_score_as_right() -> None:
    task = make_task("chain", min_steps=8, max_steps=30, forks=True)
    plain = ChainTask(ChainConfig(min_steps=8, max_steps=30))
    swapped = commutative = 0
    for prompt in task.sample_prompts(200, seed=3):
        target = task.target(prompt)
        assert target == task.target(prompt)  # the same prompt id, the same choices
        assert task.score(prompt, target).reward == 1.0
        start, steps = parse_chain(prompt.text)
        value = start
        for line, (op, operand) in zip(target[:-1].split(" ")[:-1], steps, strict=True):
            result = apply_step(value, op, operand)
            forms = {f"{value}{op}{operand}={result}", f"{operand}{op}{value}={result}"} if op in "+*" else \
                {f"{value}{op}{operand}={result}"}
            assert line in forms, (line, forms)
            if op in "+*" and value != operand:
                commutative += 1
                swapped += line.startswith(f"{operand}{op}")
            value = result
        assert len(target) == len(plain.target(prompt))
    assert 0.4 < swapped / commutative < 0.6, (swapped, commutative)


def test_values_stay_in_range_and_text_fits_the_character_tokenizer() -> None:
    cfg = ChainConfig(min_steps=40, max_steps=40, max_value=50)
    task, tok = ChainTask(cfg), CharTokenizer()
    for prompt in task.sample_prompts(50, seed=1):
        text = prompt.text + task.target(prompt)
        assert set(text) <= set(tok.alphabet)
        assert tok.decode(tok.encode(text)) == text
        values = [int(line.split("=")[1]) for line in task.target(prompt)[:-1].split(" ")[:-1]]
        assert all(0 <= v <= 50 for v in values)


def test_score_accepts_the_target_and_rejects_wrong_and_malformed() -> None:
    task = ChainTask()
    prompt = task.sample_prompts(1, seed=2)[0]
    target = task.target(prompt)
    assert task.score(prompt, target).reward == 1.0
    assert task.score(prompt, target + "junk after the marker").reward == 1.0
    wrong = target.rsplit("(", 1)[0] + f"({int(prompt.answer) + 1});"
    assert task.score(prompt, wrong).reason is RewardReason.WRONG and task.reward(prompt, wrong) == 0.0
    for malformed in (target[:-1], target.rsplit(" ", 1)[0] + ";", f"{prompt.answer};", "(1 2);"):
        assert task.score(prompt, malformed).reason is RewardReason.MALFORMED
        assert task.reward(prompt, malformed) == 0.0
    assert task.score(prompt, "").reason is RewardReason.EMPTY


def test_lengths_scale_with_steps() -> None:
    tok = CharTokenizer()
    means = {}
    for steps in (5, 10, 40):
        task = make_task("chain", min_steps=steps, max_steps=steps)
        pairs = task.sft_pairs(50, seed=0)
        lengths = [len(tok.encode(c)) for _, c in pairs]
        assert max(lengths) <= task.config.max_answer_len
        assert max(len(p) for p, _ in pairs) <= task.config.max_prompt_len
        means[steps] = sum(lengths) / len(lengths)
    assert means[5] < means[10] < means[40]
    assert means[40] > 200  # hundreds of tokens at 40 steps


def test_held_out_split_is_disjoint_and_streams_resume() -> None:
    train = ChainTask(ChainConfig(min_steps=2, max_steps=2, split="train", eval_fraction=0.2))
    held_out = ChainTask(ChainConfig(min_steps=2, max_steps=2, split="eval", eval_fraction=0.2))
    train_texts = {p.text for p in train.sample_prompts(2000, seed=0)}
    eval_texts = {p.text for p in held_out.sample_prompts(300, seed=0)}
    assert eval_texts and not train_texts & eval_texts
    stream = train.stream(seed=3)
    stream.next_batch(5)
    state = json.loads(json.dumps(stream.state_dict()))
    expected = stream.next_batch(3)
    resumed = train.stream(seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(3) == expected


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        ChainConfig(min_steps=0)
    with pytest.raises(ValueError, match="operators"):
        ChainConfig(operators="+")
    with pytest.raises(ValueError, match="unknown task kind"):
        make_task("chains")


TINY = ["num_layers=1", "hidden_size=32", "num_attention_heads=2", "num_experts=2", "moe_router_topk=2",
        "moe_ffn_hidden_size=16", "ffn_hidden_size=32", "max_sequence_length=64", "dtype=fp32"]


def test_sft_tool_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path) -> None:
    out = tmp_path / "sft"
    command = [sys.executable, str(ROOT / "tools" / "sft.py"), "--out", str(out), "--task", "chain",
               "--steps", "30", "--batch", "16", "--lr", "1e-2", "--eval-every", "0", "--eval-problems", "10"]
    command += [a for kv in TINY for a in ("--set", kv)]
    task_options = ("min_steps=2", "max_steps=2", "max_operand=5", "max_value=20")
    command += [a for kv in task_options for a in ("--task-option", kv)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = sum(r["nll"] for r in records[:5]) / 5, sum(r["nll"] for r in records[-5:]) / 5
    assert last < 0.8 * first
    assert "heldout_greedy_accuracy" in records[-1]

    from megatron.core import dist_checkpointing

    from megatron_quads import manifest
    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import ParallelConfig, build_gpt_model
    from megatron_quads.trainer.settings import load_model_config

    checkpoint = out / "checkpoint"
    recorded = manifest.verify_manifest(checkpoint)
    assert recorded["task"] == {"kind": "chain", "options": {"min_steps": 2, "max_steps": 2, "max_operand": 5,
                                                             "max_value": 20}}
    cfg = load_model_config(checkpoint)
    assert cfg is not None and cfg.num_layers == 1 and cfg.hidden_size == 32
    init_trainer_distributed(1, 0, ParallelConfig())
    model = build_gpt_model(cfg, ParallelConfig())
    fresh = {k: v.clone() for k, v in model.state_dict().items() if hasattr(v, "clone")}
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint))["model"])
    loaded = model.state_dict()
    assert any(not v.equal(loaded[k]) for k, v in fresh.items() if v.is_floating_point())


def _sft(out, *extra: str, steps: int = 8) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "tools" / "sft.py"), "--out", str(out), "--task", "chain",
               "--steps", str(steps), "--batch", "16", "--lr", "1e-2", "--eval-every", "0", "--eval-problems", "4",
               *extra]
    command += [a for kv in TINY for a in ("--set", kv)]
    command += [a for kv in ("min_steps=2", "max_steps=2", "max_operand=5", "max_value=20") for a in ("--task-option", kv)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=300, env=env)


def test_sft_tool_follows_a_cosine_schedule_and_continues_from_a_checkpoint(tmp_path) -> None:
    from megatron_quads import manifest

    first = _sft(tmp_path / "a", "--schedule", "cosine", "--warmup", "2", "--min-lr", "1e-3", "--save-every", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records]
    assert lrs[:2] == pytest.approx([5e-3, 1e-2]) and lrs[-1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # falls after the warm-up
    recorded = manifest.verify_manifest(tmp_path / "a" / "checkpoint")
    assert recorded["steps_done"] == recorded["steps"] == 8 and recorded["finished"]
    assert recorded["schedule"]["kind"] == "cosine"

    resumed = _sft(tmp_path / "b", "--init", str(tmp_path / "a" / "checkpoint"), steps=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert again[0]["nll"] < 0.9 * records[0]["nll"]  # starts from the trained weights, not from scratch
    assert manifest.verify_manifest(tmp_path / "b" / "checkpoint")["init"] == str(tmp_path / "a" / "checkpoint")


def test_sft_tool_ends_at_the_first_evaluation_that_reaches_the_asked_accuracy(tmp_path, monkeypatch) -> None:
    """--stop-at-accuracy: the run saves and ends at the evaluation that first reaches it, marked finished."""
    import importlib.util

    from megatron_quads import manifest

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("sft_under_test", ROOT / "tools" / "sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    measured = iter([0.2, 0.6, 0.9])  # the evaluations' accuracies, in order
    monkeypatch.setattr(sft.embedded, "greedy_accuracy", lambda *args, **kwargs: next(measured))
    argv = ["sft.py", "--out", str(tmp_path / "a"), "--task", "chain", "--steps", "20", "--batch", "4",
            "--eval-every", "2", "--stop-at-accuracy", "0.5", "--save-every", "1"]
    argv += [a for kv in TINY for a in ("--set", kv)]
    argv += [a for kv in ("min_steps=2", "max_steps=2", "max_operand=5", "max_value=20") for a in ("--task-option", kv)]
    monkeypatch.setattr(sys, "argv", argv)
    sft.main()

    recorded = manifest.verify_manifest(tmp_path / "a" / "checkpoint")
    assert (recorded["steps_done"], recorded["steps"], recorded["finished"]) == (4, 20, True)
    assert recorded["heldout_greedy_accuracy"] == 0.6 and recorded["stop_at_accuracy"] == 0.5
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("heldout_greedy_accuracy") for r in records] == [None, 0.2, None, 0.6]


def test_sft_tool_refuses_an_accuracy_target_it_would_never_check(tmp_path) -> None:
    never = _sft(tmp_path / "a", "--stop-at-accuracy", "0.5")  # --eval-every 0
    assert never.returncode != 0 and "--eval-every" in never.stderr and not (tmp_path / "a").exists()
    beyond = _sft(tmp_path / "b", "--stop-at-accuracy", "1.5", "--eval-every", "2")
    assert beyond.returncode != 0 and "(0, 1]" in beyond.stderr and not (tmp_path / "b").exists()


def test_sft_tool_refuses_an_init_checkpoint_of_another_architecture(tmp_path) -> None:
    first = _sft(tmp_path / "a", steps=1)
    assert first.returncode == 0, first.stderr[-3000:]
    other = _sft(tmp_path / "b", "--init", str(tmp_path / "a" / "checkpoint"), "--set", "num_query_groups=1", steps=1)
    assert other.returncode != 0 and "num_query_groups" in other.stderr and "--init" in other.stderr
    assert not (tmp_path / "b").exists()
    missing = _sft(tmp_path / "c", "--init", str(tmp_path / "nowhere"), steps=1)
    assert missing.returncode != 0 and "metadata.json" in missing.stderr


def test_sft_tool_refuses_a_model_too_short_for_the_task(tmp_path) -> None:
    command = [sys.executable, str(ROOT / "tools" / "sft.py"), "--out", str(tmp_path / "x"), "--task", "chain",
               "--task-option", "max_steps=40", "--task-option", "min_steps=40"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120, env=env)
    assert result.returncode != 0 and "max_sequence_length" in result.stderr
    assert not (tmp_path / "x").exists()


def test_a_run_config_takes_the_chain_kind_and_bounds_its_prompt() -> None:
    from megatron_quads.controller.config import ConfigError, load_config
    from megatron_quads.controller.evaluation import eval_task

    example = ROOT / "examples" / "embedded_default.yaml"
    # 3 steps of one-digit operands: "9 +9 +9 +9 =" is 12 characters, plus <bos>
    chain = ["task.kind=chain", "task.options.max_steps=3", "task.options.min_steps=3"]
    cfg = load_config(example, [*chain, "rollout.max_new_tokens=51"])
    held_out = eval_task(cfg)
    assert isinstance(held_out, ChainTask) and held_out.config.split == "eval"
    with pytest.raises(ConfigError, match=r"longest prompt \(13 tokens\) needs 65 positions"):
        load_config(example, [*chain, "rollout.max_new_tokens=52"])


@pytest.mark.parametrize(("model_file", "config_file", "experts"), [
    ("chain_moe_model.yaml", "chain_grpo_gpu.yaml", 64), ("chain_moe_small.yaml", "chain_grpo_gpu_small.yaml", 32)])
def test_the_gpu_collapse_example_fits_its_task_and_validates(tmp_path, model_file: str, config_file: str,
                                                             experts: int) -> None:
    """examples/collapse: each model file fits the chain task of its GRPO config (prompt and the
    longest worked chain within its positions), and the config validates against a checkpoint of it."""
    import yaml

    from megatron_quads.controller.config import load_config
    from megatron_quads.trainer.model import PolicyModelConfig
    from megatron_quads.trainer.settings import save_model_config

    folder = ROOT / "examples" / "collapse"
    model = PolicyModelConfig(**yaml.safe_load((folder / model_file).read_text()))
    assert model.num_experts == experts and model.num_layers == 8
    save_model_config(model, tmp_path)
    cfg = load_config(folder / config_file, [f"model.checkpoint={tmp_path}"])
    chain = ChainConfig(**cfg.task.options)
    assert cfg.task.kind == "chain" and chain.max_answer_len + 1 <= cfg.rollout.max_new_tokens  # the chain and <eos>
    assert chain.max_prompt_len + 1 + cfg.rollout.max_new_tokens <= model.max_sequence_length  # <bos> first
