"""torch.distributed + Megatron parallel_state for trainer ranks: NCCL on GPU, gloo (with shims) on CPU."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_quads.trainer.cpu_compat import init_distributed_cpu
from megatron_quads.trainer.rendezvous import find_free_port
from megatron_quads.trainer.model import ParallelConfig


def check_layout(world_size: int, parallel: ParallelConfig) -> int:
    """Data-parallel size of ``parallel`` on ``world_size`` ranks; a clear error if it does not fit."""
    tp, pp, ep = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel
    etp = parallel.expert_tensor_parallel or tp
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP*PP = {tp * pp}")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by expert-TP*EP*PP = {etp * ep * pp}")
    return world_size // (tp * pp)


def init_trainer_distributed(
    world_size: int,
    rank: int,
    parallel: ParallelConfig,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> str:
    """Join the trainer's process group and set up Megatron's model-parallel groups; returns the backend."""
    check_layout(world_size, parallel)
    if master_port is None and world_size == 1:
        master_port = find_free_port(master_addr)
    if not torch.cuda.is_available():
        init_distributed_cpu(
            world_size, rank, tp=parallel.tensor_parallel, ep=parallel.expert_parallel,
            etp=parallel.expert_tensor_parallel, seed=seed, master_addr=master_addr,
            master_port=master_port, timeout_s=timeout_s,
        )
        return "gloo"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl", init_method=f"tcp://{master_addr}:{master_port}", world_size=world_size,
            rank=rank, timeout=datetime.timedelta(seconds=timeout_s),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
    )
    model_parallel_cuda_manual_seed(seed)
    return "nccl"
