"""The GRPO driver: the algorithm box, one named call per phase (mechanisms live in the workers)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import ray
import torch
from tqdm import tqdm

from megatron_quads.atomic_io import write_atomic, write_text_atomic
from megatron_quads.controller.config import RunConfig, check_runnable
from megatron_quads.controller.failures import NO_RESUME_NOTE, TRAINER_RANKS, TrainerFailure, trainer_get
from megatron_quads.controller.faults import StorageError, is_storage_fault, storage_error
from megatron_quads.controller.placement import Placement, Slot
from megatron_quads.controller.preemption import RunStopped, StopSignals, checkpoint_on_stop
from megatron_quads.controller.prompts import draw_prompts, prompt_limit, select_prompts
from megatron_quads.controller.report import MetricsSink, plot_run, read_records
from megatron_quads.controller.run_dir import (
    CONFIG_NAME,
    ConfigMismatch,
    check_saved_config,
    checkpoint_config,
    checkpoint_dirs,
    hold_run_dir,
    keep_records_before,
    make_way_for_checkpoint,
    mismatch_message,
    newest_checkpoint_config,
    prepare_run_dir,
    refused_differences,
    start_records,
)
from megatron_quads.controller.workers import RolloutWorker, TrainerWorker, policy_model_config, start_checkpoint
from megatron_quads.manifest import MANIFEST, read_manifest, verify_manifest, write_manifest
from megatron_quads.rl.advantages import group_advantages
from megatron_quads.rl.gap_monitor import GapMonitor
from megatron_quads.rl.metrics import mismatch_metrics
from megatron_quads.rollout.engine import SamplingParams
from megatron_quads.rollout.routing import routing_batch
from megatron_quads.trainer.checkpoint_audit import audit_dist_checkpoint
from megatron_quads.trainer.settings import DIST_METADATA, RUN_CHECKPOINT_TRAINER

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENGINE_PING_S = 10.0
"""How long a ping may take before an engine counts as hung, after a call to the engines timed out."""


def _sender_actors(actors: list, senders: list[tuple[int, int] | None]) -> list:
    """The sending trainer actors in sender order, from each rank's ``weight_sender()``; the senders
    must be numbered 0..n-1 with one n."""
    found = {rank: s for rank, s in enumerate(senders) if s is not None}
    counts = {n for _, n in found.values()}
    indices = sorted(i for i, _ in found.values())
    if len(counts) != 1 or indices != list(range(counts.pop())):
        raise RuntimeError(f"the trainer ranks' weight senders (rank: (index, senders)) {found} are not numbered "
                           "0..n-1 with one n: weight_sender() must give every expert-parallel rank one sender")
    by_index = {index: actors[rank] for rank, (index, _) in found.items()}
    return [by_index[i] for i in indices]


@dataclasses.dataclass
class RolloutExport:
    """One export of the rollout weights: the buckets every engine takes (``common``), or, under CUDA
    IPC, the buckets of each trainer rank's own GPU (``per_rank``: engine i takes rank i's), and the
    stats (payload bytes, the slowest rank's export seconds)."""

    common: list | None
    per_rank: list[list] | None
    stats: dict[str, float]

    def buckets_for(self, engine: int) -> list:
        """What engine ``engine`` loads (colocated: it sits beside trainer rank ``engine``)."""
        return self.common if self.per_rank is None else self.per_rank[engine]


def data_parallel_shards(batch: dict[str, torch.Tensor], dp: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """Each trainer rank's part of ``batch`` (every tensor split along its first dimension, one row per
    sequence), for ranks whose ``(data-parallel rank, data-parallel size)`` are ``dp``.

    The sequences are cut into one contiguous piece per data-parallel replica, in replica order, and
    the ranks of one replica get the same piece. When the replicas do not divide the sequences, the
    first ``sequences % replicas`` pieces hold one sequence more than the others (6 sequences over 4
    replicas: 2, 2, 1, 1). Raises ValueError when there are fewer sequences than replicas (a replica
    would get none; the run config refuses such a layout).
    """
    sizes = {size for _, size in dp}
    if len(sizes) != 1:
        raise ValueError(f"the trainer ranks disagree on the data-parallel size: {sorted(sizes)}")
    replicas = sizes.pop()
    sequences = next(iter(batch.values())).shape[0]
    if sequences < replicas:
        raise ValueError(f"{sequences} sequences cannot give each of the {replicas} data-parallel trainer replicas "
                         "one: give each update at least as many sequences as replicas (grpo.prompts_per_step x "
                         "grpo.responses_per_prompt / grpo.mini_batches), or use fewer data-parallel ranks")
    pieces = {k: v.tensor_split(replicas) for k, v in batch.items()}
    return [{k: parts[rank] for k, parts in pieces.items()} for rank, _ in dp]


class Trainers:
    """The trainer ranks as Ray actors forming one torch.distributed group."""

    def __init__(self, cfg: RunConfig, slots: list[Slot] | None = None) -> None:
        world = cfg.trainer_world_size
        actor = ray.remote(TrainerWorker)
        if slots is None:  # no placement group (unit tests): CPU ranks beside the driver
            self.actors = [actor.options(num_cpus=0).remote(cfg, rank, world) for rank in range(world)]
        else:
            self.actors = [actor.options(**slot.options()).remote(cfg, rank, world) for rank, slot in enumerate(slots)]
        TRAINER_RANKS.update({a._actor_id.hex(): rank for rank, a in enumerate(self.actors)})
        address, port = trainer_get(self.actors[0].rendezvous_address.remote())
        self.backend = trainer_get([a.setup.remote(address, port) for a in self.actors])[0]
        self.dp = trainer_get([a.data_parallel.remote() for a in self.actors])
        self.senders = _sender_actors(self.actors, trainer_get([a.weight_sender.remote() for a in self.actors]))

    def _shards(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return data_parallel_shards(batch, self.dp)

    def compute_logprobs(self, tokens: torch.Tensor, reference: bool = False,
                         routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probs of the whole batch (data-parallel shards gathered back in order), under the
        current weights or (``reference``) the kept reference weights; ``routed_experts``: the
        routing every rank replays (router replay)."""
        method = "compute_reference_logprobs" if reference else "compute_logprobs"
        batch = {"tokens": tokens} if routed_experts is None else {"tokens": tokens, "routed_experts": routed_experts}
        shards = trainer_get([getattr(a, method).remote(s["tokens"], s.get("routed_experts"))
                               for a, s in zip(self.actors, self._shards(batch), strict=True)])
        by_dp_rank = {}  # ranks of one data-parallel replica return the same shard: keep one per replica
        for (dp_rank, _), part in zip(self.dp, shards, strict=True):
            by_dp_rank.setdefault(dp_rank, part)
        return torch.cat([by_dp_rank[r] for r in sorted(by_dp_rank)])

    def routing_disagreement(self) -> float:
        """The fraction of routed (token, layer) pairs of the last replayed :meth:`compute_logprobs`
        that the trainer's own routers would have sent to other experts (every rank routes its own
        tokens, or its own sequence chunk under sequence parallelism: the counts add up)."""
        counts = trainer_get([a.routing_counts.remote() for a in self.actors])
        routed, differ = (sum(c[i] for c in counts) for i in (0, 1))
        return differ / routed if routed else 0.0

    def keep_reference(self) -> int:
        """Every rank keeps its current weights as the reference policy; returns rank 0's bytes."""
        return trainer_get([a.keep_reference.remote() for a in self.actors])[0]

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step over the whole batch."""
        return trainer_get([a.train_step.remote(s) for a, s in zip(self.actors, self._shards(batch), strict=True)])[0]

    def export_rollout_weights(self, version: int, transport: str) -> RolloutExport:
        """The rollout weights (quantized once, on the trainer side) as bounded buckets for
        ``transport``: every sender's, in sender order (see TrainerWorker); under CUDA IPC every
        rank's handles of its own copies of them. Bytes are the payload (every sender's part once),
        export_s the slowest rank's."""
        exported = trainer_get([a.export_rollout_weights.remote(version, transport) for a in self.actors])
        if transport == "cuda_ipc":
            missing = [rank for rank, part in enumerate(exported) if part is None]
            if missing:
                raise RuntimeError(f"trainer ranks {missing} returned no weights for their colocated engines; under "
                                   "CUDA IPC every rank hands its engine every sender's buckets")
            stats = {"bytes": exported[0][1]["bytes"], "export_s": max(s["export_s"] for _, s in exported)}
            return RolloutExport(None, [part for part, _ in exported], stats)
        by_actor = dict(zip(self.actors, exported, strict=True))
        sending = [i for i, part in enumerate(exported) if part is not None]
        expected = [self.actors.index(a) for a in self.senders]
        if sorted(sending) != sorted(expected):
            raise RuntimeError(f"trainer ranks {sending} sent rollout weights; the weight senders are ranks {expected}")
        parts = [by_actor[a] for a in self.senders]
        buckets = [b for part_buckets, _ in parts for b in part_buckets]
        stats = {"bytes": sum(s["bytes"] for _, s in parts), "export_s": max(s["export_s"] for _, s in parts)}
        return RolloutExport(buckets, None, stats)

    def release_sync_buffers(self) -> None:
        """Free every rank's CUDA IPC / broadcast buffers once every engine has them."""
        trainer_get([a.release_sync_buffers.remote() for a in self.actors])

    def kill(self) -> None:
        """End every rank's actor."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def load(self, path: str, with_optimizer: bool) -> int:
        """Load a checkpoint on every rank."""
        return trainer_get([a.load.remote(path, with_optimizer) for a in self.actors])[0]

    def save(self, path: str) -> None:
        """Save a checkpoint (collective)."""
        trainer_get([a.save.remote(path) for a in self.actors])


class Rollouts:
    """Rollout engines as Ray actors; an engine that dies or hangs in any call (weight sync,
    calibration, sleep, generation, evaluation) is restarted, re-synced and the call retried."""

    def __init__(self, cfg: RunConfig, slots: list[Slot] | None = None) -> None:
        self.cfg = cfg
        actor = ray.remote(RolloutWorker)
        if slots is None:
            slots_options = [{"num_cpus": 0, "num_gpus": cfg.rollout.num_gpus_per_worker}] * cfg.rollout.num_workers
        else:
            slots_options = [slot.options() for slot in slots]
        self.factories = [actor.options(**options) for options in slots_options]
        self.workers = [factory.remote(cfg) for factory in self.factories]
        self.trainers: Trainers | None = None
        self.group_generation = 0  # 0: no weight-broadcast group yet (collective transport)
        self.version = -1
        self.calibration: list[list[int]] = []
        self.restarts = 0

    def kill(self) -> None:
        """End every engine's actor."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def sleep(self) -> int:
        """Colocated engines release their GPU memory for the trainer; returns bytes freed. An engine
        that dies or hangs is restarted (and re-synced) and the call repeated (:meth:`_retrying`)."""
        return self._retrying("sleep", lambda: sum(
            ray.get([w.sleep.remote() for w in self.workers], timeout=self.cfg.rollout.timeout_s)))

    def _failed_engines(self, hung_too: bool) -> list[int]:
        """The engines that are dead, and with ``hung_too`` those that do not answer a ping within
        ``ENGINE_PING_S`` either (busy past a timeout); an engine still starting is neither."""
        refs = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ENGINE_PING_S)
        bad = []
        for index, ref in enumerate(refs):
            if ref not in ready:
                if hung_too:
                    bad.append(index)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                bad.append(index)
        return bad

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``; when it fails and some engines are dead (or, after a timeout, hung), those are restarted (each
        re-synced to the current weights and re-calibrated, :meth:`_restart`) and the whole call is
        made again, up to ``rollout.max_retries`` times. A failure with every engine answering is
        raised as it is (it is not an engine death)."""
        for attempt in range(self.cfg.rollout.max_retries + 1):
            try:
                return call()
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as err:
                bad = self._failed_engines(hung_too=isinstance(err, ray.exceptions.GetTimeoutError))
                if not bad:
                    raise
                if attempt == self.cfg.rollout.max_retries:
                    raise RuntimeError(f"rollout engines {bad} failed during {what} {attempt + 1} times (rollout.max_retries="
                                       f"{self.cfg.rollout.max_retries}); last error: {type(err).__name__}: "
                                       f"{str(err).splitlines()[0] if str(err) else ''}") from err
                logger.warning("rollout engines %s died or hung during %s (%s); restarting them and retrying", bad, what,
                               type(err).__name__)
                for index in bad:
                    self._restart(index)
        raise AssertionError("unreachable")

    def _form_sync_groups(self, trainers: Trainers) -> None:
        """(Re)build the weight-broadcast groups: one per weight sender (that trainer rank hosts the
        group's store and is its rank 0), each with every engine as ranks 1..n."""
        self.group_generation += 1
        timeout, generation = self.cfg.rollout.timeout_s, self.group_generation
        endpoints = ray.get([a.rendezvous_address.remote() for a in trainers.senders], timeout=timeout)
        world = len(self.workers) + 1
        joins = [a.join_sync_group.remote(address, port, world, generation)
                 for a, (address, port) in zip(trainers.senders, endpoints, strict=True)]
        joins += [w.join_sync_groups.remote(endpoints, i + 1, world, generation) for i, w in enumerate(self.workers)]
        ray.get(joins, timeout=timeout)

    def _load(self, trainers: Trainers, engines: list[int], version: int) -> tuple[list, dict]:
        """Export once and load into the engines of index ``engines``; returns their (version, timing)
        and the export stats."""
        transport = self.cfg.weight_transport()
        collective = transport == "collective"
        if collective and self.group_generation == 0:
            self._form_sync_groups(trainers)
        export = trainers.export_rollout_weights(version, transport)
        held_by_sender = transport != "object_store"
        try:
            loads = [self.workers[i].load_weights.remote(export.buckets_for(i), version) for i in engines]
            if collective:  # each sender broadcasts over its own group while the engines receive, then frees them
                loads += [a.broadcast_sync_buffers.remote() for a in trainers.senders]
            loaded = ray.get(loads, timeout=self.cfg.rollout.timeout_s)
        except BaseException:
            if held_by_sender:
                trainers.release_sync_buffers()
            raise
        if held_by_sender and not collective:  # CUDA IPC: every engine has copied
            trainers.release_sync_buffers()
        return loaded[: len(engines)], export.stats

    def sync(self, trainers: Trainers, version: int) -> dict[str, float]:
        """Export the trainer's weights once (every sending rank its part) and load the union into
        every engine (each checks the bucket set, names, shapes and the version); CUDA IPC / broadcast
        buffers are freed after. Returns payload bytes and the slowest sender's export seconds plus
        the slowest engine's wake / receive / load."""
        synced_before = self.version >= 0
        self.trainers, self.version = trainers, version
        if synced_before and self.cfg.weight_transport() == "collective":  # a dead member would stall every broadcast
            for index in self._failed_engines(hung_too=False):
                logger.warning("rollout engine %d is dead before the weight sync; restarting it", index)
                self._restart(index)
        loaded, stats = self._retrying("the weight sync", lambda: self._load(trainers, list(range(len(self.workers))), version))
        held = [v for v, _ in loaded]
        if any(v != version for v in held):
            raise RuntimeError(f"rollout engines hold weight versions {held}, expected {version}")
        slowest = {k: max(t[k] for _, t in loaded) for k in loaded[0][1]}
        return {k: float(v) for k, v in {**stats, **slowest}.items()}

    def calibrate(self, prompts: list[list[int]], workers: list | None = None) -> dict[str, float]:
        """Every engine (or ``workers``) re-chooses its RAC channels on ``prompts`` (quads mode; the
        others return at once), all at the same time, on the same prompts, so they choose the same
        channels. Returns the slowest engine's seconds and the prompt tokens."""
        self.calibration = prompts
        if workers is not None:  # engines just restarted (the retry is the caller's)
            done = ray.get([w.calibrate.remote(prompts) for w in workers], timeout=self.cfg.rollout.timeout_s)
        else:
            done = self._retrying("RAC calibration", lambda: ray.get(
                [w.calibrate.remote(prompts) for w in self.workers], timeout=self.cfg.rollout.timeout_s))
        return {k: max(d[k] for d in done) for k in done[0]}

    def _restart(self, index: int) -> None:
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self.factories[index].remote(self.cfg)
        if self.cfg.weight_transport() == "collective":
            # a broadcast needs every member: rebuild every sender's group and re-send to all engines
            self._form_sync_groups(self.trainers)
            self._load(self.trainers, list(range(len(self.workers))), self.version)
        else:  # re-export: IPC buffers are freed after each sync
            self._load(self.trainers, [index], self.version)
        if self.calibration:
            self.calibrate(self.calibration, [self.workers[index]])
        self.restarts += 1

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        """Generations for all prompts, split across engines in order. Every engine's request is in
        flight at once; an engine that dies or passes ``rollout.timeout_s`` is restarted, re-synced
        and asked again, up to ``rollout.max_retries`` times."""
        n = len(self.workers)
        chunks = [prompts[i::n] for i in range(n)]
        timeout = self.cfg.rollout.timeout_s
        pending = {i: (self.workers[i].generate.remote(chunk, params), time.monotonic() + timeout)
                   for i, chunk in enumerate(chunks)}
        attempts = dict.fromkeys(range(n), 0)
        outputs: list = [None] * n
        while pending:
            index, (ref, deadline) = next(iter(pending.items()))
            try:
                outputs[index] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
                del pending[index]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                if attempts[index] == self.cfg.rollout.max_retries:
                    raise RuntimeError(f"rollout worker {index} failed {attempts[index] + 1} times; last error: {err}") from err
                attempts[index] += 1
                logger.warning("rollout worker %d failed (%s); restarting and retrying", index, type(err).__name__)
                self._restart(index)
                pending[index] = (self.workers[index].generate.remote(chunks[index], params), time.monotonic() + timeout)
        merged = [None] * len(prompts)
        for index, out in enumerate(outputs):
            merged[index::n] = out
        return merged


def policy_updates(cfg: RunConfig, trainers: Trainers, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """``grpo.epochs`` passes over the step's batch, each in ``grpo.mini_batches`` optimizer steps on
    a seeded shuffle of its sequences (PPO style; ``logp_old`` stays the pre-update log-probs, so
    the ratio and its clipping act from the second update on). Returns each metric's mean over the
    updates, the last update's under ``last_*`` and their count."""
    size = batch["tokens"].shape[0]
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    updates: list[dict[str, float]] = []
    for _ in range(cfg.grpo.epochs):
        order = torch.randperm(size, generator=gen) if cfg.grpo.mini_batches > 1 else torch.arange(size)
        for part in order.tensor_split(cfg.grpo.mini_batches):
            updates.append(trainers.train_step({k: v[part] for k, v in batch.items()}))
    out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    if len(updates) > 1:
        out.update({f"last_{k}": v for k, v in updates[-1].items()})
    out["updates"] = float(len(updates))
    return out


def build_batch(prompts: list[list[int]], generations: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [prompt + response] tokens, the response mask and the rollout log-probs [b, s-1];
    with routing in the generations also ``routed_experts`` [b, s, layers, k] (:func:`routing_batch`)."""
    seqs = [p + g.token_ids for p, g in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    logp_rollout = torch.zeros((len(seqs), width - 1))
    for i, (p, g) in enumerate(zip(prompts, generations, strict=True)):
        tokens[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p) : len(p) + len(g.token_ids)] = 1.0
        logp_rollout[i, len(p) - 1 : len(p) - 1 + len(g.logprobs)] = torch.tensor(g.logprobs)
    batch = {"tokens": tokens, "mask": mask, "logp_rollout": logp_rollout}
    if any(g.routed_experts is not None for g in generations):
        batch["routed_experts"] = routing_batch(generations, width)
    return batch


def decode_response(tok, ids: list[int]) -> str:
    """Response text; ids outside the tokenizer (the model's vocabulary is padded) become U+FFFD,
    which no task parses, so such a response scores as malformed instead of crashing the run."""
    pieces, run = [], []
    for i in ids:
        if 0 <= i < tok.vocab_size:
            run.append(i)
            continue
        pieces.append(tok.decode(run))
        pieces.append("\ufffd")
        run = []
    pieces.append(tok.decode(run))
    return "".join(pieces)


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
            refused = refused_differences(_with_defaults(recorded), cfg.model_dump(mode="json"))
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


def _resume_hint(cfg: RunConfig) -> str:
    """Where a stopped run resumes from: the newest checkpoint that verifies, and the command."""
    last = latest_checkpoint(cfg)
    if last is None and checkpoint_dirs(cfg.run_dir):
        return f"no checkpoint verifies (see the warnings); {_resume_command(cfg, None)}"
    return _resume_command(cfg, last)


def _resume_command(cfg: RunConfig, last: Path | None) -> str:
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
    elif recorded is not None and refused_differences(_with_defaults(recorded), cfg.model_dump(mode="json")):
        return f"{where}; resume with: megatron-quads train {config} --force-config"
    return f"{where}; resume with: megatron-quads train {config}"


def _init_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    if cfg.placement.ray_address:
        ray.init(address=cfg.placement.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)


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
    raises :class:`~megatron_quads.trainer.checkpoint_audit.UnsafeCheckpointError` before anything starts."""
    check_runnable(cfg)
    if cfg.model.checkpoint and Path(cfg.model.checkpoint).is_dir():
        audit_dist_checkpoint(cfg.model.checkpoint)  # here, before Ray; each trainer rank audits what it loads
    run_dir = Path(cfg.run_dir)
    prepare_run_dir(run_dir)
    try:
        with hold_run_dir(run_dir):  # one run at a time, until this one ends
            check_saved_config(run_dir, cfg.model_dump(mode="json"), has_checkpoint=bool(checkpoint_dirs(run_dir)),
                               force=force_config, normalize=_with_defaults, recorded=newest_checkpoint_config(run_dir))
            save_config(cfg, run_dir / CONFIG_NAME)  # only once the check passed
            return _run_held(cfg, run_dir, force_config)
    except OSError as err:
        if not isinstance(err, StorageError) and not is_storage_fault(err, within=run_dir):
            raise
        fault = err if isinstance(err, StorageError) else storage_error(err)
        raise fault.with_note(_resume_hint(cfg)) from err


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
            return _train(cfg, trainers, rollouts, stop, checkpoints, force_config)
        except TrainerFailure as err:
            raise err.with_note(_resume_hint(cfg) if err.resumable else NO_RESUME_NOTE) from err.__cause__
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
    return RunStopped(f"stopped by {stop.name} {where}; {saved}\n{_resume_command(cfg, last)}", stop.received)


def _with_defaults(saved: dict) -> dict:
    """A saved config tree as this version resolves it (defaults of keys added since filled in);
    as it is when it no longer validates."""
    from pydantic import ValidationError

    try:
        return RunConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        return saved


def record_placement(path: Path, trainers: Trainers, rollouts: Rollouts) -> dict[str, list[str]]:
    """Write which Ray node each trainer rank and rollout engine runs on (``placement.json``)."""
    nodes = {"trainer_ranks": trainer_get([a.node_id.remote() for a in trainers.actors]),
             "rollout_engines": ray.get([w.node_id.remote() for w in rollouts.workers], timeout=rollouts.cfg.rollout.timeout_s)}
    write_text_atomic(path, json.dumps(nodes, indent=1) + "\n")
    logger.info("trainer ranks on %d node(s), rollout engines on %d node(s)", len(set(nodes["trainer_ranks"])),
                len(set(nodes["rollout_engines"])))
    return nodes


def save_config(cfg: RunConfig, path: Path) -> None:
    """The resolved config as YAML (what the resume command reads), written atomically."""
    from omegaconf import OmegaConf

    write_atomic(path, lambda tmp: OmegaConf.save(OmegaConf.create(cfg.model_dump(mode="json")), tmp))


def task_and_tokenizer(cfg: RunConfig):
    """The run's task and tokenizer (the embedded default's when ``task`` is unset)."""
    from megatron_quads import embedded
    from megatron_quads.tasks import load_tokenizer, make_task

    if cfg.task is None:
        return embedded.task(split="train"), embedded.tokenizer()
    return make_task(cfg.task.kind, **dict(cfg.task.options)), load_tokenizer(cfg.task.tokenizer)


def eval_task(cfg: RunConfig):
    """The held-out problems of the run's task (None when it has none and evaluation is off)."""
    from megatron_quads import embedded
    from megatron_quads.tasks import make_task

    if cfg.task is None:
        return embedded.task(split="eval")
    if cfg.task.eval_options is not None:
        return make_task(cfg.task.kind, **dict(cfg.task.eval_options))
    if cfg.task.kind == "arithmetic":
        return make_task("arithmetic", **{**dict(cfg.task.options), "split": "eval"})
    if cfg.eval.every:
        raise ValueError(f"eval.every is set but task kind {cfg.task.kind!r} has no held-out split: set "
                         "task.eval_options (e.g. path of the test file)")
    return None


def evaluate(cfg: RunConfig, rollouts: Rollouts, task, tok, step: int) -> dict[str, float]:
    """pass@1 of the engines' current weights on ``eval.prompts`` fixed held-out problems
    (``eval.samples`` responses each, at ``eval.temperature``): the mean correctness of the responses."""
    start = time.perf_counter()
    limit = prompt_limit(cfg, evaluation=True)
    held_out = select_prompts(task.sample_prompts(cfg.eval.prompts, seed=cfg.seed), tok, limit)  # too-long ones skipped
    if held_out.skipped:
        logger.warning("evaluation: skipped %d of %d held-out problems longer than %s", held_out.skipped,
                       cfg.eval.prompts, limit)
    problems, k = held_out.prompts, cfg.eval.samples
    ids = [p for p in held_out.ids for _ in range(k)]
    params = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                            temperature=cfg.eval.temperature, top_p=1.0 if cfg.eval.temperature == 0 else cfg.rollout.top_p,
                            seed=cfg.seed * 100003 + step + 7, stop_token_ids=(tok.eos_id,))
    generations = rollouts.generate(ids, params)
    results = task.score_batch([p for p in problems for _ in range(k)], [decode_response(tok, g.token_ids) for g in generations])
    return {"step": step, "eval/pass@1": sum(r.correct for r in results) / len(results),
            "eval/reward": sum(r.reward for r in results) / len(results), "eval/skipped_too_long": float(held_out.skipped),
            "eval/response_length": sum(len(g.token_ids) for g in generations) / len(generations),
            "time/eval": time.perf_counter() - start}


def _train(cfg: RunConfig, trainers: Trainers, rollouts: Rollouts, stop: StopSignals, checkpoints: Checkpoints,
           force_config: bool = False) -> Path:
    run_dir = Path(cfg.run_dir)
    task, tok = task_and_tokenizer(cfg)
    vocab = policy_model_config(cfg).vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab}: "
                         "set model.architecture.vocab_size >= the tokenizer's")
    stream = task.stream(seed=cfg.seed)
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # names both record files a fresh run or a resume moves aside
    held_out = eval_task(cfg) if cfg.eval.every else None

    kl = cfg.grpo.loss.kl_beta > 0
    checkpoint = start_checkpoint(cfg)
    if checkpoint and kl:  # the reference policy for the KL penalty: the starting weights, also on resume
        trainers.load(checkpoint, with_optimizer=False)
    if kl:
        logger.info("kept the reference policy for the KL penalty: %.1f MB per trainer rank (host memory)",
                    trainers.keep_reference() / 1e6)
    resumed = resume_checkpoint(cfg, trainers, checkpoint, start_loaded=kl, force_config=force_config)
    resume, state = resumed or (None, None)
    if resume is not None:
        stream.load_state_dict(state["stream"])
        start = state["step"]
        for path in (metrics_path, eval_path):  # records of the steps the resumed run does again go aside
            keep_records_before(path, start, stamp)
        logger.info("resumed from %s at step %d", resume, start)
    else:
        start = 0
        for path in (metrics_path, eval_path):  # an earlier run's records go aside
            start_records(path, stamp)

    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, stop_token_ids=(tok.eos_id,),
                            return_routed_experts=cfg.rollout.router_replay == "r3")
    n = cfg.grpo.responses_per_prompt
    limit = prompt_limit(cfg)
    release = cfg.placement.mode == "colocated" and cfg.rollout_on_gpu() and cfg.rollout.release_memory_during_training
    sink = MetricsSink(cfg, metrics_path, eval_path)
    monitor = GapMonitor(cfg.monitor) if cfg.monitor.enabled else None
    if monitor is not None:  # a resumed run's trend continues from the steps it kept
        monitor.replay(read_records(metrics_path))
    checkpoints.resumed_at(start, stream)
    with tqdm(range(start, cfg.grpo.steps), initial=start, total=cfg.grpo.steps, desc="GRPO", unit="step") as progress:
        for step in progress:
            t0 = time.perf_counter()
            drawn = draw_prompts(stream, tok, cfg.grpo.prompts_per_step, limit)          # too-long prompts skipped
            if drawn.skipped:
                logger.warning("step %d: skipped %d prompt(s) longer than %s", step, drawn.skipped, limit)
            prompts, unique_ids = drawn.prompts, drawn.ids
            prompt_ids = [ids for ids in unique_ids for _ in range(n)]
            sync = rollouts.sync(trainers, step)                                          # weight sync (quantize once)
            t_sync = time.perf_counter()
            calibration = rollouts.calibrate(unique_ids)                                  # RAC calibration (quads)
            t_calibrate = time.perf_counter()
            if held_out is not None and step % cfg.eval.every == 0:
                sink.log_eval(evaluate(cfg, rollouts, held_out, tok, step))               # evaluation
            t_eval = time.perf_counter()
            generations = rollouts.generate(prompt_ids, dataclasses.replace(params, seed=cfg.seed * 100003 + step))
            freed = rollouts.sleep() if release else 0                                    # colocated: free the GPU
            t_gen = time.perf_counter()
            rewards = torch.tensor(task.rewards([p for p in prompts for _ in range(n)], [decode_response(tok, g.token_ids) for g in generations]))
            batch = build_batch(prompt_ids, generations, tok.pad_id)
            batch["advantages"] = group_advantages(rewards, n, cfg.grpo.advantages)
            t_reward = time.perf_counter()
            routed = batch.get("routed_experts")
            batch["logp_old"] = trainers.compute_logprobs(batch["tokens"], routed_experts=routed)  # trainer log-probs
            replay = {} if routed is None else {"mismatch/routing_disagreement": trainers.routing_disagreement()}
            if kl:
                batch["logp_ref"] = trainers.compute_logprobs(batch["tokens"], reference=True, routed_experts=routed)
            mismatch = mismatch_metrics(batch["logp_rollout"], batch["logp_old"], batch["mask"][:, 1:])
            t_logp = time.perf_counter()
            with stop.deferring():  # from the update on, a stop signal waits for the step's end
                train = policy_updates(cfg, trainers, batch, step)                        # policy update(s)
                t_train = time.perf_counter()
                record = {
                    "step": step, "reward": float(rewards.mean()),
                    "response_length": float(batch["mask"].sum(1).mean()),
                    "prompts/skipped_too_long": float(drawn.skipped),
                    **{f"mismatch/{k}": float(v) for k, v in mismatch.items()}, **replay,
                    **{f"train/{k}": v for k, v in train.items()},
                    "time/sync": t_sync - t0, "time/calibrate": t_calibrate - t_sync, "time/generate": t_gen - t_eval,
                    "time/reward": t_reward - t_gen, "calibration/tokens": calibration["calibration_tokens"],
                    "time/logprobs": t_logp - t_reward, "time/train": t_train - t_logp,
                    "rollout_restarts": rollouts.restarts,
                    **{f"sync/{k}": v for k, v in sync.items()}, "rollout/gpu_bytes_released": float(freed),
                }
                if monitor is not None:
                    record.update(monitor.update(record))                                 # collapse early warning
                sink.log(record)
                checkpoints.finished(step + 1, stream)
                if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                    checkpoints.save()                                                    # checkpoint
            progress.set_postfix(reward=f"{record['reward']:.3f}", gap=f"{record['mismatch/gap_max_abs']:.3f}")
    if held_out is not None and start < cfg.grpo.steps:  # the final weights
        rollouts.sync(trainers, cfg.grpo.steps)
        rollouts.calibrate(rollouts.calibration)
        sink.log_eval(evaluate(cfg, rollouts, held_out, tok, cfg.grpo.steps))
    sink.close()
    plot_run(metrics_path, run_dir / "metrics.png", eval_path)
    return metrics_path
