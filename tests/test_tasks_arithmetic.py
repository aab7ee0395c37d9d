"""Synthetic arithmetic task: format, determinism, difficulty knobs, rewards, SFT pairs, streams."""

from __future__ import annotations

import json
import random
import re

import pytest

from megatron_quads.tasks import (
    ARITHMETIC_LEVELS,
    ArithmeticConfig,
    ArithmeticTask,
    CharTokenizer,
    Prompt,
    RewardReason,
    encode_sft_pair,
    evaluate,
    make_task,
)

PROMPT_RE = re.compile(r"^\d+([+\-*]\d+)*=$")


def _prompt(answer: int) -> Prompt:
    return Prompt(id="t", text="x=", answer=str(answer))


@pytest.mark.parametrize(
    ("response", "reward", "reason", "parsed"),
    [
        ("19;", 1.0, RewardReason.CORRECT, "19"),
        ("19;;junk", 1.0, RewardReason.CORRECT, "19"),  # only the text before the first marker counts
        (" 19 ;", 1.0, RewardReason.CORRECT, "19"),
        ("18;", 0.0, RewardReason.WRONG, "18"),
        ("-19;", 0.0, RewardReason.WRONG, "-19"),
        ("1+9;", 0.0, RewardReason.MALFORMED, None),
        ("abc;", 0.0, RewardReason.MALFORMED, None),
        ("19", 0.0, RewardReason.MALFORMED, "19"),  # no end marker
        ("", 0.0, RewardReason.EMPTY, None),
        ("   ", 0.0, RewardReason.EMPTY, None),
        (";19", 0.0, RewardReason.EMPTY, None),
    ],
)
def test_reward_cases(response: str, reward: float, reason: RewardReason, parsed: str | None) -> None:
    task = ArithmeticTask()
    result = task.score(_prompt(19), response)
    assert (result.reward, result.reason, result.parsed) == (reward, reason, parsed)
    assert task.reward(_prompt(19), response) == reward
    assert result.correct == (reason is RewardReason.CORRECT)


def test_negative_answer_and_format_reward_and_optional_marker() -> None:
    assert ArithmeticTask().score(_prompt(-4), "-4;").reason is RewardReason.CORRECT
    shaped = ArithmeticTask(ArithmeticConfig(format_reward=0.1))
    assert shaped.reward(_prompt(19), "18;") == pytest.approx(0.1)
    assert shaped.reward(_prompt(19), "19;") == 1.0
    assert shaped.reward(_prompt(19), "x;") == 0.0
    lenient = ArithmeticTask(ArithmeticConfig(require_end_marker=False))
    assert lenient.score(_prompt(19), "19").reason is RewardReason.CORRECT


def test_prompts_are_deterministic_in_the_seed() -> None:
    task = ArithmeticTask(ArithmeticConfig.level(3))
    a = task.sample_prompts(50, seed=7)
    assert a == task.sample_prompts(50, seed=7)
    assert [p.text for p in a] != [p.text for p in task.sample_prompts(50, seed=8)]
    assert len({p.id for p in a}) == 50
    # a random.Random draws the seed: same generator state, same prompts
    assert task.sample_prompts(5, random.Random(3)) == task.sample_prompts(5, random.Random(3))
    # pinned values: the format and the generator must not drift silently
    first = [(p.text, p.answer) for p in ArithmeticTask(ArithmeticConfig.level(1)).sample_prompts(3, seed=1)]
    assert first == [("36+7=", "43"), ("87-7=", "80"), ("5+0=", "5")]


@pytest.mark.parametrize("level", sorted(ARITHMETIC_LEVELS))
def test_levels_respect_their_knobs(level: int) -> None:
    cfg = ArithmeticConfig.level(level)
    task = ArithmeticTask(cfg)
    for p in task.sample_prompts(200, seed=level):
        assert PROMPT_RE.match(p.text), p.text
        assert len(p.text) <= cfg.max_prompt_len <= 16
        operands = [int(x) for x in re.split(r"[+\-*]", p.text[:-1])]
        operators = re.findall(r"[+\-*]", p.text)
        assert cfg.min_operands <= len(operands) <= cfg.max_operands
        assert all(cfg.min_digits <= len(str(o)) <= cfg.max_digits for o in operands)
        assert set(operators) <= set(cfg.operators)
        assert int(p.answer) == evaluate(operands, operators) >= 0
        assert len(task.target(p)) <= cfg.max_answer_len
        assert task.reward(p, task.target(p)) == 1.0


def test_precedence_and_negative_results() -> None:
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([10, 3, 2], ["-", "-"]) == 5
    task = ArithmeticTask(ArithmeticConfig(operators="-", allow_negative=True))
    assert any(int(p.answer) < 0 for p in task.sample_prompts(100, seed=0))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_prompt_chars"):
        ArithmeticConfig(max_operands=4, max_digits=4)  # 20 characters
    with pytest.raises(ValueError, match="operators"):
        ArithmeticConfig(operators="+/")
    with pytest.raises(ValueError, match="end_marker"):
        ArithmeticConfig(end_marker="=")
    with pytest.raises(ValueError, match="level"):
        ArithmeticConfig.level(99)


def test_train_and_eval_splits_are_disjoint() -> None:
    train = ArithmeticTask(ArithmeticConfig.level(1, split="train"))
    held = ArithmeticTask(ArithmeticConfig.level(1, split="eval"))
    train_texts = {p.text for p in train.sample_prompts(2000, seed=0)}
    eval_texts = {p.text for p in held.sample_prompts(300, seed=0)}
    assert eval_texts and not train_texts & eval_texts


def test_sft_pairs_and_tokens() -> None:
    task = ArithmeticTask(ArithmeticConfig.level(4))
    pairs = task.sft_pairs(20, seed=3)
    assert pairs == [(p.text, p.answer + ";") for p in task.sample_prompts(20, seed=3)]
    it = task.iter_sft_pairs(seed=3)
    assert [next(it) for _ in range(20)] == pairs
    tok = CharTokenizer()
    ids, mask = encode_sft_pair(tok, "12+7=", "19;")
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>12+7=19;<eos>"
    assert mask == [0] * 6 + [1] * 4


def test_stream_resumes_at_the_same_prompt() -> None:
    task = ArithmeticTask(ArithmeticConfig.level(2))
    stream = task.stream(seed=11)
    stream.next_batch(37)
    state = json.loads(json.dumps(stream.state_dict()))  # survives a JSON round trip
    expected = stream.next_batch(25)

    resumed = task.stream(seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    assert resumed.position == 37
    assert resumed.next_batch(25) == expected
    assert expected[0].id == "arithmetic/s11/37"
    # the stream's first prompts are sample_prompts' prompts
    assert task.stream(seed=11).next_batch(5) == task.sample_prompts(5, seed=11)


def test_stream_state_refuses_another_task() -> None:
    state = ArithmeticTask(ArithmeticConfig.level(1)).stream(0).state_dict()
    other = ArithmeticTask(ArithmeticConfig.level(2)).stream(0)
    with pytest.raises(ValueError, match="different task settings"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)


def test_make_task() -> None:
    task = make_task("arithmetic", level=0, max_digits=2)
    assert isinstance(task, ArithmeticTask) and task.config.max_digits == 2 and task.config.operators == "+"
    with pytest.raises(ValueError, match="unknown task kind"):
        make_task("chess")
    with pytest.raises(ValueError, match="needs path"):
        make_task("gsm8k")
