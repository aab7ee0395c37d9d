"""What a person watches a run by: TensorBoard, wandb across resumes, sample generations, the plot
redrawn during the run, the learning-rate schedule (CPU; the GRPO runs on the embedded default, Ray local)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_quads.controller.config import ConfigError, load_config
from megatron_quads.controller.report import read_records

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"
FAST = ["grpo.prompts_per_step=4", "grpo.responses_per_prompt=4", "rollout.max_new_tokens=5", "rollout.engine=torch"]
OBSERVED = ["logging.wandb=offline", "logging.tensorboard=true", "logging.samples_every=2", "logging.samples_per_step=3",
            "logging.plot_every=2", "checkpoint.every=1", "grpo.optim.lr_warmup_steps=1", "grpo.optim.lr_schedule=cosine",
            "grpo.optim.min_lr=1e-5", "grpo.optim.lr_decay_steps=3"]
# lr 1e-4 (the example's): warm-up step 0 at 1e-4, then a cosine over steps 1, 2 down to 1e-5
EXPECTED_LR = [1e-4, 1e-5 + 0.5 * 9e-5, 1e-5]


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the run (what the earlier event files hold past a purge hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=True)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_tensorboard_log_holds_every_number_of_a_record_and_purges_redone_steps(tmp_path: Path) -> None:
    from megatron_quads.controller.tensorboard_log import TensorBoardLog

    log = TensorBoardLog(tmp_path, None, "T0")
    for step in range(3):
        log.scalars({"step": step, "reward": step / 10, "train/lr": 1e-4, "note": "text", "nan": float("nan")}, step)
    log.close()
    log = TensorBoardLog(tmp_path, 2, "T1")  # resumed at step 2: step 2 is done again
    log.scalars({"step": 2, "reward": 0.9}, 2)
    log.close()
    scalars = _scalars(tmp_path)
    assert sorted(scalars) == ["reward", "train/lr"]  # strings and non-finite numbers are not scalars
    assert scalars["reward"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.9))]
    TensorBoardLog(tmp_path, None, "T2").close()  # a fresh run: the earlier files moved aside
    assert (tmp_path / "tensorboard.T2").is_dir() and len(list((tmp_path / "tensorboard.T2").iterdir())) == 2


def test_a_resume_continues_the_wandb_run_id_and_a_fresh_run_gets_a_new_one(tmp_path: Path) -> None:
    from megatron_quads.controller.wandb_log import RUN_ID_NAME, wandb_run_id

    first = wandb_run_id(tmp_path, resumed=False)
    assert (tmp_path / RUN_ID_NAME).read_text().strip() == first
    assert wandb_run_id(tmp_path, resumed=True) == first
    fresh = wandb_run_id(tmp_path, resumed=False)
    assert fresh != first and wandb_run_id(tmp_path, resumed=True) == fresh


def test_sample_rows_take_the_first_response_of_each_prompt() -> None:
    from types import SimpleNamespace

    from megatron_quads.controller.samples import markdown_table, sample_rows
    from megatron_quads.tasks import Prompt
    from megatron_quads.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompts = [Prompt(id=str(i), text=f"{i}+1=", answer=str(i + 1)) for i in range(3)]
    generations = [SimpleNamespace(token_ids=tok.encode(f"{i}{j};")) for i in range(3) for j in range(2)]
    rows = sample_rows(7, prompts, generations, torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0]), 2, tok, count=2)
    assert rows == [{"step": 7, "prompt": "0+1=", "response": "00;", "reward": 1.0},
                    {"step": 7, "prompt": "1+1=", "response": "10;", "reward": 0.5}]
    table = markdown_table([{**rows[0], "response": "a|b\nc"}])
    assert table.splitlines()[2] == "| 7 | 0+1= | a\\|b<br>c | 1.0 |"


@pytest.mark.parametrize(("overrides", "pattern"), [
    (["grpo.optim.min_lr=0.1"], r"min_lr 0.1 > lr 0.0001"),
    (["grpo.optim.lr_schedule=cosine", "grpo.optim.lr_warmup_steps=3", "grpo.steps=3"],
     r"grpo.optim.lr_warmup_steps 3 >= grpo.steps 3"),
    (["grpo.optim.lr_warmup_steps=4", "grpo.optim.lr_decay_steps=4"], r"lr_warmup_steps 4 >= lr_decay_steps 4"),
])
def test_impossible_lr_schedules_are_config_errors(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(EXAMPLE, overrides)


def test_decay_settings_under_a_constant_lr_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        load_config(EXAMPLE, ["grpo.optim.min_lr=1e-5"])
    assert "grpo.optim.min_lr has no effect with grpo.optim.lr_schedule=constant" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(EXAMPLE, ["grpo.optim.min_lr=1e-5", "grpo.optim.lr_schedule=cosine"])
    assert "min_lr" not in caplog.text


def test_observed_run_logs_tensorboard_samples_plots_and_lr_and_a_resume_continues_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An uninterrupted 3-step run and one stopped after step 0 then resumed: the same lr per step,
    TensorBoard scalars (a custom reward's extra metric among them), samples every 2 steps, the plot
    redrawn every 2 steps, one wandb run id."""
    ray = pytest.importorskip("ray")
    from megatron_quads.controller import report
    from megatron_quads.controller.run import run
    from megatron_quads.controller.wandb_log import RUN_ID_NAME

    plotted: list[int] = []  # metrics lines when the plot was drawn
    original_plot = report.plot_run

    def counting_plot(metrics_path: Path, *args, **kwargs) -> Path:
        plotted.append(len(read_records(metrics_path)))
        return original_plot(metrics_path, *args, **kwargs)

    monkeypatch.setattr(report, "plot_run", counting_plot)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(prompt, response, row):\n"
                      "    return {'score': float(response.startswith(row['answer'])), 'chars': float(len(response))}\n")
    observed = [*FAST, *OBSERVED, f"reward.path={reward}"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        full, split = tmp_path / "full", tmp_path / "split"
        records = read_records(run(load_config(EXAMPLE, [*observed, f"run_dir={full}", "grpo.steps=3"])))
        assert plotted == [2, 3]  # after step 1 (every 2 steps) and at the end
        run(load_config(EXAMPLE, [*observed, f"run_dir={split}", "grpo.steps=1"]))
        run_id = (split / RUN_ID_NAME).read_text().strip()
        resumed = read_records(run(load_config(EXAMPLE, [*observed, f"run_dir={split}", "grpo.steps=3"])))
    finally:
        ray.shutdown()

    assert [r["train/lr"] for r in records] == pytest.approx(EXPECTED_LR)
    assert [r["train/lr"] for r in resumed] == [r["train/lr"] for r in records]
    scalars = _scalars(full)
    assert [v for _, v in scalars["train/lr"]] == pytest.approx(EXPECTED_LR)
    assert [s for s, _ in scalars["reward"]] == [0, 1, 2]
    assert [v for _, v in scalars["reward/chars"]] == pytest.approx([r["reward/chars"] for r in records])
    assert [v for _, v in scalars["reward"]] == pytest.approx([r["reward"] for r in records])
    samples = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 2, 2, 2]
    assert all(s["prompt"] and isinstance(s["response"], str) and 0.0 <= s["reward"] <= 1.0 for s in samples)
    assert (split / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    # the resume continued the wandb run: two offline run directories of one id
    assert (split / RUN_ID_NAME).read_text().strip() == run_id
    assert sorted(p.name.rsplit("-", 1)[1] for p in (split / "wandb").glob("offline-run-*")) == [run_id, run_id]
