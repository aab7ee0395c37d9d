"""Runs stopped as a user meets it, then resumed: real ``megatron-quads train`` processes (the embedded
default on CPU, the built-in engine, Ray) stopped by SIGTERM to the driver and by Ctrl-C (SIGINT to
its process group) in the middle of a step, or by a full disk while writing a dist checkpoint and
while appending a metrics record. Each stop names its cause and the resume command; every resumed
run ends with an uninterrupted run's metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "embedded_default.yaml"
FAULTS = Path(__file__).parent / "fault_injection"  # its sitecustomize.py simulates storage faults
STEPS = 5
RUN = ["rollout.engine=torch", "logging.wandb=disabled", "grpo.prompts_per_step=4", "grpo.responses_per_prompt=4",
       "rollout.max_new_tokens=5", f"grpo.steps={STEPS}"]
TIMEOUT_S = 600


def _env(fault: dict | None = None) -> dict[str, str]:
    """This checkout's package first on the path (the driver and the Ray workers it starts); with
    ``fault``, the storage fault every one of those processes simulates."""
    paths = [str(FAULTS)] if fault else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MEGATRON_QUADS_TEST_FAULT", None)
    if fault:
        env["MEGATRON_QUADS_TEST_FAULT"] = json.dumps(fault)
    return env


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_quads.cli", "train", str(EXAMPLE), *RUN, f"run_dir={run_dir}", *overrides]


def _train(run_dir: Path, *overrides: str, fault: dict | None = None) -> tuple[int, str]:
    """Run to its end; (exit code, stdout and stderr)."""
    result = subprocess.run(_command(run_dir, *overrides), capture_output=True, text=True, timeout=TIMEOUT_S,
                            env=_env(fault), cwd=ROOT, check=False)
    return result.returncode, result.stdout + result.stderr


def _stopped(run_dir: Path, signum: int, *, after_records: int, group: bool,
             overrides: tuple[str, ...]) -> tuple[int, str]:
    """Start a run, send ``signum`` once its metrics hold ``after_records`` records (the next step is in
    flight) to the driver, or to its process group (``group``: a terminal's Ctrl-C); (exit code, output)."""
    log = run_dir.with_suffix(f".{signal.Signals(signum).name}.log")
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(run_dir, *overrides), stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                cwd=ROOT, start_new_session=True)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while len(_lines(run_dir / "metrics.jsonl")) < after_records:
                assert proc.poll() is None, f"the run ended (exit {proc.returncode}) first:\n{log.read_text()}"
                assert time.monotonic() < deadline, "no record within the time limit"
                time.sleep(0.05)
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, log.read_text()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _metrics(run_dir: Path) -> list[dict]:
    """Every record but timings (which differ between any two runs)."""
    return [{k: v for k, v in json.loads(line).items() if not (k.startswith("time/") or k.endswith("_s"))}
            for line in _lines(run_dir / "metrics.jsonl")]


def _last_checkpoint(output: str, run_dir: Path) -> Path:
    """The checkpoint the stop message names as the resume point (the line before the last names the
    stop, the last the checkpoint and the command)."""
    match = re.search(r"the last complete checkpoint is (\S+); resume with: megatron-quads train (\S+)$",
                      output.strip())
    assert match, output[-3000:]
    assert match[2] == str(run_dir / "config.yaml")
    return Path(match[1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, output = _train(run_dir, "checkpoint.every=0")
    assert code == 0, output[-3000:]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    return records


def test_sigterm_and_ctrl_c_mid_step_checkpoint_and_the_resume_ends_as_an_uninterrupted_run(
        tmp_path: Path, uninterrupted: list[dict]) -> None:
    run_dir = tmp_path / "run"
    every = ("checkpoint.every=3",)

    # SIGTERM to the driver alone (what Kubernetes sends the container's main process) while step 1 runs
    code, output = _stopped(run_dir, signal.SIGTERM, after_records=1, group=False, overrides=every)
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "SIGTERM received at time" not in output  # no Ray C++ signal dump
    stop = output.strip().splitlines()[-2]
    assert stop.startswith("stopped by SIGTERM "), stop
    first = _last_checkpoint(output, run_dir)
    done = json.loads((first / "controller.json").read_text())["step"]
    assert done >= 1 and first == run_dir / "checkpoints" / f"step_{done}"
    assert json.loads((first / "manifest.json").read_text())["complete"] is True
    assert ("abandoned" in stop) == (f"during step {done}, which was abandoned" in stop)
    assert f"wrote the checkpoint {first} in " in stop or "the last checkpoint holds every finished step" in stop
    assert [r["step"] for r in _metrics(run_dir)][:done] == list(range(done))

    # Ctrl-C in a terminal: SIGINT to the whole process group, while the step after the next runs
    code, output = _stopped(run_dir, signal.SIGINT, after_records=done + 1, group=True, overrides=every)
    assert code == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.strip().splitlines()[-2].startswith("stopped by SIGINT ")
    second = _last_checkpoint(output, run_dir)
    assert json.loads((second / "controller.json").read_text())["step"] > done

    code, output = _train(run_dir, *every)
    assert code == 0, output[-3000:]
    assert f"resumed from {second} at step" in output
    assert _metrics(run_dir) == uninterrupted


def test_a_full_disk_keeps_the_previous_checkpoint_and_the_resume_ends_as_an_uninterrupted_run(
        tmp_path: Path, uninterrupted: list[dict]) -> None:
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"

    # the trainer rank's dist checkpoint of step 2 meets a full disk (in its writer processes)
    code, output = _train(run_dir, "checkpoint.every=1", fault={"open": "step_2/trainer.partial/__", "errno": 28})
    assert code == 1, output[-3000:]
    shard = checkpoints / "step_2" / "trainer.partial" / "__0_0.distcp"
    assert (f"training stopped: trainer rank 0 failed: StorageError: cannot write the checkpoint of step 2 {shard}: "
            "No space left on device (ENOSPC); free space on that filesystem") in output
    assert "CheckpointException" not in output and "Traceback" not in output
    assert _last_checkpoint(output, run_dir) == checkpoints / "step_1"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]  # the failed save removed, its space freed

    # the metrics record of step 3 meets a full disk halfway through its line
    code, output = _train(run_dir, "checkpoint.every=1", fault={"write": "metrics.jsonl", "contains": '"step": 3,'})
    assert code == 1, output[-3000:]
    assert (f"training stopped: cannot write the metrics record {run_dir / 'metrics.jsonl'}: No space left on "
            "device") in output
    assert _last_checkpoint(output, run_dir) == checkpoints / "step_3"
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2]

    # the previous checkpoint loads: the resumed run ends where the uninterrupted one did
    code, output = _train(run_dir, "checkpoint.every=1")
    assert code == 0, output[-3000:]
    assert f"resumed from {checkpoints / 'step_3'} at step 3" in output
    assert _metrics(run_dir) == uninterrupted
