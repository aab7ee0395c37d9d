"""``megatron-quads train``'s entry point: hold the run directory, start Ray and the actor groups, run
the GRPO loop (``controller.loop``), and end them, also on a failure or a stop signal."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from megatron_quads.controller.actor_groups import Rollouts, Trainers, record_placement
from megatron_quads.controller.checkpoints import Checkpoints, resume_command, resume_hint
from megatron_quads.controller.config import RunConfig, check_runnable
from megatron_quads.controller.failures import NO_RESUME_NOTE, TrainerFailure
from megatron_quads.controller.hf_model import ensure_converted
from megatron_quads.controller.faults import StorageError, is_storage_fault, storage_error
from megatron_quads.controller.loop import train
from megatron_quads.controller.placement import Placement
from megatron_quads.controller.preemption import RunStopped, StopSignals, checkpoint_on_stop
from megatron_quads.controller.run_dir import (
    CONFIG_NAME,
    check_saved_config,
    checkpoint_dirs,
    hold_run_dir,
    newest_checkpoint_config,
    prepare_run_dir,
)
from megatron_quads.controller.saved_config import save_config, with_defaults
from megatron_quads.trainer.checkpoint_audit import audit_dist_checkpoint

logger = logging.getLogger(__name__)


def _init_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    if cfg.placement.ray_address:
        ray.init(address=cfg.placement.ray_address, log_to_driver=False)
    else:
        # "local": a new instance even where another cluster runs (ray.init would join that one and refuse num_cpus)
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)


def run(cfg: RunConfig, force_config: bool = False) -> Path:
    """Run GRPO as configured; returns the metrics file. The run holds ``run_dir``'s lock until it
    ends (a second run there is refused: :class:`~megatron_quads.controller.run_dir.RunDirBusy`); a
    run_dir holding an earlier run takes only a config that differs from the saved one (the newest
    checkpoint's, else ``config.yaml``) in ``RESUMABLE_KEYS`` (else
    :class:`~megatron_quads.controller.run_dir.ConfigMismatch`, unless ``force_config``). A run_dir
    that cannot be written raises :class:`~megatron_quads.controller.run_dir.RunDirUnusable` before
    Ray starts. A trainer failure raises :class:`TrainerFailure`, a storage fault (a full disk, a
    missing permission) :class:`~megatron_quads.controller.faults.StorageError`, and SIGTERM / SIGINT
    :class:`~megatron_quads.controller.preemption.RunStopped`, each naming the last complete
    checkpoint and the command that resumes. A ``model.checkpoint`` whose pickles could run code
    raises :class:`~megatron_quads.trainer.checkpoint_audit.UnsafeCheckpointError` before anything starts. A
    ``model.hf_path`` is converted (or its cached conversion verified) before Ray starts
    (:func:`~megatron_quads.controller.hf_model.ensure_converted`; :class:`~megatron_quads.controller.hf_model.HfConversionError`)."""
    check_runnable(cfg)
    if cfg.model.checkpoint and Path(cfg.model.checkpoint).is_dir():
        audit_dist_checkpoint(cfg.model.checkpoint)  # here, before Ray; each trainer rank audits what it loads
    run_dir = Path(cfg.run_dir)
    prepare_run_dir(run_dir)
    try:
        with hold_run_dir(run_dir):  # one run at a time, until this one ends
            check_saved_config(run_dir, cfg.model_dump(mode="json"), has_checkpoint=bool(checkpoint_dirs(run_dir)),
                               force=force_config, normalize=with_defaults, recorded=newest_checkpoint_config(run_dir))
            save_config(cfg, run_dir / CONFIG_NAME)  # only once the check passed
            if cfg.model.hf_path:
                ensure_converted(cfg)  # before Ray: the conversion's ranks fork from this process
            return _run_held(cfg, run_dir, force_config)
    except OSError as err:
        if not isinstance(err, StorageError) and not is_storage_fault(err, within=run_dir):
            raise
        fault = err if isinstance(err, StorageError) else storage_error(err)
        raise fault.with_note(resume_hint(cfg)) from err


def _run_held(cfg: RunConfig, run_dir: Path, force_config: bool) -> Path:
    """:func:`run` once it holds ``run_dir``: the Ray actors, the loop, and their end (also on errors
    and on SIGTERM / SIGINT, whose handlers replace Ray's once Ray has started)."""
    _init_ray(cfg)
    placement = trainers = rollouts = checkpoints = None
    with StopSignals(cfg.checkpoint.preemption_grace_s) as stop:
        try:
            placement = Placement(cfg)
            rollouts = Rollouts(cfg, placement.rollout_slots)  # engine actors start in the background ...
            trainers = Trainers(cfg, placement.trainer_slots)  # ... while the trainer ranks set up
            record_placement(run_dir / "placement.json", trainers, rollouts)
            checkpoints = Checkpoints(cfg, trainers)
            return train(cfg, trainers, rollouts, stop, checkpoints, force_config)
        except TrainerFailure as err:
            raise err.with_note(resume_hint(cfg) if err.resumable else NO_RESUME_NOTE) from err.__cause__
        except KeyboardInterrupt:
            if stop.received is None:  # not a stop signal (raised by other code)
                raise
            raise _stopped(cfg, stop, checkpoints) from None
        finally:
            for group in (trainers, rollouts):
                if group is not None:
                    group.kill()
            if placement is not None:
                placement.remove()


def _stopped(cfg: RunConfig, stop: StopSignals, checkpoints: Checkpoints | None) -> RunStopped:
    """The end of a run a signal stopped: where it stopped, the checkpoint of its finished steps when
    the grace period allows (:func:`checkpoint_on_stop`), and the command that resumes."""
    logger.warning("%s received: stopping (%.1f s of the %g s grace period left)", stop.name, stop.time_left(),
                   stop.grace_s)
    if checkpoints is None or checkpoints.stream_state is None:
        where, saved = "during start-up, before any step", "nothing to save"
        last = next(reversed(checkpoint_dirs(cfg.run_dir)), None)  # not re-verified: the grace period is short
    else:
        done, total = checkpoints.done, cfg.grpo.steps
        if stop.deferred:
            where = f"after step {done - 1} finished ({done} of {total} steps done)"
        elif done < total:
            where = (f"during step {done}, which was abandoned: its rollouts are discarded and the resumed run does "
                     f"it again ({done} of {total} steps done)")
        else:
            where = f"after the last step ({done} of {total} steps done)"
        if done == 0:
            saved = "no step had finished: nothing to save"
        else:
            saved = checkpoint_on_stop(stop, checkpoints.save, needed=done > checkpoints.saved,
                                       longest_save_s=checkpoints.longest_save_s)
        last = Path(cfg.run_dir) / "checkpoints" / f"step_{checkpoints.saved}" if checkpoints.saved else None
    return RunStopped(f"stopped by {stop.name} {where}; {saved}\n{resume_command(cfg, last)}", stop.received)

