"""Router replay (R3): the built-in engine records each token's experts, the Megatron trainer replays
them (CPU, fp32, one rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.controller.batch import build_batch
from megatron_quads.precision import Precision
from megatron_quads.rollout.routing import routing_batch
from megatron_quads.rollout.engine import Generation, SamplingParams
from megatron_quads.rollout.routing import recording
from megatron_quads.rollout.torch_engine import TorchRolloutEngine
from megatron_quads.trainer.hf_export import qwen3_moe_config
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig, PolicyWorker, PolicyWorkerConfig

pytest.importorskip("transformers")

MODEL = PolicyModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=8, moe_ffn_hidden_size=32,
                          vocab_size=48, dtype="fp32", init_method_std=0.1)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13], [14]] * 4
PARAMS = SamplingParams(max_new_tokens=6, seed=1, stop_token_ids=(3,), return_routed_experts=True)


@pytest.fixture(scope="module")
def worker() -> PolicyWorker:
    """An AQAT trainer rank whose routers replay (the w4a16 engine computes what it computes)."""
    from megatron_quads.trainer.distributed import init_trainer_distributed

    init_trainer_distributed(1, 0, ParallelConfig())
    return PolicyWorker(PolicyWorkerConfig(model=MODEL, seed=3, micro_batch_size=len(PROMPTS), router_replay=True,
                                           optim=OptimConfig(optimizer="sgd", lr=0.5)))


def _rollout(worker: PolicyWorker, precision: str) -> tuple[list[Generation], dict[str, torch.Tensor]]:
    engine = TorchRolloutEngine(qwen3_moe_config(MODEL), precision=Precision.parse(precision), dtype=torch.float32)
    engine.load_weights(dict(worker.export_hf_weights()), version=0)
    generations = engine.generate(PROMPTS, PARAMS)
    return generations, build_batch(PROMPTS, generations, pad_id=0)


def _trainer_routing(worker: PolicyWorker, tokens: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
    """The experts every Megatron router chose, ``[b, s, layers, num_experts]`` (bool): its own top-k
    (``routed`` None: Megatron's RECORD action) or the replayed ones."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    maps = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: maps.append(out[1].detach().clone()))
             for layer in worker.model.decoder.layers]
    try:
        if routed is None:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            with torch.no_grad():
                worker.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            RouterReplay.clear_global_router_replay_action()
        else:
            worker.compute_logprobs(tokens, routed_experts=routed)
    finally:
        for hook in hooks:
            hook.remove()
    b, s = tokens.shape
    return torch.stack([m.view(s, b, -1).transpose(0, 1) for m in maps], dim=2)


def _agreement(generations: list[Generation], trainer_map: torch.Tensor) -> tuple[int, int]:
    """(routed (position, layer) pairs where the trainer chose the engine's experts, all such pairs)."""
    same = total = 0
    for i, g in enumerate(generations):
        rows = g.routed_experts.shape[0]
        engine_map = torch.zeros_like(trainer_map[i, :rows]).scatter_(2, g.routed_experts.long(), True)
        same += int((engine_map == trainer_map[i, :rows]).all(-1).sum())
        total += engine_map.shape[0] * engine_map.shape[1]
    return same, total


def _natural_routing(worker: PolicyWorker, tokens: torch.Tensor) -> torch.Tensor:
    """The trainer's own top-k ``[b, s, layers, k]`` from Megatron's RECORD action."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            worker.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        recorded = RouterReplay.get_recorded_data()
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    b, s = tokens.shape
    return torch.stack([r.view(s, b, -1).transpose(0, 1) for r in recorded], dim=2).to(torch.int16)


def test_engine_routing_rows_are_the_routers_choices_for_every_fed_token(worker: PolicyWorker) -> None:
    """Batched, left-padded, KV-cached generation records what one unpadded forward of the same
    tokens routes: the prompt, then every response token but the last."""
    engine = TorchRolloutEngine(qwen3_moe_config(MODEL), precision=Precision("w4a4"), dtype=torch.float32)
    engine.load_weights(dict(worker.export_hf_weights()), version=0)
    generations = engine.generate(PROMPTS, PARAMS)
    assert any(g.finish_reason == "stop" for g in generations) and any(g.finish_reason == "length" for g in generations)
    for g in generations:
        fed = g.prompt_ids + g.token_ids[:-1]
        assert g.routed_experts.shape == (len(fed), MODEL.num_layers, MODEL.moe_router_topk)
        assert g.routed_experts.dtype == torch.int16
        with recording(engine.model) as recorder, torch.no_grad():
            engine.model(input_ids=torch.tensor([fed]))
            alone = recorder.take()
        assert torch.equal(g.routed_experts.sort(-1).values, alone.sort(-1).values)
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0].routed_experts is None


def test_under_r3_the_trainer_routes_every_token_to_the_rollouts_experts(worker: PolicyWorker) -> None:
    """W4A4 rollout: its experts differ from the AQAT trainer's own top-k on some tokens; replayed,
    the trainer's routers choose the rollout's experts token for token. W4A16 computes what the
    AQAT trainer computes, so there the two route alike without replay."""
    generations, batch = _rollout(worker, "w4a16")
    same, total = _agreement(generations, _trainer_routing(worker, batch["tokens"], None))
    assert same == total
    generations, batch = _rollout(worker, "w4a4")
    natural, total = _agreement(generations, _trainer_routing(worker, batch["tokens"], None))
    assert natural < total  # NVFP4 activations move near-tied routes
    replayed, total = _agreement(generations, _trainer_routing(worker, batch["tokens"], batch["routed_experts"]))
    assert replayed == total
    assert worker.routing_counts == (total, total - natural)  # what the controller logs as routing_disagreement


def test_replaying_the_trainers_own_routing_changes_nothing_and_other_experts_change_the_logprobs(worker: PolicyWorker) -> None:
    _, batch = _rollout(worker, "w4a16")
    tokens = batch["tokens"]
    natural = _natural_routing(worker, tokens)
    with torch.no_grad():
        logits = worker.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    own = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert torch.allclose(worker.compute_logprobs(tokens, routed_experts=natural), own, atol=1e-5, rtol=0)
    shifted = (natural + 1) % MODEL.num_experts
    assert (worker.compute_logprobs(tokens, routed_experts=shifted) - own).abs().max() > 1e-2


def test_a_train_step_replays_the_routing_and_trains_the_router(worker: PolicyWorker) -> None:
    generations, batch = _rollout(worker, "w4a4")
    routed = batch["routed_experts"]
    replayed = worker.compute_logprobs(batch["tokens"], routed_experts=routed)
    mask = batch["mask"][:, 1:]
    router_before = worker.model.decoder.layers[0].mlp.router.weight.detach().clone()

    def nll(logprobs: torch.Tensor, mb: dict) -> tuple:
        m = mb["mask"][:, 1:]
        return -(logprobs * m).sum(), m.sum(), {"nll": -logprobs * m}

    metrics = worker.train_step({"tokens": batch["tokens"], "mask": batch["mask"], "routed_experts": routed}, nll)
    assert metrics["nll"] == pytest.approx(float(-(replayed * mask).sum() / mask.sum()), rel=1e-5)
    assert not torch.equal(worker.model.decoder.layers[0].mlp.router.weight, router_before)


def test_bad_routing_is_refused_with_its_problem_named(worker: PolicyWorker) -> None:
    _, batch = _rollout(worker, "w4a16")
    tokens, routed = batch["tokens"], batch["routed_experts"]
    with pytest.raises(ValueError, match="needs routed_experts"):
        worker.compute_logprobs(tokens)
    with pytest.raises(ValueError, match=r"\[batch, sequence, MoE layers, moe_router_topk\]"):
        worker.compute_logprobs(tokens, routed_experts=routed[:, :, :1])
    with pytest.raises(ValueError, match="outside"):
        worker.compute_logprobs(tokens, routed_experts=routed + MODEL.num_experts)


def test_the_batch_fills_unrouted_positions_and_checks_each_generations_rows() -> None:
    routed = torch.tensor([[[4, 5]], [[6, 7]]], dtype=torch.int16)  # 2 positions, 1 layer, k=2
    generation = Generation(prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], routed_experts=routed)
    batch = build_batch([[1, 2], [1]], [generation, Generation([1], [2, 3, 4], [-1.0] * 3, routed_experts=routed.repeat(2, 1, 1)[:3])], 0)
    assert batch["routed_experts"].shape == (2, 4, 1, 2)
    assert batch["routed_experts"][0, :2].tolist() == routed.tolist()
    assert batch["routed_experts"][0, 2:].tolist() == [[[-1, -1]], [[-1, -1]]]  # the last token and padding
    with pytest.raises(ValueError, match="need 2"):
        routing_batch([Generation([1, 2], [3], [-0.5], routed_experts=routed[:1])], 3)
    with pytest.raises(ValueError, match="returned none"):
        routing_batch([generation, Generation([1], [2], [-0.5])], 3)
