"""Save a Megatron dist checkpoint in a chosen TP/EP layout, from HF tensors or another dist checkpoint.

The conversion runs the trainer's own model: ``lcm(TP, EP x expert-TP)`` ranks join a gloo group on
this host, each builds its shard of the Megatron GPT-MoE (uninitialised), fills every parameter,
and Megatron's ``dist_checkpointing.save`` writes the checkpoint exactly as training at that layout
would. Filling from HF goes through Megatron's sharded state dict: for each of the rank's
``ShardedTensor`` slices the global tensor is built from HF tensors (:mod:`.names`) and cut to the
slice, and Megatron's own factory merges put gate/up halves back into fused parameters; filling
from a dist checkpoint is Megatron's resharding load.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.multiprocessing as mp

from megatron_quads.convert.progress import progress_bar
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig

logger = logging.getLogger(__name__)


class ConversionError(RuntimeError):
    """A conversion rank failed; the message is that rank's error."""


@dataclass(frozen=True)
class SaveJob:
    """What every rank does: read ``source`` (``kind``: an HF directory or a dist checkpoint), save to ``target``."""

    kind: Literal["hf", "megatron"]
    source: str
    target: str
    model: PolicyModelConfig
    parallel: ParallelConfig
    port: int
    progress: bool = True
    allow_nonfinite: bool = False


def world_size_for(parallel: ParallelConfig) -> int:
    """The fewest ranks that hold layout ``parallel`` (every dense and expert group complete)."""
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    return math.lcm(parallel.tensor_parallel, parallel.expert_parallel * etp)


def check_layout(model: PolicyModelConfig, parallel: ParallelConfig) -> None:
    """ValueError naming the first dimension ``parallel`` does not divide."""
    tp = parallel.tensor_parallel
    etp = parallel.expert_tensor_parallel or tp
    groups = model.num_query_groups or model.num_attention_heads
    rules = [
        (model.num_attention_heads, tp, "num_attention_heads", "--tp"),
        (groups, tp, "num_key_value_heads (query groups)", "--tp"),
        (model.vocab_size, tp, "vocab_size", "--tp"),
        (model.num_experts, parallel.expert_parallel, "num_experts", "--ep"),
        (model.moe_ffn_hidden_size, etp, "moe_intermediate_size", "--etp"),
    ]
    for size, ways, name, flag in rules:
        if size % ways:
            raise ValueError(f"{name} = {size} is not divisible by {flag} {ways}; choose a layout that divides it")


def _fill_from_hf(model: torch.nn.Module, source: str, cfg: PolicyModelConfig, progress,
                  allow_nonfinite: bool = False) -> None:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from megatron_quads.convert.hf_source import HfCheckpoint
    from megatron_quads.convert.names import megatron_from_hf

    sharded, nonpersistent, factories = load_preprocess(model.sharded_state_dict())
    cache: dict[tuple, torch.Tensor] = {}
    with HfCheckpoint(source, allow_nonfinite=allow_nonfinite) as hf:
        def load(value):
            if isinstance(value, ShardedObject):
                return None  # the local spec's linears keep no extra state
            if not isinstance(value, ShardedTensor):
                return value
            index = value.global_slice()
            stack, rest = tuple(index[: value.prepend_axis_num]), index[value.prepend_axis_num :]
            cache_key = (value.key, stack)
            if cache_key not in cache:
                cache.clear()  # the slices of one global tensor come together (gate/up halves)
                cache[cache_key] = megatron_from_hf(value.key, stack, hf.get, cfg)
            full = cache[cache_key]
            if tuple(full.shape) != tuple(value.global_shape[value.prepend_axis_num :]):
                raise ValueError(
                    f"{value.key}{list(stack)}: built a tensor of shape {list(full.shape)} from the HF checkpoint, "
                    f"but the model needs {list(value.global_shape[value.prepend_axis_num:])}"
                )
            progress()
            return full[rest].to(value.dtype).clone()

        dict_list_map_inplace(load, sharded)
    state = apply_factory_merges(sharded, factories)
    state.update(nonpersistent)
    model.load_state_dict(state, strict=True)


def _fill_from_megatron(model: torch.nn.Module, source: str, allow_nonfinite: bool = False) -> None:
    from megatron_quads.convert.finite import require_finite
    from megatron_quads.trainer.checkpoint_audit import load_dist_checkpoint

    state = load_dist_checkpoint(model.sharded_state_dict(), source)
    if not allow_nonfinite:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                require_finite(key, value, source)
    model.load_state_dict(state, strict=True)


def _rank_main(rank: int, job: SaveJob, world_size: int) -> None:
    from megatron.core import dist_checkpointing
    import torch.distributed as dist

    from megatron_quads.trainer.cpu_compat import init_distributed_cpu
    from megatron_quads.trainer.megatron_fixes import use_forked_checkpoint_result_queue
    from megatron_quads.trainer.model import build_gpt_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    use_forked_checkpoint_result_queue()
    p = job.parallel
    init_distributed_cpu(world_size, rank, tp=p.tensor_parallel, ep=p.expert_parallel, etp=p.expert_tensor_parallel,
                         master_port=job.port)
    try:
        model = build_gpt_model(job.model, p, initialize=False)
        if job.model.dtype == "bf16":
            model.bfloat16()  # what the trainer's Float16Module does: its checkpoints hold bf16 norms too
        with progress_bar(rank == 0 and job.progress, f"filling parameters (rank 0 of {world_size})") as advance:
            if job.kind == "hf":
                _fill_from_hf(model, job.source, job.model, advance, job.allow_nonfinite)
            else:
                _fill_from_megatron(model, job.source, job.allow_nonfinite)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), job.target)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _entry(rank: int, job: SaveJob, world_size: int, errors) -> None:
    try:
        _rank_main(rank, job, world_size)
    except BaseException as err:  # report the rank's own message, not a pickled traceback
        errors.put((rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
        raise SystemExit(1) from None


def save_dist_checkpoint(job: SaveJob, fork: bool = True) -> None:
    """Run ``job`` on ``world_size_for(job.parallel)`` local CPU ranks; :class:`ConversionError` if one fails.

    Without a GPU the ranks are forked (they share the imported modules) unless ``fork`` is False; on
    a GPU host they are spawned with no GPU visible (a forked CUDA runtime cannot be used), so both run
    the CPU path. A caller whose process already runs other threads (a training driver) passes
    ``fork=False``: a forked rank inherits those threads' locks and can crash.
    """
    world_size = world_size_for(job.parallel)
    fork = fork and sys.platform == "linux" and not torch.cuda.is_available()
    method = "fork" if fork else "spawn"
    errors = mp.get_context(method).SimpleQueue()
    Path(job.target).mkdir(parents=True, exist_ok=True)
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not fork:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned ranks' environment
    try:
        mp.start_processes(_entry, args=(job, world_size, errors), nprocs=world_size, join=True, start_method=method)
    except mp.ProcessExitedException as err:
        if not errors.empty():
            rank, message, trace = errors.get()
            logger.debug("rank %d traceback:\n%s", rank, trace)
            raise ConversionError(f"conversion rank {rank} failed: {message}") from None
        raise ConversionError(f"a conversion rank died: {err}") from None
    finally:
        if not fork:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
