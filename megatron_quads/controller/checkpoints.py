"""The run's checkpoints: saving one (complete or absent), verifying them, choosing the newest that
loads to resume from, and the command that resumes a stopped run."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import ray

from megatron_quads.atomic_io import write_text_atomic
from megatron_quads.controller.actor_groups import Trainers
from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.failures import TrainerFailure
from megatron_quads.controller.run_dir import (
    CONFIG_NAME,
    ConfigMismatch,
    checkpoint_config,
    checkpoint_dirs,
    make_way_for_checkpoint,
    mismatch_message,
    refused_differences,
)
from megatron_quads.controller.saved_config import save_config, with_defaults
from megatron_quads.controller.workers import start_checkpoint
from megatron_quads.manifest import MANIFEST, read_manifest, verify_manifest, write_manifest
from megatron_quads.tasks import PromptStream
from megatron_quads.trainer.settings import DIST_METADATA, RUN_CHECKPOINT_TRAINER

logger = logging.getLogger(__name__)


def save_checkpoint(cfg: RunConfig, trainers: Trainers, step: int, stream_state: dict) -> Path:
    """Trainer state, controller state (``step`` steps done, the prompt stream's ``stream_state``) and
    the run config that made them (``config.yaml``), made visible by the manifest (every file's size
    and sha256, the step, ``complete``) written last; keeps the last K. A save that fails (a full
    disk, a trainer rank's error) removes what it wrote and leaves the older checkpoints as they were."""
    root = Path(cfg.run_dir) / "checkpoints" / f"step_{step}"
    make_way_for_checkpoint(root)
    try:
        root.mkdir(parents=True)
        trainers.save(str(root / RUN_CHECKPOINT_TRAINER))
        write_text_atomic(root / "controller.json", json.dumps({"step": step, "stream": stream_state}, indent=1))
        save_config(cfg, root / CONFIG_NAME)
        write_manifest(root, {"step": step, "complete": True})
    except (OSError, TrainerFailure):
        shutil.rmtree(root, ignore_errors=True)  # frees its space; without a manifest no resume would use it
        raise
    for old in checkpoint_dirs(cfg.run_dir)[: -cfg.checkpoint.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return root


class Checkpoints:
    """Where the run stands for a checkpoint: the steps finished (:attr:`done`) and the prompt stream's
    state after them, the last checkpointed step (:attr:`saved`) and the longest save so far (which
    tells a stopping run whether a save fits in its grace period)."""

    def __init__(self, cfg: RunConfig, trainers: Trainers) -> None:
        self.cfg, self.trainers = cfg, trainers
        self.done = self.saved = 0
        self.stream_state: dict | None = None  # None until the loop starts
        self.longest_save_s: float | None = None

    def resumed_at(self, step: int, stream) -> None:
        """The loop starts at ``step`` (0, or a checkpoint's step) with ``stream`` there."""
        self.done = self.saved = step
        self.stream_state = stream.state_dict()

    def finished(self, steps: int, stream) -> None:
        """``steps`` steps are done (trained and recorded) and ``stream`` stands after them."""
        self.done, self.stream_state = steps, stream.state_dict()

    def save(self) -> Path:
        """Save the finished steps (:func:`save_checkpoint`)."""
        start = time.perf_counter()
        path = save_checkpoint(self.cfg, self.trainers, self.done, self.stream_state)
        self.saved = self.done
        self.longest_save_s = max(self.longest_save_s or 0.0, time.perf_counter() - start)
        return path


_DAMAGED = "the checkpoint is damaged; the run resumes from the next older one (delete this one to silence the warning)"


def _checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed from, or None when it verifies.

    It verifies when its manifest marks it complete, every file the manifest lists has the listed
    size and sha256, ``controller.json`` parses and ``trainer/metadata.json`` exists. A manifest
    without a file list (no sizes and hashes to check) is accepted with a warning that the files are
    not verified.
    """
    try:
        doc = read_manifest(path, _DAMAGED)
        if doc.get("complete") is not True:
            return f"{path / MANIFEST} does not mark it complete ('complete': true)"
        if "files" in doc:
            verify_manifest(path, _DAMAGED)
        else:
            logger.warning("checkpoint %s: its %s lists no files, so their sizes and sha256 are not verified; "
                           "using it as is", path, MANIFEST)
        json.loads((path / "controller.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return str(err)
    if not (path / RUN_CHECKPOINT_TRAINER / DIST_METADATA).is_file():
        return f"{path / 'trainer'} is not a complete Megatron dist checkpoint (no metadata.json)"
    return None


def verified_checkpoints(cfg: RunConfig) -> Iterator[Path]:
    """The run's checkpoints that verify (:func:`_checkpoint_problem`), newest first, checked one at a
    time as they are asked for; each one that does not is skipped with a warning naming the bad file."""
    for path in reversed(checkpoint_dirs(cfg.run_dir)):
        problem = _checkpoint_problem(path)
        if problem is None:
            yield path
        else:
            logger.warning("skipping checkpoint %s: %s", path, problem)


def latest_checkpoint(cfg: RunConfig) -> Path | None:
    """The newest checkpoint that verifies; incomplete, corrupt or partial ones are skipped with a warning."""
    return next(verified_checkpoints(cfg), None)


def resume_checkpoint(cfg: RunConfig, trainers: Trainers, start: str | None,
                      start_loaded: bool, force_config: bool = False) -> tuple[Path, dict] | None:
    """Load the newest checkpoint that verifies and loads into every trainer rank (model, optimizer,
    RNG); returns it and its controller state, or None when the run starts over.

    A checkpoint whose load raises on a rank (a damaged shard Megatron cannot read, a NaN or Inf
    parameter) is skipped with a warning and the next older one tried. When none loads, the trainers
    get ``start`` (the model-only starting checkpoint) again unless ``start_loaded`` and nothing was
    tried since. A rank that died while loading stops the run: no checkpoint can load into it. A
    checkpoint whose recorded config differs from ``cfg`` in keys a resume may not change is refused
    (:class:`~megatron_quads.controller.run_dir.ConfigMismatch`) unless ``force_config``.
    """
    tried = False
    for path in verified_checkpoints(cfg):
        state = json.loads((path / "controller.json").read_text())
        recorded = checkpoint_config(path)
        if recorded is not None and not force_config:
            refused = refused_differences(with_defaults(recorded), cfg.model_dump(mode="json"))
            if refused:
                raise ConfigMismatch(mismatch_message(Path(cfg.run_dir), refused, path / CONFIG_NAME))
        tried = True
        try:
            trainers.load(str(path / RUN_CHECKPOINT_TRAINER), with_optimizer=True)
        except TrainerFailure as err:
            if isinstance(err.__cause__, ray.exceptions.RayActorError):
                raise
            logger.warning("checkpoint %s failed to load, trying the next older one: %s", path, err)
            continue
        return path, state
    if tried:
        if start is None:
            raise RuntimeError(f"no checkpoint under {Path(cfg.run_dir) / 'checkpoints'} loads (see the warnings) and "
                               "the run has no model.checkpoint to start over from: delete the damaged checkpoints "
                               "to start from a fresh initialisation, or set model.checkpoint")
        logger.warning("no checkpoint loads: starting over from %s", start)
    if start is not None and (tried or not start_loaded):
        trainers.load(start, with_optimizer=False)
    return None


def load_policy(cfg: RunConfig, trainers: Trainers, stream: PromptStream, force_config: bool = False) -> int | None:
    """Load the policy the loop starts from; returns the step a resumed run starts at (``stream``
    restored to it), None when the run starts over.

    With the KL penalty (``grpo.loss.kl_beta`` > 0) the starting weights (``model.checkpoint``, or the
    fresh initialisation) are kept first as the reference policy, also on resume. Then the newest
    checkpoint that loads is resumed from, else the starting checkpoint loaded (:func:`resume_checkpoint`).
    """
    kl = cfg.grpo.loss.kl_beta > 0
    start = start_checkpoint(cfg)
    if start and kl:
        trainers.load(start, with_optimizer=False)
    if kl:
        logger.info("kept the reference policy for the KL penalty: %.1f MB per trainer rank (host memory)",
                    trainers.keep_reference() / 1e6)
    resumed = resume_checkpoint(cfg, trainers, start, start_loaded=kl, force_config=force_config)
    if resumed is None:
        return None
    path, state = resumed
    stream.load_state_dict(state["stream"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"]


def resume_hint(cfg: RunConfig) -> str:
    """Where a stopped run resumes from: the newest checkpoint that verifies, and the command."""
    last = latest_checkpoint(cfg)
    if last is None and checkpoint_dirs(cfg.run_dir):
        return f"no checkpoint verifies (see the warnings); {resume_command(cfg, None)}"
    return resume_command(cfg, last)


def resume_command(cfg: RunConfig, last: Path | None) -> str:
    """The last complete checkpoint ``last`` and the command that resumes from it: the run's
    ``config.yaml``, or the checkpoint's own when that is gone (neither: the command that started
    the run); with ``--force-config`` when the checkpoint was made under a config that differs from
    this run's in keys a resume may not change (this run continued under another config and has not
    checkpointed since)."""
    where = "no checkpoint was written yet" if last is None else f"the last complete checkpoint is {last}"
    try:
        recorded = checkpoint_config(last) if last is not None else None
    except (OSError, ValueError):  # damaged: the resume finds out and says so
        recorded = None
    config = Path(cfg.run_dir) / CONFIG_NAME
    if not config.is_file():
        if recorded is None:
            return f"{where}; start the run again with the command that started it"
        config = last / CONFIG_NAME
    elif recorded is not None and refused_differences(with_defaults(recorded), cfg.model_dump(mode="json")):
        return f"{where}; resume with: megatron-quads train {config} --force-config"
    return f"{where}; resume with: megatron-quads train {config}"

