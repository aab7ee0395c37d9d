"""Run Megatron-Core 0.16.1 on a CUDA-free torch with the gloo backend (tests, tiny CPU models).

Call :func:`apply_cpu_shims` once, early in the process (before Megatron objects are built). It
does nothing when ``torch.cuda.is_available()``; otherwise it applies the runtime monkeypatches
below, each at most once (idempotent). Megatron's files on disk are never modified. Where a
Megatron function only needs ``device="cuda"`` literals to mean CPU, it is wrapped (not copied) so
that it runs under :class:`CudaAsCpuMode`, a ``TorchFunctionMode`` that maps ``device="cuda"`` to
CPU, makes ``t.cuda()`` return ``t`` and (optimizer only) spells CPU tensors' ``t.type()`` as
``torch.cuda.*Tensor``. The mode is entered only around the listed functions, never globally.

The shims (names as in ``applied_shims()``), with the Megatron code that needs each one:

``cuda_current_device``
    ``torch.cuda.current_device()`` returns ``torch.device("cpu")``. Megatron allocates with
    ``device=torch.cuda.current_device()`` in ~110 places; the ones hit by a tiny MoE GPT are
    ``tensor_parallel/mappings.py`` (``_gather_along_first_dim``, ``_reduce_scatter_along_first_dim``,
    ``_AllToAll.forward``: sequence parallel and the EP all-to-all), ``tensor_parallel/layers.py``
    (weights when ``use_cpu_initialization=False``; the SP reduce-scatter buffer in
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``), ``transformer/moe/router.py``
    (``Router.gating`` moves the router weight to "the GPU" on every call),
    ``distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer`` grad/param buffers) and
    ``utils.py`` (``GlobalMemoryBuffer.get_tensor``). Without it: "Torch not compiled with CUDA
    enabled".
``cuda_streams``
    ``torch.cuda.Stream``/``Event`` become no-op :class:`CpuStream`/:class:`CpuEvent`;
    ``current_stream``/``default_stream`` return one CpuStream; ``torch.cuda.stream(s)`` is a null
    context; ``torch.cuda.synchronize`` is a no-op (CPU work is synchronous). Needed by
    ``MoEAlltoAllTokenDispatcher.__init__`` (creates ``torch.cuda.Stream()`` for its D2H copies)
    and ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (current_stream, stream(),
    ``record_event().synchronize()``); also ``DistributedDataParallel.__init__`` with
    ``num_distributed_optimizer_instances > 1``, ``Timers``, pipeline p2p and dist_checkpointing
    call ``synchronize``. ``Tensor.record_stream`` needs no shim in 0.16.1:
    ``moe_utils.maybe_move_tensor_to_cpu`` only calls it for CUDA tensors.
``cuda_rng``
    The "CUDA" RNG is the CPU default generator: ``torch.cuda.get_rng_state``/``set_rng_state``/
    ``manual_seed`` and ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` act
    on it. ``model_parallel_cuda_manual_seed`` (``CudaRNGStatesTracker.add``) reads/sets the CUDA
    RNG, and ``CudaRNGStatesTracker.fork`` swaps it around every weight init
    (``_initialize_affine_weight_gpu``) and the TP-region attention dropout, so the tracker keeps
    Megatron's semantics: inside ``fork(name)`` CPU ops draw from that tracker stream, outside the
    CPU RNG is left as it was. Side effect: ``model_parallel_cuda_manual_seed(seed)`` reseeds the
    CPU generator with ``seed`` (as ``torch.manual_seed(seed)``). The tracker's warning "CPU RNG
    state changed within GPU RNG context" is expected here and filtered out.
``dispatcher_split_sizes``
    ``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns ``t`` unchanged when it is
    already on CPU, so ``MoEAlltoAllTokenDispatcher`` passes tensors as split sizes to
    ``torch.distributed.all_to_all_single`` (``tensor_parallel.mappings._AllToAll``), which fails
    ("all_to_all_single(): incompatible function arguments"). The wrapper returns numpy, as on GPU.
``cuda_literals``
    Functions with hard-coded ``device="cuda"`` / ``.cuda()`` run under :class:`CudaAsCpuMode`:
    ``transformer/utils.get_default_causal_mask`` and ``get_sliding_window_causal_mask`` (also
    bound by name in ``fusions/fused_softmax.py``; used whenever ``attention_mask`` is None),
    ``moe_utils.track_moe_metrics`` (aux-loss logging, ``force_initialize``),
    ``tensor_parallel.data.broadcast_data`` (also re-exported by ``tensor_parallel``) and
    ``pipeline_parallel/schedules.forward_backward_*`` (``total_num_tokens`` is created on cuda;
    ``get_forward_backward_func()`` returns the wrapped functions).
``optimizer``
    Every method of the classes in ``optimizer/optimizer.py`` (``MegatronOptimizer``,
    ``MixedPrecisionOptimizer``, ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``,
    ``ChainedOptimizer``), ``optimizer/distrib_optimizer.py`` (``DistributedOptimizer``) and
    ``optimizer/grad_scaler.py`` runs under :class:`CudaAsCpuMode`. They create
    ``torch.tensor(..., device='cuda')`` (``FP32Optimizer.__init__`` ``_scale``,
    ``MixedPrecisionOptimizer`` ``found_inf``/``_scale_one``, ``clip_grads.get_grad_norm_fp32``,
    ``count_zeros_fp32``, grad scalers) and accept only params whose ``type()`` is
    ``torch.cuda.{Float,Half,BFloat16}Tensor`` (``Float16OptimizerWithFloat16Params.__init__``,
    ``DistributedOptimizer._build_model_and_main_param_groups``,
    ``clip_grads.clip_grad_by_total_norm_fp32``). With it, ``get_megatron_optimizer`` +
    ``OptimizerConfig`` work unchanged (fp32/bf16, Adam/SGD, distributed optimizer, clipping).

Not shims, and not CPU-specific, so they live in :mod:`megatron_quads.trainer.megatron_fixes`:
sequence parallelism with torch norms (``sequence_parallel_block_spec``), the 0.16.1 expert-DP
gradient bug (``mark_expert_params_for_expert_dp``) and the 0.16.1 router's ``te_general_gemm``
NameError without Transformer Engine (``fix_router_without_te``, seen on the H200 too). ``psutil`` must be installed for
dist_checkpointing's async file writer (it is in setup.py).

Usage (one process per rank, e.g. ``torch.multiprocessing.spawn``)::

    init_distributed_cpu(world_size, rank, tp=2, ep=1, etp=1, master_port=port)  # applies shims
    cfg = TransformerConfig(..., tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                            sequence_parallel=True, moe_grouped_gemm=False, use_cpu_initialization=True)
    spec = sequence_parallel_block_spec(get_gpt_layer_local_spec(num_experts=4), cfg)
    model = GPTModel(cfg, spec, vocab_size=..., max_sequence_length=...)
    mark_expert_params_for_expert_dp(model)                 # before DDP (Megatron 0.16.1 bug)
    module = Float16Module(cfg, model) if cfg.bf16 else model
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(...), module)
    opt = get_megatron_optimizer(OptimizerConfig(...), [ddp])
    # then: ddp.zero_grad_buffer(); opt.zero_grad(); loss.backward();
    #       finalize_model_grads([ddp]); opt.step()   (or get_forward_backward_func())

Not available on CPU (no shim): ``moe_grouped_gemm=True`` (``GroupedMLP`` asserts the CUDA-only
``grouped_gemm`` package; use ``SequentialMLP`` via ``moe_grouped_gemm=False``), every Transformer
Engine spec/recipe (FP8/NVFP4, TE norms, ``moe_permute_fusion``, fused router), CUDA graphs,
``overlap_moe_expert_parallel_comm``, ``gradient_accumulation_fusion`` (apex). Pipeline parallelism
over gloo is untested.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import logging
import os
import threading
from typing import Callable, Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_quads.trainer.rendezvous import find_free_port

__all__ = [
    "CpuEvent",
    "CpuStream",
    "CudaAsCpuMode",
    "applied_shims",
    "apply_cpu_shims",
    "destroy_distributed_cpu",
    "init_distributed_cpu",
]

_APPLIED: list[str] = []
_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------
# No-op stand-ins for CUDA streams and events
# ----------------------------------------------------------------------------------------------
class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event: Optional["CpuEvent"] = None) -> "CpuEvent":
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: always complete; ``elapsed_time`` is 0."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


_DEFAULT_STREAM = CpuStream()


# ----------------------------------------------------------------------------------------------
# Scoped "cuda means cpu" function mode
# ----------------------------------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaAsCpuMode(TorchFunctionMode):
    """Inside: ``device='cuda'`` (keyword, or positional in ``t.to('cuda')``) means CPU and
    ``t.cuda()`` returns ``t``. With ``spell_type_as_cuda=True`` also ``t.type()`` returns
    ``'torch.cuda.FloatTensor'`` etc. for CPU tensors (only the optimizer needs that)."""

    def __init__(self, spell_type_as_cuda: bool = False):
        super().__init__()
        self.spell_type_as_cuda = spell_type_as_cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if self.spell_type_as_cuda and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_MODE_STATE = threading.local()


def _with_cuda_as_cpu(fn: Callable, spell_type_as_cuda: bool = False) -> Callable:
    """Wrap ``fn`` so that it runs under :class:`CudaAsCpuMode` (not re-entered when nested)."""
    if getattr(fn, "__cpu_compat__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        active = getattr(_MODE_STATE, "spell", None)  # None: no mode of ours is active
        if active is not None and (active or not spell_type_as_cuda):
            return fn(*args, **kwargs)
        _MODE_STATE.spell = spell_type_as_cuda
        try:
            with CudaAsCpuMode(spell_type_as_cuda):
                return fn(*args, **kwargs)
        finally:
            _MODE_STATE.spell = active

    wrapper.__cpu_compat__ = True
    return wrapper


def _wrap_module_functions(modules: Iterable, names: Iterable[str]) -> None:
    for mod in modules:
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, _with_cuda_as_cpu(getattr(mod, name)))


# ----------------------------------------------------------------------------------------------
# The shims (see the module docstring for why each is needed)
# ----------------------------------------------------------------------------------------------
def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _shim_cuda_current_device() -> None:
    torch.cuda.current_device = _cpu_current_device


def _shim_cuda_streams() -> None:
    cuda = torch.cuda
    cuda.Stream = CpuStream
    cuda.Event = CpuEvent
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None


class _DropForkRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _shim_cuda_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cuda = torch.cuda
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )
    logging.getLogger(mrandom.__name__).addFilter(_DropForkRngWarning())


def _shim_dispatcher_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu
    if getattr(orig, "__cpu_compat__", False):
        return

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out):
            out = out.numpy()
        return out

    maybe_move_tensor_to_cpu.__cpu_compat__ = True
    for mod in (moe_utils, token_dispatcher):
        if hasattr(mod, "maybe_move_tensor_to_cpu"):
            mod.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_cuda_literals() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import data as tp_data
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils

    masks = ["get_default_causal_mask", "get_sliding_window_causal_mask"]
    _wrap_module_functions([transformer_utils, fused_softmax], masks)
    _wrap_module_functions([moe_utils], ["track_moe_metrics"])
    _wrap_module_functions([tp_data, tensor_parallel], ["broadcast_data"])
    _wrap_module_functions(
        [schedules],
        [
            "forward_backward_no_pipelining",
            "forward_backward_pipelining_with_interleaving",
            "forward_backward_pipelining_without_interleaving",
        ],
    )


def _shim_optimizer() -> None:
    from megatron.core.optimizer import distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as optimizer_module

    bases = (optimizer_module.MegatronOptimizer, grad_scaler.MegatronGradScaler)
    for mod in (optimizer_module, distrib_optimizer, grad_scaler):
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or not issubclass(cls, bases):
                continue
            for name, attr in list(vars(cls).items()):
                if inspect.isfunction(attr) and (not name.startswith("__") or name == "__init__"):
                    setattr(cls, name, _with_cuda_as_cpu(attr, spell_type_as_cuda=True))


_SHIMS: list[tuple[str, Callable[[], None]]] = [
    ("cuda_current_device", _shim_cuda_current_device),
    ("cuda_streams", _shim_cuda_streams),
    ("cuda_rng", _shim_cuda_rng),
    ("dispatcher_split_sizes", _shim_dispatcher_split_sizes),
    ("cuda_literals", _shim_cuda_literals),
    ("optimizer", _shim_optimizer),
]
SHIM_NAMES: tuple[str, ...] = tuple(name for name, _ in _SHIMS)


def apply_cpu_shims() -> bool:
    """Apply every shim listed in the module docstring, once. Returns False (and changes nothing)
    when CUDA is available, True otherwise (also on repeated calls)."""
    if torch.cuda.is_available():
        return False
    with _LOCK:
        for name, shim in _SHIMS:
            if name not in _APPLIED:
                shim()
                _APPLIED.append(name)
    return True


def applied_shims() -> list[str]:
    """Names of the shims applied in this process, in order."""
    return list(_APPLIED)


# ----------------------------------------------------------------------------------------------
# Process groups for tests / CPU runs
# ----------------------------------------------------------------------------------------------
def init_distributed_cpu(
    world_size: int,
    rank: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    seed: int = 1234,
    master_addr: str = "127.0.0.1",
    master_port: Optional[int] = None,
    timeout_s: float = 300.0,
) -> None:
    """Apply the shims, create the gloo default group (once per process; TCP rendezvous on
    ``master_addr:master_port``, default ``$MASTER_PORT``, any free port for one process), then
    (re)initialise Megatron's ``parallel_state`` with TP/PP/EP/expert-TP sizes and call
    ``model_parallel_cuda_manual_seed(seed)``.

    Calling it again in the same process with other sizes tears down the previous model-parallel
    groups first, so one spawned worker can check several layouts. ``etp=None`` means expert-TP =
    TP (Megatron's default). Build TransformerConfig with the same sizes.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_shims()
    if not dist.is_initialized():
        port = master_port or int(os.environ.get("MASTER_PORT", "0"))
        if not port:
            if world_size != 1:
                raise ValueError("init_distributed_cpu needs master_port (or $MASTER_PORT)")
            port = find_free_port(master_addr)
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{master_addr}:{port}",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed_cpu() -> None:
    """Tear down Megatron's model-parallel groups and the default process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
