"""The GRPO loop: the algorithm box, one named call per phase. Mechanisms live in the actor groups
and the workers; tensors in ``batch``, timing and records in ``step_metrics`` and ``report``."""

from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from megatron_quads.controller.actor_groups import Rollouts, Trainers, start_profiles, write_profiles
from megatron_quads.controller.batch import build_batch
from megatron_quads.controller.checkpoints import Checkpoints, load_policy
from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.custom_reward import CustomReward
from megatron_quads.controller.evaluation import eval_task, evaluate
from megatron_quads.controller.preemption import StopSignals
from megatron_quads.controller.profiling import StepProfiler, step_directory
from megatron_quads.controller.prompts import draw_prompts, prompt_limit
from megatron_quads.controller.report import RunRecords
from megatron_quads.controller.rewards import response_rewards
from megatron_quads.controller.samples import sample_rows
from megatron_quads.controller.sampling import rollout_sampling
from megatron_quads.controller.step_metrics import PhaseClock, step_record
from megatron_quads.controller.trainer_phases import policy_updates, trainer_logprobs
from megatron_quads.controller.training_task import task_and_tokenizer
from megatron_quads.rl.advantages import group_advantages

logger = logging.getLogger(__name__)


def train(cfg: RunConfig, trainers: Trainers, rollouts: Rollouts, stop: StopSignals, checkpoints: Checkpoints,
          force_config: bool = False) -> Path:
    """GRPO from the starting policy, or from the newest checkpoint that loads, to ``grpo.steps``;
    returns the metrics file. Each step: sync the weights to the engines (quantized once), refresh
    the RAC channels when due (:meth:`RunConfig.calibrates_at`; between refreshes the engines serve
    the last chosen channels on the new weights), evaluate when due, generate, reward (a few
    generations logged when due), score under the trainer, update the policy at the step's lr,
    record (the plot redrawn when due), checkpoint when due. A stop signal that comes during the
    update waits for the step's end. With evaluation on, the final weights are evaluated too (their
    channels refreshed as a step ``grpo.steps`` would). A step of ``profile.steps`` is recorded with
    ``torch.profiler`` in every process (traces and tables in ``RUN_DIR/profile/step_N``)."""
    task, tok = task_and_tokenizer(cfg)
    custom = CustomReward.from_config(cfg.reward.path, cfg.reward.name) if cfg.reward.path else None
    stream = task.stream(seed=cfg.seed)
    held_out = eval_task(cfg) if cfg.eval.every else None
    resumed_at = load_policy(cfg, trainers, stream, force_config)
    start = resumed_at or 0
    records = RunRecords(cfg, resumed_at)
    checkpoints.resumed_at(start, stream)
    n, limit, kl = cfg.grpo.responses_per_prompt, prompt_limit(cfg), cfg.grpo.loss.kl_beta > 0
    release_gpu = cfg.placement.mode == "colocated" and cfg.rollout_on_gpu() and cfg.rollout.release_memory_during_training
    driver_profiler = StepProfiler()
    with tqdm(range(start, cfg.grpo.steps), initial=start, total=cfg.grpo.steps, desc="GRPO", unit="step") as progress:
        for step in progress:
            profiled = step in cfg.profile.steps
            if profiled:
                start_profiles(trainers, rollouts, driver_profiler, cfg.profile.record_shapes, cfg.profile.with_stack)
            clock = PhaseClock()
            drawn = draw_prompts(stream, tok, cfg.grpo.prompts_per_step, limit,     # too-long prompts skipped
                                 chat=cfg.data.apply_chat_template)
            if drawn.skipped:
                logger.warning("step %d: skipped %d prompt(s) longer than %s", step, drawn.skipped, limit)
            prompt_ids = [ids for ids in drawn.ids for _ in range(n)]
            calibrating = cfg.calibrates_at(step, start)
            sync = rollouts.sync(trainers, step, calibrating)                        # weight sync (quantize once)
            clock.lap("sync")
            calibration = rollouts.calibrate(drawn.ids) if calibrating else None     # RAC channel refresh (quads)
            clock.lap("calibrate")
            if held_out is not None and step % cfg.eval.every == 0:
                records.log_eval(evaluate(cfg, rollouts, held_out, tok, step))       # evaluation
            clock.lap(None)
            generations = rollouts.generate(prompt_ids, rollout_sampling(cfg, tok, step))
            freed = rollouts.sleep() if release_gpu else 0                           # colocated: free the GPU
            clock.lap("generate")
            scored = response_rewards(task, tok, drawn.prompts, generations, n, custom)  # reward
            rewards = scored.rewards
            batch = build_batch(prompt_ids, generations, tok.pad_id, group_advantages(rewards, n, cfg.grpo.advantages))
            clock.lap("reward")
            if records.samples_due(step):                                            # sample generations
                records.log_samples(step, sample_rows(step, drawn.prompts, generations, rewards, n, tok,
                                                      records.samples_per_step))
            clock.lap(None)
            mismatch = trainer_logprobs(trainers, batch, kl, cfg.logging.policy_entropy)  # rollout vs trainer log-probs
            clock.lap("logprobs")
            with stop.deferring():  # from the update on, a stop signal waits for the step's end
                updates = policy_updates(cfg, trainers, batch, step)                 # policy update(s)
                clock.lap("train")
                record = records.log_step(step_record(
                    step, rewards=rewards, mask=batch["mask"], skipped_prompts=drawn.skipped, mismatch=mismatch,
                    train=updates, clock=clock, calibration=calibration, sync=sync, restarts=rollouts.restarts,
                    freed_bytes=freed, reward_metrics=scored.metrics))               # metrics, collapse warning
                checkpoints.finished(step + 1, stream)
                if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                    checkpoints.save()                                               # checkpoint
            if profiled:
                directory = step_directory(cfg.run_dir, step)
                written = write_profiles(trainers, rollouts, driver_profiler, directory)
                logger.info("step %d profiled: %d files in %s", step, len(written), directory)
            progress.set_postfix(reward=f"{record['reward']:.3f}", gap=f"{record['mismatch/gap_max_abs']:.3f}")
    if held_out is not None and start < cfg.grpo.steps:  # the final weights
        calibrating = cfg.calibrates_at(cfg.grpo.steps, start)
        rollouts.sync(trainers, cfg.grpo.steps, calibrating)
        if calibrating:
            rollouts.calibrate(rollouts.calibration)
        records.log_eval(evaluate(cfg, rollouts, held_out, tok, cfg.grpo.steps))
    return records.close()

