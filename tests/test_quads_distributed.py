"""QUADS policy workers under expert and tensor parallelism (2 spawned ranks, fp32): on CPU over gloo,
and on two GPUs over NCCL (``gpu`` marker; needs a machine with at least two CUDA devices).

One 2-rank job runs every layout in turn, reusing its processes:

1. reference: TP=1, EP=1 (data parallel 2), QUADS; saves a dist checkpoint, records per-token
   log-probs of a fixed global batch, takes one SGD step, records the exported weights; then, from
   the checkpoint again, the same on a batch of odd sequence length (17: TP 2 does not divide it);
2. EP=2; TP=2 + sequence parallel (expert-TP 2); TP=2 + SP with expert-TP=1 (expert-DP group of 2):
   each loads the reference checkpoint (Megatron's resharding), and records the same things, plus
   whether every fake-quantized shard equals ``quantize_dequantize(shard, amax of the full tensor)``;
3. checkpoints across QUADS and stock specs: the EP=2 QUADS model after its step is saved and loaded
   into a stock EP=1 model; the reference checkpoint is loaded into a stock model too;
4. router replay, every layout from the reference checkpoint: log-probs of both batches, then
   routing counts and one step on the odd-length batch;
5. with Megatron's MoE load-balancing loss, the reference and TP=2 + SP take one step on the whole
   odd-length batch from the reference checkpoint.

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
ODD_SEQ = 17
"""A length no TP size above 1 divides: sequence parallelism needs the worker to pad it."""
AUX_LOSS_COEFF = 0.5
LOGPROB_TOL, WEIGHT_TOL = 2e-5, 1e-6
LAYOUTS = {
    "ep2": dict(expert_parallel=2),
    "tp2_sp": dict(tensor_parallel=2, sequence_parallel=True),
    "tp2_sp_etp1": dict(tensor_parallel=2, sequence_parallel=True, expert_tensor_parallel=1),
}


def _global_batch(seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, seq), generator=gen)


def _token_mean_nll(logprobs: torch.Tensor, mb: dict) -> tuple:
    return -logprobs.sum(), torch.tensor(logprobs.numel()), {"nll": -logprobs}


def _worker(parallel: dict, quads: bool, router_replay: bool = False, aux_loss_coeff: float = 0.0):
    from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
    from megatron_quads.trainer.policy import (
        OptimConfig,
        PolicyWorker,
        PolicyWorkerConfig,
    )
    from megatron_quads.trainer.quads_config import QuadsTrainerConfig

    cfg = PolicyWorkerConfig(
        model=PolicyModelConfig(**MODEL, moe_aux_loss_coeff=aux_loss_coeff),
        parallel=ParallelConfig(**parallel),
        quads=QuadsTrainerConfig(enabled=quads),
        optim=OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0),
        micro_batch_size=2,
        router_replay=router_replay,
    )
    return PolicyWorker(cfg)


def _global_routing(seq: int = SEQ) -> torch.Tensor:
    """Given experts for every token and layer of the global batch, ``[b, s, layers, k]`` (k distinct
    each); at the odd length each sequence's last position is not routed, as a rollout returns it."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(GLOBAL_BATCH, seq, MODEL["num_layers"], MODEL["num_experts"], generator=gen)
    routing = scores.argsort(-1)[..., : MODEL["moe_router_topk"]].to(torch.int16)
    if seq == ODD_SEQ:
        routing[:, -1] = -1
    return routing


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


def _logprob_diff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


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
    from megatron_quads.rollout.quantize_model import quantize_hf_weights
    from megatron_quads.rollout.scopes import routed_expert_scope
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
    ref_logprobs, ref_entropy = ref.compute_logprobs_and_entropy(_local_batch(rank))
    ref_metrics = ref.train_step({"tokens": _local_batch(rank)}, _token_mean_nll)
    ref_after = _export(ref)
    import torch.distributed as dist

    record("reference", logprobs=_gather_logprobs(ref_logprobs), entropy=_gather_logprobs(ref_entropy), metrics=ref_metrics,
           update=_max_diff(ref_after, ref_full), backend=dist.get_backend(),
           device=str(next(ref.model.parameters()).device))

    def odd_length(worker) -> tuple[list, dict, dict[str, torch.Tensor]]:
        """From the reference checkpoint: log-probs of the odd-length batch, a step on it, the weights after."""
        worker.load_checkpoint(ckpt_ref)
        logprobs = worker.compute_logprobs(_local_batch(rank, _global_batch(ODD_SEQ)))
        metrics = worker.train_step({"tokens": _local_batch(rank, _global_batch(ODD_SEQ))}, _token_mean_nll)
        return _gather_logprobs(logprobs), metrics, _export(worker)

    ref_odd_logprobs, ref_odd_metrics, ref_odd_after = record.run("reference_odd", odd_length, ref)
    record("reference_odd", logprobs=ref_odd_logprobs, metrics=ref_odd_metrics,
           update=_max_diff(ref_odd_after, ref_full))

    # 2. the parallel layouts, from the reference checkpoint
    for name, parallel in LAYOUTS.items():
        def check(name=name, parallel=parallel):
            worker = layout(name, parallel)
            worker.load_checkpoint(ckpt_ref)
            loaded = _export(worker)
            fq = _fake_quant_uses_full_tensor_amax(worker, loaded)
            payload = _rollout_payload_check(worker, loaded)
            logprobs, entropy = worker.compute_logprobs_and_entropy(_local_batch(rank))
            metrics = worker.train_step({"tokens": _local_batch(rank)}, _token_mean_nll)
            after = _export(worker)
            if name == "ep2":
                worker.save_checkpoint(ckpt_ep2)
            odd_logprobs, odd_metrics, odd_after = odd_length(worker)
            record(
                name, loaded_diff=_max_diff(loaded, ref_full), fake_quant=fq, payload=payload,
                logprob_diff=_logprob_diff(_gather_logprobs(logprobs), record.results["reference"]["logprobs"]),
                entropy_diff=_logprob_diff(_gather_logprobs(entropy), record.results["reference"]["entropy"]),
                metrics=metrics, after_diff=_max_diff(after, ref_after),
                odd_logprob_diff=_logprob_diff(odd_logprobs, ref_odd_logprobs), odd_metrics=odd_metrics,
                odd_after_diff=_max_diff(odd_after, ref_odd_after),
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

    # 4. router replay: every layout replays the same given experts, each rank its own rows; then the
    #    odd-length batch: log-probs, routing counts and a step, all under replay
    replay_ref_odd_after: dict[str, torch.Tensor] = {}
    for name, parallel in {"reference": {}, **LAYOUTS}.items():
        def replay(name=name, parallel=parallel):
            init_trainer_distributed(WORLD, rank, ParallelConfig(**parallel), master_port=port, seed=5)
            worker = _worker(parallel, quads=True, router_replay=True)
            worker.load_checkpoint(ckpt_ref)
            logprobs = worker.compute_logprobs(_local_batch(rank), routed_experts=_local_batch(rank, _global_routing()))
            odd = {"tokens": _local_batch(rank, _global_batch(ODD_SEQ)),
                   "routed_experts": _local_batch(rank, _global_routing(ODD_SEQ))}
            odd_logprobs = worker.compute_logprobs(odd["tokens"], routed_experts=odd["routed_experts"])
            counts = worker.routing_counts
            odd_metrics = worker.train_step(odd, _token_mean_nll)
            odd_after = _export(worker)
            if name == "reference":
                replay_ref_odd_after.update(odd_after)
            record(f"replay_{name}", logprobs=_gather_logprobs(logprobs), odd_logprobs=_gather_logprobs(odd_logprobs),
                   routing_counts=list(counts), odd_metrics=odd_metrics,
                   odd_after_diff=_max_diff(odd_after, replay_ref_odd_after),
                   odd_update=_max_diff(odd_after, ref_full))

        record.run(f"replay_{name}", replay)

    # 5. MoE load-balancing loss on the odd-length batch: every data-parallel rank of the reference
    #    steps on the whole batch (the balancing statistics are per replica), as TP 2's one replica does
    aux_after: dict[str, dict[str, torch.Tensor]] = {}
    for name, parallel in {"reference": {}, "tp2_sp": LAYOUTS["tp2_sp"]}.items():
        def aux_loss(name=name, parallel=parallel):
            init_trainer_distributed(WORLD, rank, ParallelConfig(**parallel), master_port=port, seed=5)
            worker = _worker(parallel, quads=True, aux_loss_coeff=AUX_LOSS_COEFF)
            worker.load_checkpoint(ckpt_ref)
            metrics = worker.train_step({"tokens": _global_batch(ODD_SEQ)}, _token_mean_nll)
            aux_after[name] = _export(worker)
            record(f"aux_{name}", metrics=metrics, after_diff=_max_diff(aux_after[name], aux_after["reference"]),
                   after_diff_without_aux=_max_diff(aux_after[name], ref_odd_after))

        record.run(f"aux_{name}", aux_loss)


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
        # the vocabulary split over TP ranks: the entropy's max and sums are reduced across them
        assert r["entropy_diff"] < LOGPROB_TOL
        assert abs(r["metrics"]["nll"] - ref["metrics"]["nll"]) < LOGPROB_TOL
        assert abs(r["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) < 1e-5 * ref["metrics"]["grad_norm"]
        assert r["after_diff"] < WEIGHT_TOL


def _assert_step_matches(metrics: dict, ref: dict) -> None:
    assert metrics["update_successful"] == 1.0
    assert abs(metrics["nll"] - ref["nll"]) < LOGPROB_TOL
    assert abs(metrics["grad_norm"] - ref["grad_norm"]) < 1e-5 * ref["grad_norm"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sequence_length_tp_does_not_divide_gives_the_reference_logprobs_and_step(job: dict, layout: str) -> None:
    """On the odd-length batch (sequence parallelism pads it inside the worker) the log-probs, the
    loss, the gradient norm and the weights after one step equal the one-layout reference's."""
    ref = get(job, "reference_odd")[0]
    assert ref["update"] > 1e-3 and len(ref["logprobs"][0]) == ODD_SEQ - 1
    for r in get(job, layout):
        assert r["odd_logprob_diff"] < LOGPROB_TOL
        _assert_step_matches(r["odd_metrics"], ref["metrics"])
        assert r["odd_after_diff"] < WEIGHT_TOL


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_router_replay_at_a_length_tp_does_not_divide_matches_the_reference(job: dict, layout: str) -> None:
    """Under replay on the odd-length batch: the log-probs, the step and the weights after it equal
    the one-layout reference's, and the routed (token, layer) pairs counted over all ranks are the
    batch's routed ones: the positions the worker added are not counted."""
    ref = get(job, "replay_reference")
    routing = _global_routing(ODD_SEQ)
    routed = int((routing != -1).all(-1).sum())
    assert sum(r["routing_counts"][0] for r in ref) == routed
    assert ref[0]["odd_update"] > 1e-3
    ref_differ = sum(r["routing_counts"][1] for r in ref)
    assert ref_differ > 0  # the replayed experts are not the routers' own: the count can tell
    records = get(job, f"replay_{layout}")
    assert sum(r["routing_counts"][0] for r in records) == routed
    assert sum(r["routing_counts"][1] for r in records) == ref_differ
    for r in records:
        assert _logprob_diff(r["odd_logprobs"], ref[0]["odd_logprobs"]) < LOGPROB_TOL
        _assert_step_matches(r["odd_metrics"], ref[0]["odd_metrics"])
        assert r["odd_after_diff"] < WEIGHT_TOL


def test_the_load_balancing_loss_leaves_the_added_positions_out(job: dict) -> None:
    """With Megatron's MoE auxiliary loss on, TP 2's step on the odd-length batch (padded inside the
    worker, the added positions marked as padding) equals the reference's, which pads nothing."""
    ref = get(job, "aux_reference")[0]
    assert ref["after_diff_without_aux"] > 10 * WEIGHT_TOL  # the auxiliary loss moved the weights
    for r in get(job, "aux_tp2_sp"):
        _assert_step_matches(r["metrics"], ref["metrics"])
        assert r["after_diff"] < WEIGHT_TOL
