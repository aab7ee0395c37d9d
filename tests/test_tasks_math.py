"""GSM8K / MATH style tasks: loading, ground-truth extraction, data errors, math-verify rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_quads.tasks import (
    DatasetStream,
    MathTask,
    Prompt,
    RewardReason,
    TaskDataError,
    TaskDataFileNotFoundError,
    extract_ground_truth,
    last_boxed,
    load_math_prompts,
    make_task,
)

pytest.importorskip("math_verify")

DATA = Path(__file__).parent / "data" / "tasks"


@pytest.fixture(scope="module")
def gsm8k() -> MathTask:
    return MathTask.gsm8k(DATA / "gsm8k_mini.jsonl")


@pytest.fixture(scope="module")
def math_task() -> MathTask:
    return MathTask.math(DATA / "math_mini.jsonl", id_field="unique_id")


def test_gsm8k_ground_truth_and_prompts(gsm8k: MathTask) -> None:
    assert [p.answer for p in gsm8k.prompts] == ["72", "10", "1500", "0.5"]  # blank line skipped, commas gone
    first = gsm8k.prompts[0]
    assert first.id == "gsm8k_mini/0"
    assert first.text.startswith("Natalia sold clips") and first.text.endswith("within \\boxed{}.")
    assert first.metadata["source"].endswith("gsm8k_mini.jsonl, line 1")


def test_math_ground_truth(math_task: MathTask) -> None:
    assert [p.answer for p in math_task.prompts] == ["\\frac{1}{2}", "\\sqrt{2}", "6"]
    assert [p.id for p in math_task.prompts] == ["algebra/1", "geometry/7", "counting/3"]


def test_extraction_helpers() -> None:
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}} c") == "\\frac{a}{b^{2}}"
    assert last_boxed("so \\boxed 5$.") == "5"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None
    assert extract_ground_truth("work\n#### 1,234") == "1234"
    assert extract_ground_truth("\\boxed{x+1}") == "x+1"
    assert extract_ground_truth(" 42 ", "raw") == "42"
    assert extract_ground_truth("no marker", "gsm8k") is None


@pytest.mark.parametrize(
    ("index", "response", "reason"),
    [
        (0, "48 + 24 = 72 clips.\n#### 72", RewardReason.CORRECT),
        (0, "So the answer is $\\boxed{72}$.", RewardReason.CORRECT),
        (0, "First 71, then I fixed it: 72", RewardReason.CORRECT),  # the last number counts
        (0, "The answer is \\boxed{72}, not 80", RewardReason.CORRECT),  # \boxed{} beats later numbers
        (0, "The answer is 73.", RewardReason.WRONG),
        (0, "\\boxed{24} then 72", RewardReason.WRONG),
        (2, "She has \\boxed{1,500} apples", RewardReason.CORRECT),
        (3, "1/2", RewardReason.CORRECT),
        (3, "$\\frac{1}{2}$", RewardReason.CORRECT),
        (3, "\\boxed{\\dfrac{1}{2}}", RewardReason.CORRECT),
        (3, "\\boxed{0.25}", RewardReason.WRONG),
        (0, "I do not know.", RewardReason.MALFORMED),
        (0, "", RewardReason.EMPTY),
        (0, " \n\t", RewardReason.EMPTY),
    ],
)
def test_gsm8k_rewards(gsm8k: MathTask, index: int, response: str, reason: RewardReason) -> None:
    result = gsm8k.score(gsm8k.prompts[index], response)
    assert result.reason is reason, result
    assert result.reward == (1.0 if reason is RewardReason.CORRECT else 0.0)
    assert (result.parsed is None) == (reason in (RewardReason.MALFORMED, RewardReason.EMPTY))


def test_math_rewards_use_equivalence(math_task: MathTask) -> None:
    half, root2, six = math_task.prompts
    assert math_task.reward(half, "so it is $\\boxed{0.5}$") == 1.0
    assert math_task.reward(half, "so it is \\boxed{2/4}") == 1.0
    assert math_task.reward(half, "so it is \\boxed{1/3}") == 0.0
    assert math_task.reward(root2, "length $\\boxed{\\sqrt 2}$") == 1.0
    assert math_task.reward(root2, "length $\\boxed{2^{1/2}}$") == 1.0
    assert math_task.reward(root2, "length $\\boxed{2}$") == 0.0
    assert math_task.reward(six, "3! = \\boxed{6}") == 1.0
    # any Prompt works, e.g. one the caller built
    assert math_task.reward(Prompt(id="x", text="?", answer="0.5"), "\\frac{1}{2}") == 1.0


def test_dataset_stream_epochs_and_resume(math_task: MathTask) -> None:
    stream = math_task.stream(seed=5)
    assert isinstance(stream, DatasetStream)
    first_epoch = stream.next_batch(3)
    assert sorted(p.id for p in first_epoch) == sorted(p.id for p in math_task.prompts)
    stream.next_batch(2)  # into epoch 1
    state = json.loads(json.dumps(stream.state_dict()))
    assert (state["epoch"], state["index"], state["position"]) == (1, 2, 5)
    expected = stream.next_batch(7)
    resumed = math_task.stream(seed=0)
    resumed.load_state_dict(state)
    assert resumed.next_batch(7) == expected
    assert math_task.sample_prompts(3, seed=5) == first_epoch


def test_dataset_stream_refuses_other_data(math_task: MathTask, gsm8k: MathTask) -> None:
    with pytest.raises(ValueError, match="same data file"):
        gsm8k.stream(0).load_state_dict(math_task.stream(0).state_dict())


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(TaskDataFileNotFoundError, match="train.jsonl") as info:
        MathTask.gsm8k(missing)
    assert isinstance(info.value, FileNotFoundError) and "does not exist" in str(info.value)


def test_invalid_jsonl_names_file_and_line() -> None:
    with pytest.raises(TaskDataError, match=r"not_jsonl\.jsonl, line 2: not valid JSON"):
        MathTask.gsm8k(DATA / "not_jsonl.jsonl")


def test_missing_field_names_file_line_and_field() -> None:
    with pytest.raises(TaskDataError) as info:
        MathTask.gsm8k(DATA / "missing_field.jsonl")
    msg = str(info.value)
    assert "missing_field.jsonl, line 2" in msg and "'answer' is missing" in msg
    assert "solution" in msg and "answer_field" in msg  # what is there and how to fix it


def test_missing_field_with_right_field_name(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    with pytest.raises(TaskDataError, match=r"field 'question' is missing \(fields present: \['a', 'q'\]\)"):
        load_math_prompts(path)
    task = make_task("qa", path=path, question_field="q", answer_field="a", prompt_template="Q: {question}\nA:")
    assert task.sample_prompts(1)[0].text == "Q: 1+1?\nA:"
    assert task.reward(task.prompts[0], "2") == 1.0


def test_answer_without_format_marker() -> None:
    with pytest.raises(TaskDataError, match="#### <number>"):
        MathTask.gsm8k(DATA / "no_gsm8k_marker.jsonl")


def test_json_and_bad_extensions(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [{"question": "q", "answer": "#### 3"}]}))
    assert [p.answer for p in load_math_prompts(path)] == ["3"]
    bad = tmp_path / "data.csv"
    bad.write_text("question,answer\n")
    with pytest.raises(TaskDataError, match="unknown file type '.csv'"):
        load_math_prompts(bad)
    with pytest.raises(TaskDataError, match="holds no records"):
        (tmp_path / "empty.jsonl").write_text("\n")
        load_math_prompts(tmp_path / "empty.jsonl")


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": ["What is 1/2 + 1/2?"], "solution": ["It is $\\boxed{1}$."]}), path)
    task = MathTask.math(path)
    assert task.prompts[0].answer == "1" and task.reward(task.prompts[0], "\\boxed{1.0}") == 1.0
    no_column = r"math\.parquet: no column 'question' \(columns: \['problem', 'solution'\]\)"
    with pytest.raises(TaskDataError, match=no_column):
        MathTask.gsm8k(path)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(TaskDataError, match=r"junk\.parquet: not a readable Parquet file"):
        MathTask.math(junk)


def test_scoring_off_the_main_thread(gsm8k: MathTask) -> None:
    """Ray and thread pools call rewards off the main thread, where signal-based timeouts cannot run."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(gsm8k.score, gsm8k.prompts[:2], ["\\boxed{72}", "\\boxed{11}"]))
    assert [r.reason for r in results] == [RewardReason.CORRECT, RewardReason.WRONG]
