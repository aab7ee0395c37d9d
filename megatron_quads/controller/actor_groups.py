"""The controller's two actor groups: the trainer ranks (one torch.distributed group) and the rollout
engines, each driven as one; an engine that dies or hangs is restarted, re-synced and asked again."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import ray
import torch

from megatron_quads.atomic_io import write_text_atomic
from megatron_quads.controller.batch import data_parallel_shards
from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.failures import TRAINER_RANKS, trainer_get
from megatron_quads.controller.placement import Slot
from megatron_quads.controller.profiling import StepProfiler
from megatron_quads.controller.workers import RolloutWorker, TrainerWorker
from megatron_quads.rollout.engine import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENGINE_PING_S = 10.0
"""How long a ping may take before an engine counts as hung, after a call to the engines timed out."""


def engine_error(err: BaseException) -> str:
    """What went wrong in an engine, in one line: the exception the engine raised (a task error's
    ``cause``), as ``Type: the last line of its message`` (where a traceback's text ends)."""
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    error = cause if isinstance(cause, BaseException) else err
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


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
        return self._gathered(method, tokens, routed_experts)

    def compute_logprobs_and_entropy(self, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_logprobs` under the current weights and the policy's entropy at each scored token."""
        return self._gathered("compute_logprobs_and_entropy", tokens, routed_experts)

    def _gathered(self, method: str, tokens: torch.Tensor, routed_experts: torch.Tensor | None
                  ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``method``'s per-row results over the whole batch: each data-parallel replica scores its shard
        (every rank of a replica returns the same), concatenated back in batch order (tuples element-wise)."""
        batch = {"tokens": tokens} if routed_experts is None else {"tokens": tokens, "routed_experts": routed_experts}
        shards = trainer_get([getattr(a, method).remote(s["tokens"], s.get("routed_experts"))
                               for a, s in zip(self.actors, self._shards(batch), strict=True)])
        by_dp_rank = {}
        for (dp_rank, _), part in zip(self.dp, shards, strict=True):
            by_dp_rank.setdefault(dp_rank, part)
        parts = [by_dp_rank[r] for r in sorted(by_dp_rank)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column) for column in zip(*parts, strict=True))
        return torch.cat(parts)

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

    def train_step(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """One optimizer step over the whole batch, at GRPO step ``step``'s lr."""
        return trainer_get([a.train_step.remote(s, step) for a, s in zip(self.actors, self._shards(batch), strict=True)])[0]

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
    calibration, sleep, generation, evaluation) is restarted, re-synced and the call retried. In quads
    the engines keep the RAC channels of the last calibration across weight syncs; the controller
    keeps a copy (:attr:`channels`) for the engines it restarts."""

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
        self.channels: dict[str, torch.Tensor] | None = None  # the last calibration's channel sets (wire form)
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
        re-synced to the current weights with the kept RAC channels, :meth:`_restart`) and the whole call
        is made again, up to ``rollout.max_retries`` times. A failure with every engine answering is
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
                    try:
                        self._restart(index)
                    except Exception as restart_error:  # the engine's first error is the cause: it is named first
                        raise RuntimeError(f"rollout engines {bad} failed during {what}: {engine_error(err)}; restarting "
                                           f"engine {index} failed too: {engine_error(restart_error)}") from err
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

    def _load(self, trainers: Trainers, engines: list[int], version: int, kept_channels: bool = True) -> tuple[list, dict]:
        """Export once and load into the engines of index ``engines`` (``kept_channels``: see
        :meth:`RolloutWorker.load_weights`); returns their (version, timing) and the export stats."""
        transport = self.cfg.weight_transport()
        collective = transport == "collective"
        if collective and self.group_generation == 0:
            self._form_sync_groups(trainers)
        export = trainers.export_rollout_weights(version, transport)
        held_by_sender = transport != "object_store"
        try:
            loads = [self.workers[i].load_weights.remote(export.buckets_for(i), version, kept_channels) for i in engines]
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

    def sync(self, trainers: Trainers, version: int, calibrating: bool = False) -> dict[str, float]:
        """Export the trainer's weights once (every sending rank its part) and load the union into
        every engine (each checks the bucket set, names, shapes and the version); CUDA IPC / broadcast
        buffers are freed after. ``calibrating``: :meth:`calibrate` follows, so the engines skip their
        kept RAC channels (it replaces them). Returns payload bytes and the slowest sender's export
        seconds plus the slowest engine's wake / receive / load."""
        synced_before = self.version >= 0
        self.trainers, self.version = trainers, version
        if synced_before and self.cfg.weight_transport() == "collective":  # a dead member would stall every broadcast
            for index in self._failed_engines(hung_too=False):
                logger.warning("rollout engine %d is dead before the weight sync; restarting it", index)
                self._restart(index)
        loaded, stats = self._retrying("the weight sync", lambda: self._load(trainers, list(range(len(self.workers))), version,
                                                                            kept_channels=not calibrating))
        held = [v for v, _ in loaded]
        if any(v != version for v in held):
            raise RuntimeError(f"rollout engines hold weight versions {held}, expected {version}")
        slowest = {k: max(t[k] for _, t in loaded) for k in loaded[0][1]}
        return {k: float(v) for k, v in {**stats, **slowest}.items()}

    def calibrate(self, prompts: list[list[int]]) -> dict[str, float]:
        """Every engine re-chooses its RAC channels on ``prompts`` (quads mode; the others return at
        once), all at the same time, on the same prompts, so they choose the same channels, and keeps
        them for the weight syncs until the next calibration; engine 0's are kept here for restarts.
        Returns the slowest engine's seconds and the prompt tokens."""
        self.calibration = prompts
        timeout = self.cfg.rollout.timeout_s

        def calibrate_all() -> list[dict[str, float]]:
            done = ray.get([w.calibrate.remote(prompts) for w in self.workers], timeout=timeout)
            if self.cfg.run_precision().uses_rac:  # other precisions keep no channels
                self.channels = ray.get(self.workers[0].residual_channels.remote(), timeout=timeout)
            return done

        done = self._retrying("RAC calibration", calibrate_all)
        return {k: max(d[k] for d in done) for k in done[0]}

    def _restart(self, index: int) -> None:
        """Replace engine ``index`` by a new one that serves the current weights with the kept RAC
        channels (those the other engines serve), without a calibration of its own."""
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self.factories[index].remote(self.cfg)
        if self.channels is not None:
            ray.get(self.workers[index].keep_channels.remote(self.channels), timeout=self.cfg.rollout.timeout_s)
        if self.cfg.weight_transport() == "collective":
            # a broadcast needs every member: rebuild every sender's group and re-send to all engines
            self._form_sync_groups(self.trainers)
            self._load(self.trainers, list(range(len(self.workers))), self.version)
        else:  # re-export: IPC buffers are freed after each sync
            self._load(self.trainers, [index], self.version)
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


def start_profiles(trainers: Trainers, rollouts: Rollouts, driver: StepProfiler, record_shapes: bool,
                   with_stack: bool) -> None:
    """Every trainer rank, every engine and ``driver`` (this process) record their work with
    ``torch.profiler`` until :func:`write_profiles` (vLLM's engine core too where it runs in the
    rollout worker, as it does unless ``rollout.vllm.multiprocess``)."""
    workers = [*trainers.actors, *rollouts.workers]
    try:
        ray.get([w.start_profile.remote(record_shapes, with_stack) for w in workers], timeout=rollouts.cfg.rollout.timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as err:  # a lost engine is the next phase's to handle
        logger.warning("profiling could not start in every process (%s); the step goes on", type(err).__name__)
    driver.start(record_shapes, with_stack)


def write_profiles(trainers: Trainers, rollouts: Rollouts, driver: StepProfiler, directory: Path) -> list[str]:
    """Every process stops recording and writes its profile at once (``directory/driver.*``,
    ``trainer_rank<r>.*``, ``rollout_engine<i>.*``); returns the paths written. A process lost meanwhile
    (an engine restarted during the step) writes none."""
    pending = ([a.stop_profile.remote(str(directory), f"trainer_rank{rank}") for rank, a in enumerate(trainers.actors)]
               + [w.stop_profile.remote(str(directory), f"rollout_engine{i}") for i, w in enumerate(rollouts.workers)])
    written = driver.stop(directory, "driver")
    for ref in pending:
        try:
            written += ray.get(ref, timeout=rollouts.cfg.rollout.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as err:  # a lost engine is the next step's to handle
            logger.warning("a process's profile was not written to %s (%s)", directory, type(err).__name__)
    return written


def record_placement(path: Path, trainers: Trainers, rollouts: Rollouts) -> dict[str, list[str]]:
    """Write which Ray node each trainer rank and rollout engine runs on (``placement.json``)."""
    nodes = {"trainer_ranks": trainer_get([a.node_id.remote() for a in trainers.actors]),
             "rollout_engines": ray.get([w.node_id.remote() for w in rollouts.workers], timeout=rollouts.cfg.rollout.timeout_s)}
    write_text_atomic(path, json.dumps(nodes, indent=1) + "\n")
    logger.info("trainer ranks on %d node(s), rollout engines on %d node(s)", len(set(nodes["trainer_ranks"])),
                len(set(nodes["rollout_engines"])))
    return nodes

