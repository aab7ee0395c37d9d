"""The two kinds of worker the controller drives as Ray actors: trainer ranks and rollout engines.

Plain classes (Ray wraps them with ``ray.remote``), so they are usable and testable without Ray.
"""

from __future__ import annotations

import time

import torch

from megatron_quads.controller.config import RunConfig
from megatron_quads.controller.faults import checkpoint_write_error, is_storage_fault, storage_error
from megatron_quads.controller.profiling import ProfiledWorker
from megatron_quads.rollout.engine import logprob_temperature


def _elapsed(start: float) -> float:
    """Seconds since ``start``, after the GPU has finished what was queued."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def policy_model_config(cfg: RunConfig):
    """The policy architecture of a run (:meth:`RunConfig.policy_architecture`)."""
    return cfg.policy_architecture()


def start_checkpoint(cfg: RunConfig) -> str | None:
    """The model-only checkpoint a fresh run starts from: ``model.checkpoint``, the conversion of
    ``model.hf_path`` (made before Ray starts), or the embedded default's."""
    from megatron_quads import embedded
    from megatron_quads.controller.hf_model import converted_checkpoint_dir

    if cfg.model.checkpoint:
        return cfg.model.checkpoint
    if cfg.model.hf_path:
        return str(converted_checkpoint_dir(cfg))
    if cfg.model.embedded_default:
        embedded.verify(embedded.ASSET_DIR / "checkpoint")
        return str(embedded.ASSET_DIR / "checkpoint")
    return None


class TrainerWorker(ProfiledWorker):
    """One rank of the Megatron trainer (a PolicyWorker) in the trainers' process group.

    Built in two steps so ranks on several nodes can meet: :meth:`rendezvous_address` on rank 0
    gives its node's address and a free port, then every rank calls :meth:`setup` with it at once.
    """

    def __init__(self, cfg: RunConfig, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._sync_buffers = None
        self.sync_group = None

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP address, a free TCP port on it) for the process group's rendezvous."""
        import ray

        from megatron_quads.trainer.rendezvous import find_free_port

        address = ray.util.get_node_ip_address()
        return address, find_free_port(address)

    def setup(self, master_addr: str, master_port: int) -> str:
        """Join the trainers' process group (NCCL on GPU, gloo on CPU) and build the policy."""
        from megatron.core import parallel_state

        from megatron_quads.rl.loss import PolicyLoss
        from megatron_quads.trainer.distributed import init_trainer_distributed
        from megatron_quads.trainer.policy import PolicyWorker, PolicyWorkerConfig

        cfg = self.cfg
        backend = init_trainer_distributed(self.world_size, self.rank, cfg.parallel, master_addr=master_addr,
                                           master_port=master_port, seed=cfg.seed)
        self.worker = PolicyWorker(PolicyWorkerConfig(
            model=policy_model_config(cfg), parallel=cfg.parallel, quads=cfg.trainer_quads(),
            optim=cfg.grpo.trainer_optim(), micro_batch_size=cfg.grpo.micro_batch_size, seed=cfg.seed,
            router_replay=cfg.rollout.router_replay == "r3",
        ))
        self.loss = PolicyLoss(cfg.grpo.loss)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        return backend

    def data_parallel(self) -> tuple[int, int]:
        """(data-parallel rank, size): which shard of each batch this rank takes."""
        return self.dp_rank, self.dp_size

    def load(self, path: str, with_optimizer: bool) -> int:
        """Load a checkpoint; returns the steps it had done."""
        self.worker.load_checkpoint(path, with_optimizer=with_optimizer)
        return self.worker.steps_done

    def save(self, path: str) -> None:
        """Save model, optimizer and RNG (collective). A failed write raises the rank's own error instead
        of torch's ``CheckpointException``, whose text hides it; one the storage caused (a full disk, no
        permission) as a :class:`~megatron_quads.controller.faults.StorageError` naming the file."""
        try:
            self.worker.save_checkpoint(path)
        except BaseException as err:  # CheckpointException is a BaseException
            cause = checkpoint_write_error(err)
            if is_storage_fault(cause):
                raise storage_error(cause) from None
            if cause is err:
                raise
            raise cause from None

    def compute_logprobs(self, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs of this rank's shard under the current weights (replaying
        ``routed_experts`` under router replay)."""
        with torch.profiler.record_function("quads/trainer_logprobs"):
            return self.worker.compute_logprobs(tokens, logprob_temperature(self.cfg.rollout.temperature), routed_experts)

    def compute_logprobs_and_entropy(self, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_logprobs` and the policy's entropy at each scored token."""
        with torch.profiler.record_function("quads/trainer_logprobs"):
            return self.worker.compute_logprobs_and_entropy(tokens, logprob_temperature(self.cfg.rollout.temperature),
                                                            routed_experts)

    def routing_counts(self) -> tuple[int, int]:
        """(routed (token, layer) pairs, pairs the router's own top-k would have routed elsewhere) of
        this rank's last :meth:`compute_logprobs` with routing."""
        return self.worker.routing_counts

    def keep_reference(self) -> int:
        """Keep the current weights (host copy) as the KL penalty's reference policy; returns its bytes."""
        return self.worker.keep_reference()

    def compute_reference_logprobs(self, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs of this rank's shard under the reference weights."""
        return self.worker.compute_reference_logprobs(tokens, logprob_temperature(self.cfg.rollout.temperature),
                                                      routed_experts)

    def train_step(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """One optimizer step on this rank's shard with the GRPO policy loss, at GRPO step ``step``'s lr."""
        with torch.profiler.record_function("quads/trainer_train_step"):
            return self.worker.train_step(batch, self.loss, temperature=logprob_temperature(self.cfg.rollout.temperature),
                                          schedule_step=step)

    def weight_sender(self) -> tuple[int, int] | None:
        """(this rank's sender index, number of senders) if it sends rollout weights, else None."""
        from megatron_quads.trainer.hf_export import weight_sender

        return weight_sender()

    def export_rollout_weights(self, version: int, transport: str) -> tuple[list, dict[str, float]] | None:
        """This rank's part of the rollout weights, in wire form, as (bounded buckets, {bytes,
        export_s}) on a sending rank, None on the others; export_s covers the gathers, quantization
        and packing. Collective: every rank calls it. ``transport``: how the receiving engines take
        them (``RunConfig.weight_transport()`` of their side).

        With the ``object_store`` transport the buckets are Ray object refs; with ``collective`` they
        are bucket objects (buffer sizes for the broadcast) whose buffers this rank keeps until
        :meth:`broadcast_sync_buffers`. With ``cuda_ipc`` every rank returns every sender's buckets
        as IPC handles of copies on its own GPU (the senders broadcast them over the trainers' group
        first), for the engine beside it, and keeps them until :meth:`release_sync_buffers`.
        """
        import ray

        from megatron_quads.controller.rollout_export import export_rollout_tensors
        from megatron_quads.controller.weight_sync import BufferKeeper, buckets_bytes, share_buckets, to_buckets
        from megatron_quads.trainer.hf_export import weight_sender

        start = time.perf_counter()
        dtype = policy_model_config(self.cfg).torch_dtype
        weight_format = self.cfg.run_precision().weight_format
        with torch.profiler.record_function("quads/trainer_export"):
            tensors = export_rollout_tensors(self.worker.model, weight_format, dtype)
        sender = weight_sender()
        if (tensors is None) != (sender is None):
            raise RuntimeError(f"trainer rank {self.rank}: export_rollout_tensors returned "
                               f"{'nothing' if tensors is None else 'tensors'} but weight_sender() is {sender}; "
                               "a rank sends exactly when it is a weight sender")
        packed_as = "collective" if transport == "cuda_ipc" else transport  # cuda_ipc: shared before the handles
        self._sync_buffers = None if packed_as == "object_store" or tensors is None else BufferKeeper()
        buckets = None
        if tensors is not None:
            index, senders = sender
            buckets = to_buckets(tensors, version, quantized=weight_format == "nvfp4", sender=index, senders=senders,
                                 bucket_bytes=int(self.cfg.rollout.sync_bucket_mb * 2**20), transport=packed_as,
                                 keep_alive=self._sync_buffers)
            del tensors
        if transport == "cuda_ipc":
            device = torch.device("cuda", torch.cuda.current_device())
            buckets, self._sync_buffers = share_buckets(buckets, self._sync_buffers, "cuda_ipc", device)
        if buckets is None:
            return None
        sent = [ray.put(bucket) for bucket in buckets] if transport == "object_store" else buckets
        return sent, {"bytes": buckets_bytes(buckets), "export_s": _elapsed(start)}

    def release_sync_buffers(self) -> int:
        """Free the buffers behind the last CUDA IPC / collective export (every engine has them)."""
        held = 0 if self._sync_buffers is None else self._sync_buffers.nbytes
        self._sync_buffers = None
        return held

    def join_sync_group(self, address: str, port: int, world: int, generation: int) -> None:
        """Rank 0 of this sender's weight-broadcast group (it hosts the group's store at ``address:port``)."""
        from megatron_quads.controller.sync_group import WeightSyncGroup

        on_gpu = self.cfg.placement.trainer_gpus_per_worker > 0
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.sync_group = None  # the previous generation's group (and its store) goes first
        self.sync_group = WeightSyncGroup(address, port, 0, world, generation, device, self.cfg.rollout.timeout_s)

    def broadcast_sync_buffers(self) -> int:
        """Broadcast the last collective export's buffers over this sender's group in bucket order,
        then free them; returns bytes."""
        if self.sync_group is None or self._sync_buffers is None:
            raise RuntimeError("broadcast_sync_buffers needs join_sync_group and a collective export first")
        for buffer in self._sync_buffers.buffers:
            self.sync_group.broadcast(buffer)
        return self.release_sync_buffers()


class RolloutWorker(ProfiledWorker):
    """A rollout engine that generates responses with the weights it was last sent. In quads it keeps
    the RAC channel sets of its last calibration (:attr:`channels`) and serves them on every weight
    sync that no calibration follows, their ``W_S`` re-blocked from each sync's weights."""

    def __init__(self, cfg: RunConfig) -> None:
        from megatron_quads.trainer.hf_export import qwen3_moe_config

        model = policy_model_config(cfg)
        self.cfg = cfg
        self.device = torch.device("cuda" if cfg.rollout_on_gpu() else "cpu")
        if cfg.rollout.engine == "vllm":
            from megatron_quads.trainer.hf_config import hf_config_from_policy
            from megatron_quads.vllm_plugin.engine import VllmOptions, VllmRolloutEngine

            colocated_gpu = cfg.placement.mode == "colocated" and self.device.type == "cuda"
            options = VllmOptions(**cfg.rollout.vllm.model_dump(), enable_sleep_mode=colocated_gpu,
                                  routed_experts=cfg.rollout.router_replay == "r3")
            self.engine = VllmRolloutEngine(hf_config_from_policy(model), precision=cfg.run_precision(),
                                            dtype=model.torch_dtype, options=options, seed=cfg.seed)
        else:
            from megatron_quads.rollout.torch_engine import TorchRolloutEngine

            self.engine = TorchRolloutEngine(
                qwen3_moe_config(model), precision=cfg.run_precision(), device=self.device, dtype=model.torch_dtype,
                grouped=cfg.rollout.grouped_experts,
            )
        self.asleep = False
        self.sync_groups: list = []  # collective transport: one WeightSyncGroup per sender, in sender order
        self.channels: dict[str, torch.Tensor] | None = None  # wire form (rollout.wire.channel_stacks); None: none chosen

    def join_sync_groups(self, endpoints: list[tuple[str, int]], rank: int, world: int, generation: int) -> None:
        """Join every sender's weight-broadcast group (``endpoints[k]``: sender k's store) as receiver
        ``rank`` (>= 1), in sender order."""
        from megatron_quads.controller.sync_group import WeightSyncGroup

        device = torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device
        self.sync_groups = []
        self.sync_groups = [WeightSyncGroup(address, port, rank, world, generation, device, self.cfg.rollout.timeout_s)
                            for address, port in endpoints]

    def load_weights(self, buckets: list, version: int, kept_channels: bool = True) -> tuple[int, dict]:
        """Fetch every sender's buckets, check the set, decode the union and swap it in, in quads with
        the kept RAC channel sets (``kept_channels`` False, for a step that calibrates right after: the
        payload's own, none, so that no ``W_S`` is built only to be replaced).

        Returns (the weight version now held, seconds spent waking up (colocated: weights back on the
        GPU) / receiving / decoding and loading).
        """
        import ray

        from megatron_quads.controller.weight_sync import from_buckets
        from megatron_quads.rollout.wire import decode_wire, with_channels

        start = time.perf_counter()
        self.wake_up()
        wake_s = _elapsed(start)
        start = time.perf_counter()
        with torch.profiler.record_function("quads/sync_receive"):
            received = [ray.get(b) if isinstance(b, ray.ObjectRef) else b for b in buckets]
            tensors, quantized, sent_version = from_buckets(received, device=self.device, groups=self.sync_groups)
        if sent_version != version:
            raise ValueError(f"weight buckets have version {sent_version}, the controller expected {version}")
        receive_s = _elapsed(start)
        if quantized and kept_channels and self.channels is not None:  # the trainer sends none: serve the kept ones
            tensors = with_channels(tensors, self.channels)
        with torch.profiler.record_function("quads/sync_decode"):
            weights = decode_wire(tensors, quantized, sent_version, self.engine.precision if quantized else None)
        del tensors, received
        with torch.profiler.record_function("quads/sync_load"):
            self.engine.load_weights(weights, version)
        del weights
        return self.engine.weight_version, {"wake_s": wake_s, "receive_s": receive_s, "load_s": _elapsed(start) - receive_s}

    def calibrate(self, prompts: list[list[int]]) -> dict[str, float]:
        """Re-choose the RAC channels on ``prompts`` and keep them for the syncs to come (quads; a no-op
        otherwise): seconds and prompt tokens."""
        from megatron_quads.rollout.wire import channel_stacks

        if not self.engine.precision.uses_rac:
            return {"calibrate_s": 0.0, "calibration_tokens": 0.0}
        self.wake_up()
        start = time.perf_counter()
        with torch.profiler.record_function("quads/calibrate"):
            self.engine.calibrate(prompts)
        with torch.profiler.record_function("quads/calibrate_keep_channels"):
            self.channels = channel_stacks(self.engine.residual_channels())
        return {"calibrate_s": _elapsed(start), "calibration_tokens": float(sum(len(p) for p in prompts))}

    def residual_channels(self) -> dict[str, torch.Tensor] | None:
        """The RAC channel sets this engine keeps across weight syncs (None before its first calibration)."""
        return self.channels

    def keep_channels(self, channels: dict[str, torch.Tensor] | None) -> None:
        """Serve ``channels`` (another engine's :meth:`residual_channels`) from the next weight sync on:
        a restarted engine takes the channels the others serve."""
        self.channels = channels

    def generate(self, prompts: list[list[int]], params) -> list:
        """Generations for ``prompts`` (see TorchRolloutEngine.generate)."""
        self.wake_up()
        with torch.profiler.record_function("quads/generate"):
            return self.engine.generate(prompts, params)

    def sleep(self) -> int:
        """Move the engine's weights off the GPU and free its cached memory; returns bytes freed
        (the built-in engine: allocated bytes; vLLM, which allocates outside PyTorch's caching
        allocator in sleep mode: the device's free bytes)."""
        if self.asleep or self.device.type != "cuda":
            return 0
        if self.cfg.rollout.engine == "vllm":
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.engine.sleep()
            self.asleep = True
            return torch.cuda.mem_get_info(self.device)[0] - free_before
        before = torch.cuda.memory_allocated(self.device)
        self.engine.to_device("cpu")
        torch.cuda.empty_cache()
        self.asleep = True
        return before - torch.cuda.memory_allocated(self.device)

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (a no-op when awake)."""
        if self.asleep:
            if self.cfg.rollout.engine == "vllm":
                self.engine.wake_up()
            else:
                self.engine.to_device(self.device)
            self.asleep = False

    def gpu_memory(self) -> dict[str, int]:
        """Allocated / reserved bytes of this engine's process on its GPU (zeros on CPU)."""
        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0}
        return {"allocated": torch.cuda.memory_allocated(self.device), "reserved": torch.cuda.memory_reserved(self.device)}

    def node_id(self) -> str:
        """The Ray node this engine runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> int:
        """Liveness check: the weight version held."""
        return self.engine.weight_version
