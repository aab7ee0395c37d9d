"""QUADS policy workers under expert and tensor parallelism (2 spawned ranks, fp32): on CPU over gloo,
and on two GPUs over NCCL (``gpu`` marker; needs a machine with at least two CUDA devices).

One 2-rank job runs every layout in turn, reusing its processes:

1. reference: TP=1, EP=1 (data parallel 2), QUADS; saves a dist checkpoint, records per-token
   log-probs of a fixed global batch, takes one SGD step, records the exported weights;
2. EP=2; TP=2 + sequence parallel (expert-TP 2); TP=2 + SP with expert-TP=1 (expert-DP group of 2):
   each loads the reference checkpoint (Megatron's resharding), and records the same things, plus
   whether every fake-quantized shard equals ``quantize_dequantize(shard, amax of the full tensor)``;
3. checkpoints across QUADS and stock specs: the EP=2 QUADS model after its step is saved and loaded
   into a stock EP=1 model; the reference checkpoint is loaded into a stock model too.

Tolerances (fp32): log-probs 2e-5 absolute; weights after one SGD step (lr 0.5, grad-norm clip 1)
1e-6 absolute: the largest update is ~1e-2, so a missing gradient reduction or a wrong amax shows.
"""

from __future__ import annotations

import os

import pytest
import torch
from mp_harness import Recorder, get, spawn

WORLD = 2
MODEL = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=32,
    moe_router_topk=2, vocab_size=64, dtype="fp32", init_method_std=0.05,
)
GLOBAL_BATCH, SEQ = 8, 12
LOGPROB_TOL, WEIGHT_TOL = 2e-5, 1e-6
LAYOUTS = {
    "ep2": dict(expert_parallel=2),
    "tp2_sp": dict(tensor_parallel=2, sequence_parallel=True),
    "tp2_sp_etp1": dict(tensor_parallel=2, sequence_parallel=True, expert_tensor_parallel=1),
}


def _global_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ), generator=gen)


def _token_mean_nll(logprobs: torch.Tensor, mb: dict) -> tuple:
    return -logprobs.sum(), torch.tensor(logprobs.numel()), {"nll": -logprobs}


def _worker(parallel: dict, quads: bool, router_replay: bool = False):
    from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
    from megatron_quads.trainer.policy import (
        OptimConfig,
        PolicyWorker,
        PolicyWorkerConfig,
    )
    from megatron_quads.trainer.quads_config import QuadsTrainerConfig

    cfg = PolicyWorkerConfig(
        model=PolicyModelConfig(**MODEL),
        parallel=ParallelConfig(**parallel),
        quads=QuadsTrainerConfig(enabled=quads),
        optim=OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0),
        micro_batch_size=2,
        router_replay=router_replay,
    )
    return PolicyWorker(cfg)


def _global_routing() -> torch.Tensor:
    """Given experts for every token and layer of the global batch, ``[b, s, layers, k]`` (k distinct each)."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(GLOBAL_BATCH, SEQ, MODEL["num_layers"], MODEL["num_experts"], generator=gen)
    return scores.argsort(-1)[..., : MODEL["moe_router_topk"]].to(torch.int16)


def _local_batch(rank: int, batch: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the global batch: data-parallel ranks split it, TP ranks share it."""
    from megatron.core import parallel_state

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return (_global_batch() if batch is None else batch).chunk(dp_size)[dp_rank]


def _gather_logprobs(local: torch.Tensor) -> list:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).tolist()


def _fake_quant_uses_full_tensor_amax(worker, full: dict[str, torch.Tensor]) -> dict:
    """Every fake-quant expert shard equals quantize_dequantize(shard, amax of the full expert weight)."""
    from megatron.core import parallel_state

    from megatron_quads.nvfp4 import quantize_dequantize
    from megatron_quads.trainer.expert_linears import (
        FakeQuantColumnParallelLinear,
        FakeQuantRowParallelLinear,
    )

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    num_local = MODEL["num_experts"] // parallel_state.get_expert_model_parallel_world_size()
    checked = amax_differs = mismatched = 0
    for name, module in worker.model.named_modules():
        if not isinstance(module, (FakeQuantColumnParallelLinear, FakeQuantRowParallelLinear)):
            continue
        layer = int(name.split(".")[2])
        expert = ep_rank * num_local + int(name.split(".")[-2])
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        if name.endswith("linear_fc1"):
            hf = [full[f"{prefix}.gate_proj.weight"], full[f"{prefix}.up_proj.weight"]]
        else:
            hf = [full[f"{prefix}.down_proj.weight"]]
        amax = torch.stack([t.abs().max() for t in hf]).max()
        shard = module.weight.detach()
        amax_differs += int(shard.abs().max() != amax)
        mismatched += int(not torch.equal(module.quantized_weight(), quantize_dequantize(shard, global_amax=amax)))
        checked += 1
    return {"checked": checked, "mismatched": mismatched, "shards_with_smaller_local_amax": amax_differs}


def _export(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.export_hf_weights()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _rollout_payload_check(worker, full: dict[str, torch.Tensor]) -> dict:
    """This rank's weight-sync payload against today's whole-model quantization of the full export:
    which sender it is, which experts it sends, and how many of its tensors differ by a byte."""
    import re

    from megatron_quads.controller.rollout_export import export_rollout_tensors
    from megatron_quads.rollout.weights import quantize_hf_weights, routed_expert_scope
    from megatron_quads.trainer.hf_export import weight_sender

    payload = export_rollout_tensors(worker.model, "nvfp4", torch.float32)
    sender = weight_sender()
    if payload is None:
        return {"sender": None}
    expected = quantize_hf_weights(full.items(), routed_expert_scope(), unquantized_dtype=torch.float32).state_dict()

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    stack = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)-(\d+)\.(gate_up_proj|down_proj)\.(\w+)$")
    got, experts = {}, set()
    for name, tensor in payload.items():
        match = stack.match(name)
        if match is None:
            got[name] = tensor
            continue
        base, first, last, projection, leaf = match.groups()
        for i, e in enumerate(range(int(first), int(last) + 1)):
            experts.add(e)
            if projection == "down_proj":
                got[f"{base}.{e}.down_proj.{leaf}"] = tensor[i]
            elif leaf in ("weight_scale_2", "residual_channels"):  # shared by gate and up
                got[f"{base}.{e}.gate_proj.{leaf}"] = got[f"{base}.{e}.up_proj.{leaf}"] = tensor[i]
            else:
                gate, up = tensor[i].chunk(2)
                got[f"{base}.{e}.gate_proj.{leaf}"], got[f"{base}.{e}.up_proj.{leaf}"] = gate, up
    differ = [n for n, t in got.items() if t.dtype != expected[n].dtype or not torch.equal(raw(t), raw(expected[n]))]
    dense = sorted(n for n in got if ".mlp.experts." not in n)
    return {"sender": list(sender), "experts": sorted(experts), "dense": dense, "differ": differ[:5],
            "compared": len(got), "expected_dense": sorted(n for n in expected if ".mlp.experts." not in n)}


def _job(rank: int, port: int, out_dir: str) -> None:
    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import ParallelConfig

    record = Recorder(out_dir, rank)
    ckpt_ref, ckpt_ep2 = os.path.join(out_dir, "ckpt_ref"), os.path.join(out_dir, "ckpt_ep2")

    def layout(name: str, parallel: dict, quads: bool = True):
        init_trainer_distributed(WORLD, rank, ParallelConfig(**parallel), master_port=port, seed=5)
        return _worker(parallel, quads)

    # 1. reference
    ref = record.run("reference", layout, "reference", {})
    ref.save_checkpoint(ckpt_ref)
    ref_full = _export(ref)
    ref_logprobs = ref.compute_logprobs(_local_batch(rank))
    ref_metrics = ref.train_step({"tokens": _local_batch(rank)}, _token_mean_nll)
    ref_after = _export(ref)
    import torch.distributed as dist

    record("reference", logprobs=_gather_logprobs(ref_logprobs), metrics=ref_metrics,
           update=_max_diff(ref_after, ref_full), backend=dist.get_backend(),
           device=str(next(ref.model.parameters()).device))

    # 2. the parallel layouts, from the reference checkpoint
    for name, parallel in LAYOUTS.items():
        def check(name=name, parallel=parallel):
            worker = layout(name, parallel)
            worker.load_checkpoint(ckpt_ref)
            loaded = _export(worker)
            fq = _fake_quant_uses_full_tensor_amax(worker, loaded)
            payload = _rollout_payload_check(worker, loaded)
            logprobs = worker.compute_logprobs(_local_batch(rank))
            metrics = worker.train_step({"tokens": _local_batch(rank)}, _token_mean_nll)
            after = _export(worker)
            if name == "ep2":
                worker.save_checkpoint(ckpt_ep2)
            record(
                name, loaded_diff=_max_diff(loaded, ref_full), fake_quant=fq, payload=payload,
                logprob_diff=max(abs(a - b) for ra, rb in zip(_gather_logprobs(logprobs), record.results["reference"]["logprobs"]) for a, b in zip(ra, rb)),
                metrics=metrics, after_diff=_max_diff(after, ref_after),
            )
            return after

        after = record.run(name, check)
        if name == "ep2":
            ep2_after = after

    # 3. QUADS <-> stock checkpoints, EP=2 -> EP=1
    def cross_spec():
        stock = layout("stock", {}, quads=False)
        stock.load_checkpoint(ckpt_ep2)
        from_ep2 = _max_diff(_export(stock), ep2_after)
        stock.load_checkpoint(ckpt_ref)
        from_ref = _max_diff(_export(stock), ref_full)
        record("cross_spec", quads_ep2_to_stock_ep1=from_ep2, quads_ref_to_stock=from_ref)

    record.run("cross_spec", cross_spec)

    # 4. router replay: every layout replays the same given experts, each rank its own rows
    for name, parallel in {"reference": {}, **LAYOUTS}.items():
        def replay(name=name, parallel=parallel):
            init_trainer_distributed(WORLD, rank, ParallelConfig(**parallel), master_port=port, seed=5)
            worker = _worker(parallel, quads=True, router_replay=True)
            worker.load_checkpoint(ckpt_ref)
            logprobs = worker.compute_logprobs(_local_batch(rank), routed_experts=_local_batch(rank, _global_routing()))
            record(f"replay_{name}", logprobs=_gather_logprobs(logprobs))

        record.run(f"replay_{name}", replay)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs (one per rank, NCCL)")


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, TWO_GPUS])])
def job(request, tmp_path_factory) -> dict:
    """The job's records on CPU ranks over gloo (CUDA hidden from them), or one GPU per rank over NCCL."""
    hidden = request.param == "gloo"
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden:  # spawned ranks inherit the environment: they see no GPU and take the gloo path
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        records = spawn(_job, WORLD, tmp_path_factory.mktemp(f"quads_dist_{request.param}"), timeout_s=400)
        return {**records, "backend": request.param}
    finally:
        if hidden:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


def test_the_ranks_run_on_the_backend_and_devices_asked_for(job: dict) -> None:
    records = get(job, "reference")
    assert [r["backend"] for r in records] == [job["backend"]] * WORLD
    expected = ["cpu"] * WORLD if job["backend"] == "gloo" else [f"cuda:{rank}" for rank in range(WORLD)]
    assert [r["device"] for r in records] == expected


def test_reference_step_updates_weights(job: dict) -> None:
    for r in get(job, "reference"):
        assert r["update"] > 1e-3
        assert r["metrics"]["update_successful"] == 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_reference(job: dict, layout: str) -> None:
    ref = get(job, "reference")[0]
    for r in get(job, layout):
        assert r["loaded_diff"] == 0.0, "the reference checkpoint must reshard exactly"
        assert r["logprob_diff"] < LOGPROB_TOL
        assert abs(r["metrics"]["nll"] - ref["metrics"]["nll"]) < LOGPROB_TOL
        assert abs(r["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) < 1e-5 * ref["metrics"]["grad_norm"]
        assert r["after_diff"] < WEIGHT_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_fake_quantizes_with_the_full_tensor_scale(job: dict, layout: str) -> None:
    for r in get(job, layout):
        fq = r["fake_quant"]
        assert fq["checked"] > 0 and fq["mismatched"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_expert_parallel_rank_sends_its_own_experts_as_todays_quantization(job: dict, layout: str) -> None:
    """One sender per EP rank (expert-TP and expert-DP rank 0), each with its own experts only;
    sender 0 adds every other tensor; every tensor is byte for byte the whole-model quantization."""
    payloads = [r["payload"] for r in get(job, layout)]
    ep = LAYOUTS[layout].get("expert_parallel", 1)
    senders = [p for p in payloads if p["sender"] is not None]
    assert sorted(tuple(p["sender"]) for p in senders) == [(i, ep) for i in range(ep)]
    per_rank = MODEL["num_experts"] // ep
    for p in senders:
        index = p["sender"][0]
        assert p["experts"] == list(range(index * per_rank, (index + 1) * per_rank))
        assert p["differ"] == [] and p["compared"] > 6 * per_rank
        assert p["dense"] == (p["expected_dense"] if index == 0 else [])


def test_tensor_parallel_shards_need_the_amax_reduction(job: dict) -> None:
    # under expert-TP 2 some shards do not hold their tensor's amax: the all-reduce is exercised
    assert sum(r["fake_quant"]["shards_with_smaller_local_amax"] for r in get(job, "tp2_sp")) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_router_replay_gives_every_layout_the_same_logprobs(job: dict, layout: str) -> None:
    """Under sequence parallelism each TP rank replays its own chunk of the sequence; under EP
    every rank routes its tokens before dispatch: the replayed log-probs equal the one-layout ones."""
    ref = get(job, "replay_reference")[0]["logprobs"]
    natural = get(job, "reference")[0]["logprobs"]
    assert max(abs(a - b) for ra, rb in zip(ref, natural) for a, b in zip(ra, rb)) > 1e-2  # the replay acted
    for r in get(job, f"replay_{layout}"):
        assert max(abs(a - b) for ra, rb in zip(r["logprobs"], ref) for a, b in zip(ra, rb)) < LOGPROB_TOL


def test_quads_checkpoints_load_into_stock_models_across_layouts(job: dict) -> None:
    for r in get(job, "cross_spec"):
        assert r["quads_ep2_to_stock_ep1"] == 0.0
        assert r["quads_ref_to_stock"] == 0.0
