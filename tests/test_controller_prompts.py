"""The prompts a GRPO step sends: those too long for the model's positions skipped and counted (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_quads.controller.config import load_config
from megatron_quads.controller.prompts import PromptLimit, PromptsTooLong, draw_prompts, prompt_limit, select_prompts
from megatron_quads.tasks import CharTokenizer, DatasetStream, Prompt

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"
TOK = CharTokenizer()
LIMIT = PromptLimit(5, "a test's positions")
"""Five tokens: ``<bos>`` and four characters."""


def _stream(texts: list[str]) -> DatasetStream:
    return DatasetStream("test", 0, [Prompt(str(i), text, "0") for i, text in enumerate(texts)])


def test_too_long_prompts_are_skipped_counted_and_passed_for_good() -> None:
    stream = _stream(["1+2=", "11+22=", "3+4=", "5+6=", "111+222="])
    batch = draw_prompts(stream, TOK, 3, LIMIT)
    assert all(len(ids) <= 5 and ids[0] == TOK.bos_id for ids in batch.ids)
    assert {p.text for p in batch.prompts} == {"1+2=", "3+4=", "5+6="}
    assert batch.skipped == stream.position - 3 and batch.skipped <= 2
    resumed = _stream(["1+2=", "11+22=", "3+4=", "5+6=", "111+222="])
    resumed.load_state_dict(stream.state_dict())  # a resumed run draws on after the skipped ones too
    assert [p.text for p in draw_prompts(resumed, TOK, 2, LIMIT).prompts] == \
        [p.text for p in draw_prompts(stream, TOK, 2, LIMIT).prompts]


def test_a_task_without_a_prompt_that_fits_stops_the_run() -> None:
    stream = _stream(["11+22=", "33+44="])
    with pytest.raises(PromptsTooLong, match=r"the last 4 drawn were all longer than 5 tokens \(a test's positions\)"):
        draw_prompts(stream, TOK, 1, LIMIT)
    with pytest.raises(PromptsTooLong, match="none of the 2 prompts fits"):
        select_prompts(list(_stream(["11+22=", "33+44="]).next_batch(2)), TOK, LIMIT)


def test_held_out_problems_are_selected_once_each() -> None:
    problems = [Prompt("a", "1+2=", "3"), Prompt("b", "11+22=", "33"), Prompt("c", "3+4=", "7")]
    kept = select_prompts(problems, TOK, LIMIT)
    assert [p.id for p in kept.prompts] == ["a", "c"] and kept.skipped == 1
    assert select_prompts(problems, TOK, None).skipped == 0


def test_the_limit_is_the_positions_left_after_max_new_tokens() -> None:
    limit = prompt_limit(load_config(EXAMPLE, ["rollout.max_new_tokens=5"]))
    assert limit == PromptLimit(59, "the embedded model's max_sequence_length = 64, minus rollout.max_new_tokens = 5")
    vllm = prompt_limit(load_config(EXAMPLE, ["rollout.vllm.max_model_len=32", "eval.every=1", "eval.max_new_tokens=8"]),
                        evaluation=True)
    assert vllm == PromptLimit(24, "rollout.vllm.max_model_len = 32, minus eval.max_new_tokens = 8")
