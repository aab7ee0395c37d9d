"""Megatron-Core on a CUDA-free torch with gloo, through ``megatron_quads.trainer.cpu_compat``.

A tiny MoE ``GPTModel`` (2 layers, hidden 64, ffn 128, 4 experts, top-2, vocab 128, seq 16) built
from ``get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)`` runs forward, loss,
backward and one Megatron-optimizer step under Megatron DDP, in fp32 and bf16.

All Megatron work happens in two spawned jobs (module fixtures), so the shims never patch the pytest
process: a 1-process job and a 2-process job (gloo on 127.0.0.1). The 2-process job reuses its
two workers for every layout: it first trains a TP=1/EP=1 reference (DP=2), keeps its full state
dict, then rebuilds the model under EP=2 (alltoall, allgather) and TP=2+SP (EP=1, EP=2), loads the
same weights sharded for that layout, runs the same global batch and compares with the reference.
It also checks the expert-data-parallel drift (TP=2+SP, expert-TP=1, EP=1) with and without
``mark_expert_params_for_expert_dp``, Adam + distributed optimizer + overlapped grad reduce, and
dist_checkpointing (EP=2 -> TP=2 model resharding; model+optimizer round trip). Each check writes its
numbers to a JSON file; the tests below assert on them.

Tolerances (fp32): per-token loss 1e-5 absolute, grad norm 1e-5 relative, parameters after one
clipped SGD step 1e-6 absolute (the largest update is ~3e-2, so a wrong gradient or clip factor
shows; measured differences are <= 5e-7, 1e-7 and 6e-8).
bf16: per-token loss 5e-2 absolute, grad norm 3e-2 relative. SGD is used for the comparisons
because Adam's first step is ~lr*sign(g) and would amplify fp32 noise on near-zero gradients.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

import pytest
import torch
from mp_harness import Recorder, get, spawn

from megatron_quads.trainer import cpu_compat, megatron_fixes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed",
)

LAYERS, HIDDEN, FFN, HEADS, EXPERTS, TOPK, VOCAB, SEQ = 2, 64, 128, 4, 4, 2, 128, 16
MBS = 2  # micro-batch size per data-parallel rank
SEED = 1234
SGD_LR = 0.5
FP32_LOSS_TOL, FP32_GNORM_RTOL, FP32_PARAM_TOL = 1e-5, 1e-5, 1e-6
BF16_LOSS_TOL, BF16_GNORM_RTOL = 5e-2, 3e-2
JOB_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# Helpers that run inside the spawned workers
# ---------------------------------------------------------------------------------------------
def _config(
    dtype=torch.float32, *, tp=1, ep=1, etp=None, dispatcher="alltoall", aux=0.0, cpu_init=True
):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=aux,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,  # MoE + TP requires sequence parallelism
        use_cpu_initialization=cpu_init,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
    )


def _build(cfg):
    """Bare GPTModel and the module to hand to DDP (Float16Module-wrapped in bf16)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    megatron_fixes.fix_router_without_te()
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if cfg.sequence_parallel:
        spec = megatron_fixes.sequence_parallel_block_spec(spec, cfg)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    return model, (Float16Module(cfg, model) if cfg.bf16 else model)


def _ddp_and_optimizer(cfg, module, *, optimizer="sgd", lr=SGD_LR, dist_opt=False, overlap=False):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=overlap,
        bucket_size=20_000 if overlap else None,
    )
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=module)
    opt_cfg = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        weight_decay=0.0,
        sgd_momentum=0.0,
        clip_grad=1.0,
        bf16=cfg.bf16,
        params_dtype=cfg.params_dtype,
        use_distributed_optimizer=dist_opt,
    )
    return ddp, get_megatron_optimizer(opt_cfg, [ddp])


def _batch(step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)


def _global_batch(step: int) -> torch.Tensor:
    return torch.cat([_batch(step, 0), _batch(step, 1)])


def _train_step(ddp, opt, tokens):
    from megatron.core.distributed import finalize_model_grads

    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss_per_token = ddp(tokens, positions, None, labels=tokens)  # [b, s]
    loss_per_token.float().mean().backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()
    return loss_per_token.detach().float(), bool(ok), float(grad_norm)


_EXPERT_RE = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def _global_name(name: str) -> str:
    from megatron.core import parallel_state as ps

    match = _EXPERT_RE.match(name)
    if not match:
        return name
    num_local = EXPERTS // ps.get_expert_model_parallel_world_size()
    global_idx = ps.get_expert_model_parallel_rank() * num_local + int(match.group(2))
    return f"{match.group(1)}{global_idx}{match.group(3)}"


def _shard(full: torch.Tensor, name: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's TP/expert-TP slice of a full (TP=1) tensor. Contiguous split along
    ``partition_dim``: right for this model (no gated linear unit; Megatron's fused QKV is grouped
    per query group, so a contiguous split is the TP split); a SwiGLU ``linear_fc1`` would need the
    [gate; up] halves split separately."""
    from megatron.core import parallel_state as ps

    if getattr(param, "tensor_model_parallel", False):
        if ".experts." in name:
            rank = ps.get_expert_tensor_parallel_rank()
            world = ps.get_expert_tensor_parallel_world_size()
        else:
            rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        full = full.chunk(world, dim=param.partition_dim)[rank]
    assert full.shape == param.shape, (name, full.shape, param.shape)
    return full


def _full_state(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _load(model, full: dict) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_shard(full[_global_name(name)], name, param))


def _max_param_diff(model, full: dict) -> float:
    return max(
        (p.detach().float() - _shard(full[_global_name(n)], n, p)).abs().max().item()
        for n, p in model.named_parameters()
    )


def _max_update(before: dict, after: dict) -> float:
    return max((after[n] - before[n]).abs().max().item() for n in before)


def _replica_max_diff(model, group, name_filter) -> float:
    """Largest difference of a parameter between the ranks of ``group`` (0.0 if in sync)."""
    import torch.distributed as dist

    worst = 0.0
    for name, param in model.named_parameters():
        if not name_filter(name):
            continue
        mine = param.detach().float().clone()
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        worst = max(worst, (high - low).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------
# 1-process job
# ---------------------------------------------------------------------------------------------
def _one_process_job(rank: int, port: int, out_dir: str) -> None:
    record = Recorder(out_dir, rank)
    cpu_compat.init_distributed_cpu(1, rank, master_port=port, seed=SEED)
    record.run("rng", _check_rng, record)
    record.run("fp32", _check_single_fp32, record)
    record.run("bf16", _check_single_bf16, record)
    record.run("idempotent", _check_idempotent, record)
    cpu_compat.destroy_distributed_cpu()


def _check_rng(record) -> None:
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(SEED)
    outside = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    untouched = torch.equal(outside, torch.get_rng_state())
    with get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    model_parallel_cuda_manual_seed(SEED)
    with get_cuda_rng_tracker().fork():
        replay = torch.rand(4)
    record(
        "rng",
        cpu_rng_untouched_by_fork=untouched,
        stream_advances=not torch.equal(first, second),
        reseed_replays=torch.equal(first, replay),
    )


def _check_single_fp32(record) -> None:
    """fp32, GPU-style init (RNG-tracker forks), aux loss, alltoall, overlapped DDP, Adam, and the
    pipeline schedule (forward_backward_no_pipelining) with 2 micro-batches."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    cfg = _config(torch.float32, aux=1e-2, cpu_init=False)
    model, module = _build(cfg)
    ddp, opt = _ddp_and_optimizer(cfg, module, optimizer="adam", lr=1e-3, overlap=True)
    cfg.finalize_model_grads_func = finalize_model_grads
    before = _full_state(model)
    positions = torch.arange(SEQ).expand(MBS, SEQ)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens, positions, None, labels=tokens)
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([_batch(0, 0), _batch(0, 1)]),
        model=[ddp],
        num_microbatches=2,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=False,
    )
    ok, grad_norm, _ = opt.step()
    after = _full_state(model)
    metrics: dict = {}
    track_moe_metrics(
        loss_scale=1.0,
        iteration=1,
        total_loss_dict=metrics,
        force_initialize=True,
        track_names=["load_balancing_loss"],
        num_layers=LAYERS,
    )
    record(
        "fp32",
        loss=[float(x["lm loss"]) for x in losses],
        step_ok=ok,
        grad_norm=float(grad_norm),
        params=len(before),
        params_changed=sum(not torch.equal(before[n], after[n]) for n in before),
        load_balancing_loss=float(metrics["load_balancing_loss"]),
    )


def _check_single_bf16(record) -> None:
    """bf16 (Float16Module), allgather dispatcher, Adam, distributed optimizer."""
    cfg = _config(torch.bfloat16, dispatcher="allgather")
    model, module = _build(cfg)
    ddp, opt = _ddp_and_optimizer(cfg, module, optimizer="adam", lr=1e-2, dist_opt=True)
    before = _full_state(model)
    losses, ok, grad_norm = _train_step(ddp, opt, _batch(0, 0))
    after = _full_state(model)
    record(
        "bf16",
        loss=losses.mean().item(),
        loss_finite=bool(torch.isfinite(losses).all()),
        param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        step_ok=ok,
        grad_norm=grad_norm,
        params=len(before),
        params_changed=sum(not torch.equal(before[n], after[n]) for n in before),
    )


def _check_idempotent(record) -> None:
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.transformer.moe import moe_utils

    current_device = torch.cuda.current_device
    step = FP32Optimizer.step
    split = moe_utils.maybe_move_tensor_to_cpu
    again = cpu_compat.apply_cpu_shims()
    record(
        "idempotent",
        again=again,
        applied=cpu_compat.applied_shims(),
        same_functions=(
            torch.cuda.current_device is current_device
            and FP32Optimizer.step is step
            and moe_utils.maybe_move_tensor_to_cpu is split
        ),
        wrapped_once=not getattr(FP32Optimizer.step.__wrapped__, "__cpu_compat__", False),
        current_device=str(torch.cuda.current_device()),
    )


# ---------------------------------------------------------------------------------------------
# 2-process job
# ---------------------------------------------------------------------------------------------
def _two_process_job(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two workers on two cores
    record = Recorder(out_dir, rank)
    ckpt_dir = os.path.join(out_dir, "ckpt_ep2")
    ref = record.run("ref", _ref_fp32, record, rank, port)
    record.run("ep2_alltoall", _compare_fp32, record, "ep2_alltoall", ref, port, ep=2, ckpt_dir=ckpt_dir)
    record.run(
        "ep2_allgather", _compare_fp32, record, "ep2_allgather", ref, port, ep=2, dispatcher="allgather"
    )
    record.run("tp2_sp_ep1", _compare_fp32, record, "tp2_sp_ep1", ref, port, tp=2, load_ckpt=ckpt_dir)
    record.run("tp2_sp_ep2", _compare_fp32, record, "tp2_sp_ep2", ref, port, tp=2, ep=2, etp=1)
    record.run("expert_dp_fixed", _expert_dp, record, "expert_dp_fixed", ref, port, fix=True)
    record.run("expert_dp_unfixed", _expert_dp, record, "expert_dp_unfixed", ref, port, fix=False)
    record.run("adam_distopt", _adam_distopt, record, ref, port, os.path.join(out_dir, "ckpt_adam"))
    ref16 = record.run("ref_bf16", _run_bf16, record, "ref_bf16", None, ref, port)
    record.run("ep2_alltoall_bf16", _run_bf16, record, "ep2_alltoall_bf16", ref16, ref, port, ep=2)
    record.run("tp2_sp_bf16", _run_bf16, record, "tp2_sp_bf16", ref16, ref, port, tp=2)
    cpu_compat.destroy_distributed_cpu()


def _gather_losses(local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def _ref_fp32(record, rank: int, port: int) -> dict:
    """TP=1, EP=1 on 2 ranks (DP=2): rank r trains on batch r, 3 SGD steps."""
    cpu_compat.init_distributed_cpu(2, rank, master_port=port, seed=SEED)
    cfg = _config()
    model, module = _build(cfg)
    ref = {"sd0": _full_state(model), "losses": [], "grad_norms": []}
    ddp, opt = _ddp_and_optimizer(cfg, module)
    for step in range(3):
        losses, ok, grad_norm = _train_step(ddp, opt, _batch(step, rank))
        ref["losses"].append(_gather_losses(losses))
        ref["grad_norms"].append(grad_norm)
        ref[f"sd{step + 1}"] = _full_state(model)
    record(
        "ref",
        step_ok=ok,
        grad_norms=ref["grad_norms"],
        max_update=_max_update(ref["sd0"], ref["sd1"]),
        params_changed=sum(not torch.equal(ref["sd0"][n], ref["sd1"][n]) for n in ref["sd0"]),
        params=len(ref["sd0"]),
    )
    return ref


def _layout_batch(step: int, rank: int, tp: int) -> tuple[torch.Tensor, slice]:
    """Batch fed to this rank and the rows of the reference's global batch it corresponds to."""
    if tp == 2:  # one DP rank: both TP ranks see the whole global batch
        return _global_batch(step), slice(0, 2 * MBS)
    return _batch(step, rank), slice(rank * MBS, (rank + 1) * MBS)


def _compare_fp32(
    record, name, ref, port, *, tp=1, ep=1, etp=None, dispatcher="alltoall", ckpt_dir=None, load_ckpt=None
):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import broadcast_data

    rank = dist.get_rank()
    cpu_compat.init_distributed_cpu(2, rank, tp=tp, ep=ep, etp=etp, master_port=port, seed=SEED + 7)
    cfg = _config(tp=tp, ep=ep, etp=etp, dispatcher=dispatcher)
    model, module = _build(cfg)
    _load(model, ref["sd0"])
    ddp, opt = _ddp_and_optimizer(cfg, module)
    tokens, rows = _layout_batch(0, rank, tp)
    losses, ok, grad_norm = _train_step(ddp, opt, tokens)
    values = dict(
        step_ok=ok,
        loss_max_diff=(losses - ref["losses"][0][rows]).abs().max().item(),
        grad_norm=grad_norm,
        grad_norm_rel_diff=abs(grad_norm - ref["grad_norms"][0]) / ref["grad_norms"][0],
        param_max_diff=_max_param_diff(model, ref["sd1"]),
    )
    if ckpt_dir is not None:
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
        values["ckpt_saved"] = True
    if load_ckpt is not None:  # reshard EP=2 (TP=1) checkpoint into this TP=2+SP model
        state = dist_checkpointing.load(model.sharded_state_dict(), load_ckpt)
        model.load_state_dict(state)
        values["ckpt_load_param_max_diff"] = _max_param_diff(model, ref["sd1"])
    if tp == 2:  # tensor_parallel.broadcast_data (hard-coded .cuda()) over the TP group
        data = {"tokens": tokens if ps.get_tensor_model_parallel_rank() == 0 else None}
        got = broadcast_data(["tokens"], data if data["tokens"] is not None else {}, torch.int64)
        values["broadcast_ok"] = torch.equal(got["tokens"], tokens)
    record(name, **values)


def _expert_dp(record, name, ref, port, *, fix: bool):
    """TP=2+SP, expert-TP=1, EP=1: experts are replicated over an expert-DP group of 2."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    cpu_compat.init_distributed_cpu(2, rank, tp=2, ep=1, etp=1, master_port=port, seed=SEED)
    cfg = _config(tp=2, ep=1, etp=1)
    model, module = _build(cfg)
    _load(model, ref["sd0"])
    marked = megatron_fixes.mark_expert_params_for_expert_dp(model) if fix else 0
    ddp, opt = _ddp_and_optimizer(cfg, module)
    grad_norms = []
    for step in range(3):
        tokens, _ = _layout_batch(step, rank, 2)
        _, ok, grad_norm = _train_step(ddp, opt, tokens)
        grad_norms.append(grad_norm)
    expert_group = ps.get_expert_data_parallel_group()
    record(
        name,
        marked=marked,
        expert_dp_size=expert_group.size(),
        dense_dp_size=ps.get_data_parallel_world_size(),
        expert_replica_max_diff=_replica_max_diff(model, expert_group, lambda n: ".experts." in n),
        param_max_diff=_max_param_diff(model, ref["sd3"]),
        grad_norm_rel_diff=max(abs(g - r) / r for g, r in zip(grad_norms, ref["grad_norms"])),
    )


def _adam_distopt(record, ref, port, ckpt_dir):
    """EP=2 with Adam + distributed optimizer + overlapped grad reduce (gloo reduce-scatter), then
    a model+optimizer dist_checkpointing round trip."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    cpu_compat.init_distributed_cpu(2, rank, ep=2, master_port=port, seed=SEED)
    cfg = _config(ep=2)
    model, module = _build(cfg)
    _load(model, ref["sd0"])
    ddp, opt = _ddp_and_optimizer(cfg, module, optimizer="adam", lr=1e-3, dist_opt=True, overlap=True)

    def dense_state():  # torch AdamW state of the dense params (looked up again after loading)
        return opt.chained_optimizers[0].optimizer.state

    before = _full_state(model)
    losses, ok, grad_norm = _train_step(ddp, opt, _batch(0, rank))
    after = _full_state(model)
    # 0.16.1: the default 'fully_sharded_model_space' optimizer format fails ("ShardedTensor.
    # flattened_range is not supported"); 'dp_reshardable' works. Its loader copies into fp32 main
    # params that are views of the model params without torch.no_grad(), hence the no_grad.
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    os.makedirs(ckpt_dir, exist_ok=True)
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}, ckpt_dir
    )
    exp_avg = {id(p): s["exp_avg"].clone() for p, s in dense_state().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for state in dense_state().values():
        state["exp_avg"].zero_()
    model_sd = model.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, ckpt_dir)
    model.load_state_dict(loaded["model"])
    with torch.no_grad():
        opt.load_state_dict(loaded["optimizer"])
    restored = _full_state(model)
    record(
        "adam_distopt",
        ckpt_param_max_diff=max((restored[n] - after[n]).abs().max().item() for n in after),
        ckpt_exp_avg_restored=all(
            torch.equal(s["exp_avg"], exp_avg[id(p)]) for p, s in dense_state().items()
        ),
        step_ok=ok,
        loss_max_diff=(losses - ref["losses"][0][rank * MBS : (rank + 1) * MBS]).abs().max().item(),
        grad_norm_rel_diff=abs(grad_norm - ref["grad_norms"][0]) / ref["grad_norms"][0],
        params=len(before),
        params_changed=sum(not torch.equal(before[n], after[n]) for n in before),
        dense_replica_max_diff=_replica_max_diff(
            model, ps.get_data_parallel_group(), lambda n: ".experts." not in n
        ),
    )


def _run_bf16(record, name, ref16, ref, port, *, tp=1, ep=1):
    """bf16 with fp32 main params; the TP=1/EP=1 bf16 run is the reference of the others. Adam
    (lr 1e-2), because a clipped SGD update is mostly below bf16 resolution."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cpu_compat.init_distributed_cpu(2, rank, tp=tp, ep=ep, master_port=port, seed=SEED)
    cfg = _config(torch.bfloat16, tp=tp, ep=ep)
    model, module = _build(cfg)
    _load(model, ref["sd0"])
    ddp, opt = _ddp_and_optimizer(cfg, module, optimizer="adam", lr=1e-2)
    tokens, rows = _layout_batch(0, rank, tp)
    before = _full_state(model)
    losses, ok, grad_norm = _train_step(ddp, opt, tokens)
    after = _full_state(model)
    values = dict(
        step_ok=ok,
        grad_norm=grad_norm,
        params_changed=sum(not torch.equal(before[n], after[n]) for n in before),
        params=len(before),
        fp32_loss_max_diff=(losses - ref["losses"][0][rows]).abs().max().item(),
    )
    if ref16 is not None:
        values["loss_max_diff"] = (losses - ref16["losses"][rows]).abs().max().item()
        values["grad_norm_rel_diff"] = abs(grad_norm - ref16["grad_norm"]) / ref16["grad_norm"]
    record(name, **values)
    return {"losses": _gather_losses(losses), "grad_norm": grad_norm}


# ---------------------------------------------------------------------------------------------
# Fixtures: spawn the jobs once per module
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_proc(tmp_path_factory):
    return spawn(_one_process_job, 1, tmp_path_factory.mktemp("cpu_compat_1proc"), JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory):
    return spawn(_two_process_job, 2, tmp_path_factory.mktemp("cpu_compat_2proc"), JOB_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# Tests in this process (no shims applied here)
# ---------------------------------------------------------------------------------------------
def test_apply_is_a_no_op_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    applied = cpu_compat.applied_shims()
    assert cpu_compat.apply_cpu_shims() is False
    assert cpu_compat.applied_shims() == applied
    assert torch.cuda.current_device is current_device


def test_module_docstring_documents_every_shim():
    for name in cpu_compat.SHIM_NAMES:
        assert f"``{name}``" in cpu_compat.__doc__, name


def test_cuda_as_cpu_mode_maps_device_and_type():
    with cpu_compat.CudaAsCpuMode():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t and t.type() == "torch.FloatTensor"
        assert t.to("cuda", non_blocking=True).device.type == "cpu"
        assert t.to(torch.device("cuda"), torch.float64).dtype == torch.float64
        assert torch.tensor([1], device=torch.device("cuda", 0)).device.type == "cpu"
    with cpu_compat.CudaAsCpuMode(spell_type_as_cuda=True):
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_nested_wrapped_functions_keep_the_type_spelling_where_needed():
    inner = cpu_compat._with_cuda_as_cpu(lambda: torch.zeros(1).type(), spell_type_as_cuda=True)
    outer = cpu_compat._with_cuda_as_cpu(lambda: (torch.zeros(1, device="cuda").type(), inner()))
    assert outer() == ("torch.FloatTensor", "torch.cuda.FloatTensor")
    assert torch.zeros(1).type() == "torch.FloatTensor"


# ---------------------------------------------------------------------------------------------
# 1 process
# ---------------------------------------------------------------------------------------------
def test_single_process_rng_tracker_maps_cuda_rng_to_cpu(one_proc):
    (r,) = get(one_proc, "rng")
    assert r["cpu_rng_untouched_by_fork"] and r["stream_advances"] and r["reseed_replays"]


def test_single_process_fp32_schedule_ddp_adam(one_proc):
    (r,) = get(one_proc, "fp32")
    assert r["step_ok"] and len(r["loss"]) == 2
    assert all(3.0 < x < 7.0 for x in r["loss"])  # ~ln(128) = 4.85 at init
    assert r["grad_norm"] > 0
    assert r["params_changed"] == r["params"]
    assert r["load_balancing_loss"] > 0


def test_single_process_bf16_distributed_optimizer(one_proc):
    (r,) = get(one_proc, "bf16")
    assert r["loss_finite"] and 3.0 < r["loss"] < 7.0
    assert r["param_dtypes"] == ["torch.bfloat16"]
    assert r["step_ok"] and r["grad_norm"] > 0
    assert r["params_changed"] == r["params"]


def test_apply_cpu_shims_is_idempotent(one_proc):
    (r,) = get(one_proc, "idempotent")
    assert r["again"] is True
    assert r["applied"] == list(cpu_compat.SHIM_NAMES)
    assert r["same_functions"] and r["wrapped_once"]
    assert r["current_device"] == "cpu"


# ---------------------------------------------------------------------------------------------
# 2 processes
# ---------------------------------------------------------------------------------------------
def test_reference_tp1_ep1_trains(two_proc):
    for r in get(two_proc, "ref"):
        assert r["step_ok"] and r["params_changed"] == r["params"]
        assert r["max_update"] > 100 * FP32_PARAM_TOL  # so the parameter comparisons see a bad step


@pytest.mark.parametrize("check", ["ep2_alltoall", "ep2_allgather", "tp2_sp_ep1", "tp2_sp_ep2"])
def test_parallel_layout_matches_reference_fp32(two_proc, check):
    for r in get(two_proc, check):
        assert r["step_ok"]
        assert r["loss_max_diff"] <= FP32_LOSS_TOL
        assert r["grad_norm_rel_diff"] <= FP32_GNORM_RTOL
        assert r["param_max_diff"] <= FP32_PARAM_TOL


def test_dist_checkpoint_ep2_to_tp2_resharding(two_proc):
    assert all(r["ckpt_saved"] for r in get(two_proc, "ep2_alltoall"))
    for r in get(two_proc, "tp2_sp_ep1"):
        assert r["ckpt_load_param_max_diff"] <= FP32_PARAM_TOL


def test_broadcast_data_over_tp_group(two_proc):
    for check in ("tp2_sp_ep1", "tp2_sp_ep2"):
        assert all(r["broadcast_ok"] for r in get(two_proc, check))


def test_expert_dp_replicas_stay_in_sync_with_fix(two_proc):
    for r in get(two_proc, "expert_dp_fixed"):
        assert r["expert_dp_size"] == 2 and r["dense_dp_size"] == 1
        assert r["marked"] > 0
        assert r["expert_replica_max_diff"] == 0.0
        assert r["param_max_diff"] <= FP32_PARAM_TOL
        assert r["grad_norm_rel_diff"] <= FP32_GNORM_RTOL


@pytest.mark.skipif(
    not importlib.metadata.version("megatron-core").startswith("0.16."),
    reason="documents megatron-core 0.16.x behaviour",
)
def test_expert_dp_drift_without_fix_is_megatron_0_16_bug(two_proc):
    """Documents the Megatron 0.16.1 bug that mark_expert_params_for_expert_dp works around. If
    this starts failing after a Megatron upgrade, the upstream fix landed: drop the workaround."""
    for r in get(two_proc, "expert_dp_unfixed"):
        assert r["expert_replica_max_diff"] > 1e-3


def test_adam_distributed_optimizer_overlap_grad_reduce(two_proc):
    for r in get(two_proc, "adam_distopt"):
        assert r["step_ok"]
        assert r["loss_max_diff"] <= FP32_LOSS_TOL
        assert r["grad_norm_rel_diff"] <= FP32_GNORM_RTOL
        assert r["params_changed"] == r["params"]
        assert r["dense_replica_max_diff"] == 0.0
        assert r["ckpt_param_max_diff"] == 0.0 and r["ckpt_exp_avg_restored"]


@pytest.mark.parametrize("check", ["ep2_alltoall_bf16", "tp2_sp_bf16"])
def test_parallel_layout_matches_reference_bf16(two_proc, check):
    for r in get(two_proc, "ref_bf16"):
        assert r["step_ok"] and r["fp32_loss_max_diff"] <= BF16_LOSS_TOL
    for r in get(two_proc, check):
        assert r["step_ok"]
        assert r["params_changed"] == r["params"]
        assert r["loss_max_diff"] <= BF16_LOSS_TOL
        assert r["grad_norm_rel_diff"] <= BF16_GNORM_RTOL
