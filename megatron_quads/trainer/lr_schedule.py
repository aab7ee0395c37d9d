"""The learning-rate schedule of the trainer's optimizer: linear warm-up, then constant or cosine,
through Megatron-Core's ``OptimizerParamScheduler``.

The lr is a function of the step alone (the scheduler is placed at a step, not advanced by calls),
so a resumed run trains at the same lr as an uninterrupted one without any scheduler state in the
checkpoint. Step ``s`` (0-based) trains at the scheduler's lr after ``s + 1`` steps: a warm-up of W
steps runs at lr/W, 2 lr/W, ..., lr (no step at lr 0), and a cosine over D steps reaches ``min_lr``
at step D - 1.
"""

from __future__ import annotations

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_quads.trainer.settings import OptimConfig


def lr_scheduler(optimizer: MegatronOptimizer, optim: OptimConfig) -> OptimizerParamScheduler:
    """Megatron's scheduler for ``optim``'s schedule (weight decay held at ``optim.weight_decay``);
    a cosine needs ``optim.lr_decay_steps``."""
    if optim.lr_schedule == "cosine" and optim.lr_decay_steps is None:
        raise ValueError("lr_schedule=cosine needs lr_decay_steps (the run config defaults it to grpo.steps)")
    # Megatron needs a decay span longer than the warm-up even when the lr stays constant after it
    decay_steps = optim.lr_decay_steps or optim.lr_warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=optim.lr_schedule, start_wd=optim.weight_decay,
        end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
    )


def place_at_step(scheduler: OptimizerParamScheduler, step: int) -> float:
    """Set the optimizer's lr to step ``step``'s (0-based; the scheduler after ``step + 1`` steps);
    returns that lr."""
    scheduler.num_steps = step + 1
    scheduler.step(0)
    return float(scheduler.optimizer.param_groups[0]["lr"])
