"""Megatron-Core 0.16 gaps that are not about CPU: fixes applied through specs and param attributes.

- Torch norms refuse sequence parallelism (apex / TE norms mark their weights ``sequence_parallel``;
  ``WrappedTorchNorm`` does not): :class:`SequenceParallelTorchNorm` and
  :func:`sequence_parallel_block_spec` swap in a torch norm whose weights carry the mark, so a local
  spec (no TE, no apex) trains with TP > 1 and SP, as MoE + TP requires.
- Expert-data-parallel gradients are not reduced when EP = 1 and expert-TP != TP (a 0.16.1 bug fixed
  upstream): :func:`mark_expert_params_for_expert_dp`.
- Without Transformer Engine the 0.16.1 router raises ``NameError: te_general_gemm`` on every forward
  (CPU and GPU alike): :func:`fix_router_without_te`.
- The legacy GroupedMLP needs the CUDA-only ``grouped_gemm`` package: :func:`provide_grouped_gemm_fallback`
  installs a torch stand-in when it is missing (``torch._grouped_mm`` on CUDA in bf16, one matmul per
  expert elsewhere).
- The dist-checkpoint writer collects write results through a ``Manager`` queue started with the
  *spawn* method, which re-imports the parent's main module in a fresh interpreter (seconds per
  process once Megatron is imported): :func:`use_forked_checkpoint_result_queue`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Optional

import torch


# ----------------------------------------------------------------------------------------------
# Layer spec: torch norms under sequence parallelism (no TE / apex)
# ----------------------------------------------------------------------------------------------
class SequenceParallelTorchNorm:
    """Spec-level stand-in for ``WrappedTorchNorm`` that allows ``sequence_parallel``.

    Builds ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (per ``config.normalization``) and marks
    its parameters ``sequence_parallel=config.sequence_parallel``, like apex's ``FusedLayerNorm``
    and TE's norms do, so ``finalize_model_grads`` sums their gradients over the TP group (each TP
    rank only saw its sequence shard). State-dict keys are those of the plain torch norm.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero_centered_gamma is not supported by torch norms")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _replace_torch_norms(spec):
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, ModuleSpec) and spec.submodules is not None:
        if dataclasses.is_dataclass(spec.submodules):
            for field in dataclasses.fields(spec.submodules):
                value = getattr(spec.submodules, field.name)
                setattr(spec.submodules, field.name, _replace_torch_norms(value))
    return spec


def sequence_parallel_block_spec(layer_spec, config, vp_stage: Optional[int] = None):
    """Block spec for ``GPTModel(config, transformer_layer_spec=...)`` from a local layer spec
    (e.g. ``get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)``) in which every
    ``WrappedTorchNorm`` (input/pre-MLP/q/k norms and the final norm) is replaced by
    :class:`SequenceParallelTorchNorm`. Works with and without sequence parallelism."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = _replace_torch_norms(copy.deepcopy(layer_spec))
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm
    )


# ----------------------------------------------------------------------------------------------
# Megatron 0.16.1 expert-DP gradient reduction (not CPU-specific)
# ----------------------------------------------------------------------------------------------
def mark_expert_params_for_expert_dp(model: torch.nn.Module) -> int:
    """Mark routed-expert weights ``allreduce=False`` when expert-TP != TP (or EP > 1).

    Megatron 0.16.1 ``ColumnParallelLinear``/``RowParallelLinear`` set
    ``allreduce = not (is_expert and expert_model_parallel_size > 1)``. With EP = 1 but
    ``expert_tensor_parallel_size != tensor_model_parallel_size`` (e.g. TP=2+SP, ETP=1) the expert
    weights are replicated over the expert-data-parallel group, yet Megatron DDP puts them in the
    dense buffers, reduced over the dense DP group (size 1 for TP=2 on 2 ranks): their grads are
    never summed over the expert-DP group and the replicas drift apart. Upstream Megatron-LM fixed
    the condition (commit cd4afffa, PR #5916: ``use_expert_pgs = is_expert and (expert_parallel
    or ETP != TP ...)``). ``GroupedMLP`` (``weight1``/``weight2``) has the same condition and is
    covered too. Call this on the bare model before ``DistributedDataParallel`` and
    ``get_megatron_optimizer`` (they read ``allreduce`` when they build their buffers and param
    groups); returns the number of parameters changed. Expert linears of our own (subclasses of
    Column/RowParallelLinear) can instead set ``allreduce`` themselves with the upstream rule.
    """
    from megatron.core.transformer.moe.experts import GroupedMLP

    changed = 0
    for module in model.modules():
        if not (getattr(module, "is_expert", False) or isinstance(module, GroupedMLP)):
            continue
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        etp = cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size
        if cfg.expert_model_parallel_size == 1 and etp == cfg.tensor_model_parallel_size:
            continue
        for param in module.parameters(recurse=False):
            if hasattr(param, "main_grad"):
                raise RuntimeError("call mark_expert_params_for_expert_dp before wrapping in DDP")
            if getattr(param, "allreduce", True):
                param.allreduce = False
                changed += 1
    return changed


# ----------------------------------------------------------------------------------------------
# Legacy GroupedMLP without the CUDA-only ``grouped_gemm`` package
# ----------------------------------------------------------------------------------------------
GROUP_ROW_ALIGN = 8
"""Rows each expert's group is padded to a multiple of for ``torch._grouped_mm``: its backward takes
the weight gradient as one GEMM a group with the tokens as the reduction dim, whose groups must start
on 16-byte boundaries (8 bf16 rows)."""


def padded_group_rows(counts: list[int], align: int = GROUP_ROW_ALIGN) -> tuple[torch.Tensor, list[int]]:
    """Where each row of groups of ``counts`` rows lands when every group is padded to a multiple of
    ``align`` rows: (int64 destination row of each source row ``[sum(counts)]``, each padded group's
    end offset)."""
    dest, ends, start = [], [], 0
    for count in counts:
        dest.append(torch.arange(start, start + count, dtype=torch.int64))
        start += -(-count // align) * align
        ends.append(start)
    return (torch.cat(dest) if dest else torch.zeros(0, dtype=torch.int64)), ends


def grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``a [T, K] @ b[e] [K, N]`` (CUDA, bf16, sm_80 or newer,
    K and N multiples of 8 so that every row starts on 16 bytes)."""
    return (hasattr(torch, "_grouped_mm") and a.is_cuda and a.dtype == b.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(a.device) >= (8, 0)
            and a.shape[-1] % 8 == 0 and b.shape[-1] % 8 == 0)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``out[rows of group e] = a[rows of group e] @ b[e]`` as one ``torch._grouped_mm`` (autograd
    included), the groups' rows padded with zeros to :data:`GROUP_ROW_ALIGN` and taken back out."""
    if b.stride(-1) != 1 and b.stride(-2) != 1:  # the kernel reads b row- or column-major only
        b = b.contiguous()
    dest, ends = padded_group_rows(counts)
    offs = torch.tensor(ends, dtype=torch.int32).to(a.device, non_blocking=True)
    if ends[-1] == a.shape[0] and a.is_contiguous() and a.data_ptr() % 16 == 0:  # no group needs padding
        return torch._grouped_mm(a, b, offs=offs)
    dest = dest.to(a.device, non_blocking=True)
    padded = a.new_zeros(ends[-1], a.shape[1]).index_copy(0, dest, a)
    return torch._grouped_mm(padded, b, offs=offs).index_select(0, dest)


class _TorchGroupedGemmOps:
    """``grouped_gemm.ops`` stand-in: one ``torch._grouped_mm`` where it fits (:func:`grouped_mm_fits`),
    else one matmul per expert over its contiguous slice of tokens."""

    @staticmethod
    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        """``out[rows of expert e] = a[rows of expert e] @ b[e]`` (``b[e].T`` with ``trans_b``)."""
        weights = b.transpose(1, 2) if trans_b else b
        counts = batch_sizes.tolist()
        if grouped_mm_fits(a, weights):
            return grouped_mm(a, weights, counts)
        return torch.cat([rows @ weights[e] for e, rows in enumerate(torch.split(a, counts))])


def provide_grouped_gemm_fallback() -> bool:
    """Let Megatron's legacy GroupedMLP run without the ``grouped_gemm`` package (:class:`_TorchGroupedGemmOps`).

    Returns True if the stand-in was installed, False if the real package is present.
    """
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm_is_available():
        return False
    grouped_gemm_util.grouped_gemm = type("TorchGroupedGemm", (), {"ops": _TorchGroupedGemmOps})
    grouped_gemm_util.ops = _TorchGroupedGemmOps
    return True


# ----------------------------------------------------------------------------------------------
# Router without Transformer Engine
# ----------------------------------------------------------------------------------------------
def fix_router_without_te() -> bool:
    """Bind ``moe_utils.te_general_gemm = None`` when TE is absent (Megatron then uses torch.mm).

    ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but 0.16.1 binds the name
    only when TE imports. Returns True if the binding was added.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _end_with(parent: int) -> None:
    """In a forked ``Manager`` server: be killed when ``parent`` ends (Linux ``PR_SET_PDEATHSIG``), so a
    process killed before it could shut its manager down leaves no server behind (one that would hold
    the inherited stdout / stderr open, and with them the pipes of whoever waits on the output)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server ends with a clean shutdown only
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(0)


def use_forked_checkpoint_result_queue() -> bool:
    """Give Megatron's dist-checkpoint writer a fork-started ``Manager`` queue for its write results
    (same semantics, no interpreter start-up); returns False if one was already created. For
    processes without CUDA (a forked server must not inherit a CUDA context). The manager's server
    ends with this process, also when it is killed."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return False
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(_end_with, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    return True
