"""The run's own reward function (``reward.path``, ``reward.name``): its return values, the row it sees,
the mistakes refused before Ray starts, an error inside it during a run, and a short run that logs its
extra metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_quads.cli import main
from megatron_quads.controller.custom_reward import (
    CustomReward,
    RewardFunctionError,
    RewardScore,
    mean_metrics,
    reward_score,
    row_fields,
)
from megatron_quads.tasks import MathTask, make_task

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"

REWARDS = '''
import math

def compute_score(prompt, response, row):
    return {"score": float(response.strip() == row["answer"]), "response_chars": len(response)}

def raises(prompt, response, row):
    return row["no_such_field"]

def returns_text(prompt, response, row):
    return "yes"

def returns_nan(prompt, response, row):
    return math.nan

def takes_two(prompt, response):
    return 1.0

not_a_function = 3
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARDS)
    return path


def test_a_reward_is_a_number_or_a_dict_with_a_score_and_numeric_metrics() -> None:
    assert reward_score(1) == RewardScore(1.0)
    assert reward_score(0.25) == RewardScore(0.25)
    assert reward_score(True) == RewardScore(1.0)
    assert reward_score({"score": 0.5, "length": 3, "format_ok": False}) == RewardScore(0.5, {"length": 3.0,
                                                                                              "format_ok": 0.0})
    for value, pattern in (("yes", r"returned 'yes' \(str\)"), (None, "returned None"),
                           (math.inf, "returned inf"), ({"reward": 1.0}, "without a 'score' key"),
                           ({"score": "1"}, "'score' is '1', not a finite number"),
                           ({"score": 1.0, "note": "ok"}, "extra metric 'note': 'ok'"),
                           ({"score": 1.0, 3: 1.0}, "extra metric 3")):
        with pytest.raises(TypeError, match=pattern):
            reward_score(value)


def test_extra_metrics_are_averaged_over_the_responses_that_return_them() -> None:
    scores = [RewardScore(1.0, {"a": 2.0, "b": 1.0}), RewardScore(0.0, {"a": 4.0}), RewardScore(0.0)]
    assert mean_metrics(scores) == {"reward/a": 3.0, "reward/b": 1.0}
    assert mean_metrics([RewardScore(1.0)]) == {}


def test_the_row_is_the_data_files_record_or_the_synthetic_prompts_id_and_answer(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "1+2=", "answer": "3", "difficulty": 2}) + "\n")
    prompt = MathTask.from_file(data, answer_format="raw").prompts[0]
    assert row_fields(prompt) == {"question": "1+2=", "answer": "3", "difficulty": 2}
    arithmetic = make_task("arithmetic").sample_prompts(1)[0]
    assert row_fields(arithmetic) == {"id": arithmetic.id, "answer": arithmetic.answer}


def test_an_error_inside_the_function_names_the_row_and_the_function(reward_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "What is " + "one plus " * 10 + "two?", "answer": "3"}) + "\n")
    prompt = MathTask.from_file(data, answer_format="raw").prompts[0]
    with pytest.raises(RewardFunctionError, match=r"reward function raises in .*my_reward\.py raised KeyError: "
                       r"'no_such_field' \(my_reward\.py:8\) on row .*qa\.jsonl, line 1 \(prompt '.*one plus.*\.\.\.'\)"):
        CustomReward.from_config(str(reward_file), "raises").score(prompt, "3")
    with pytest.raises(RewardFunctionError, match=r"returns_text .* returned 'yes' \(str\); .* on row .*line 1"):
        CustomReward.from_config(str(reward_file), "returns_text").score(prompt, "3")
    assert CustomReward.from_config(str(reward_file), "compute_score").score(prompt, " 3") == RewardScore(
        1.0, {"response_chars": 2.0})


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["reward.path={dir}/missing.py"], r"reward\.path .*missing\.py is not a file"),
        (["reward.path={dir}/broken.py"], r"reward\.path .*broken\.py failed to import: SyntaxError: .*\(broken\.py, line 1\); fix the file"),
        (["reward.path={dir}/my_reward.py", "reward.name=score"],
         r"reward\.name 'score': .* defines no such function \(its functions: \['compute_score', 'raises', "
         r"'returns_nan', 'returns_text', 'takes_two'\]\)"),
        (["reward.path={dir}/my_reward.py", "reward.name=not_a_function"], r"reward\.name 'not_a_function' .* is a int"),
        (["reward.path={dir}/my_reward.py", "reward.name=raises"],
         r"reward\.path / reward\.name: reward function raises .* raised KeyError: 'no_such_field' \(my_reward\.py:8\) "
         r"on row arithmetic/s0/0"),
        (["reward.path={dir}/my_reward.py", "reward.name=returns_nan"], r"reward\.path / reward\.name: .* returned nan"),
        (["reward.path={dir}/my_reward.py", "reward.name=takes_two"],
         r"reward\.path / reward\.name: .* raised TypeError: takes_two\(\) takes 2 positional arguments but 3"),
    ],
)
def test_reward_function_mistakes_exit_2_in_one_line_naming_the_key(reward_file: Path, overrides: list[str],
                                                                    pattern: str, capsys: pytest.CaptureFixture) -> None:
    import re

    (reward_file.parent / "broken.py").write_text("def compute_score(prompt, response, row)\n    return 1.0\n")
    run_dir = reward_file.parent / "run"
    args = [o.format(dir=reward_file.parent) for o in overrides]
    assert main(["train", str(EXAMPLE), f"run_dir={run_dir}", "logging.wandb=disabled", *args]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, " ".join(err.split())), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not run_dir.exists()  # refused before the run directory, let alone Ray


def test_a_run_with_a_reward_file_logs_its_extra_metric(reward_file: Path, tmp_path: Path) -> None:
    """Two GRPO steps on the embedded default (built-in engine) over a data file of one's own, scored by
    the reward file: the reward is the function's and its extra metric is in metrics.jsonl."""
    ray = pytest.importorskip("ray")
    from megatron_quads.controller.config import load_config
    from megatron_quads.controller.run import run

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                            for q, a in (("1+2=", "3"), ("3+4=", "7"), ("5-1=", "4"), ("2*3=", "6"))))
    task = [f"task.options.{k}='{v}'" for k, v in
            (("path", data), ("prompt_template", "{question}"), ("answer_format", "raw"))]
    cfg = load_config(EXAMPLE, ["grpo.prompts_per_step=4", "grpo.responses_per_prompt=4", "rollout.max_new_tokens=5",
                                "logging.wandb=disabled", "rollout.engine=torch", "grpo.steps=2", "checkpoint.every=0",
                                f"run_dir={tmp_path / 'run'}", "task.kind=qa", *task, f"reward.path={reward_file}"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    finally:
        ray.shutdown()
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        # the engine stops at <eos> or after 5 tokens; the response text has at most 5 characters
        assert 0.0 <= r["reward/response_chars"] <= 5.0
        assert 0.0 <= r["reward"] <= 1.0


def test_an_error_inside_the_function_during_a_run_stops_train_with_exit_1_in_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron_quads.controller import run as run_module

    def failing_run(cfg, force_config=False):
        raise RewardFunctionError("reward function compute_score in my_reward.py raised KeyError: 'x' (my_reward.py:3) "
                                  "on row qa.jsonl, line 7 (prompt '1+2='); fix the function, then run the same "
                                  "command again")

    monkeypatch.setattr(run_module, "run", failing_run)
    assert main(["train", str(EXAMPLE), f"run_dir={tmp_path / 'run'}", "logging.wandb=disabled"]) == 1
    err = capsys.readouterr().err
    assert " ".join(err.split()).startswith("training stopped: reward function compute_score in my_reward.py raised "
                                            "KeyError: 'x' (my_reward.py:3) on row qa.jsonl, line 7"), err
    assert "Traceback" not in err
