"""PolicyLoss plugged into the real PolicyWorker.train_step (one CPU rank, gloo): the (sum, count) contract."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.rl import BatchKeys, PolicyLoss, PolicyLossConfig, group_advantages
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig, PolicyWorker, PolicyWorkerConfig

# GPU GEMMs round differently per batch shape and flip near-tied MoE routes: exact on CPU only
cpu_exact = pytest.mark.skipif(torch.cuda.is_available(), reason="batch-shape-dependent GPU GEMM rounding")

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4, "moe_ffn_hidden_size": 32, "vocab_size": 48}


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    from megatron_quads.trainer.distributed import init_trainer_distributed

    init_trainer_distributed(1, 0, ParallelConfig())


def _worker(mbs: int) -> PolicyWorker:
    cfg = PolicyWorkerConfig(
        model=PolicyModelConfig(**MODEL, dtype="fp32"), optim=OptimConfig(optimizer="sgd", lr=0.5), micro_batch_size=mbs, seed=3
    )
    return PolicyWorker(cfg)


def _params(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    """Eight responses (two groups of four) with behaviour, rollout and reference log-probs."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab_size"], (8, 10), generator=g)
    mask = (torch.rand(8, 10, generator=g) > 0.3).float()
    mask[2] = 0.0  # a fully masked response
    logp_old = _worker(8).compute_logprobs(tokens)
    return {
        "tokens": tokens,
        "mask": mask,  # [b, s], aligned with tokens
        "advantages": group_advantages(torch.rand(8, generator=g).round(), group_size=4),
        "logp_old": logp_old,
        "logp_rollout": logp_old + 0.2 * torch.randn(8, 9, generator=g),
        "logp_ref": logp_old + 0.1 * torch.randn(8, 9, generator=g),
    }


@cpu_exact
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_train_step_does_not_depend_on_micro_batching(batch: dict[str, torch.Tensor], aggregation: str) -> None:
    cfg = PolicyLossConfig(aggregation=aggregation, kl_beta=0.1, dual_clip=3.0, correction={"mode": "token_tis", "c_high": 1.2})
    results = []
    for mbs in (8, 3):  # 3 leaves a ragged last micro-batch
        worker = _worker(mbs)
        results.append((worker.train_step(batch, PolicyLoss(cfg)), _params(worker)))
    (m0, p0) = results[0]
    assert m0["grad_norm"] > 0 and 0 < m0["is_truncated_frac"] < 1
    for metrics, params in results[1:]:
        assert abs(metrics["loss"] - m0["loss"]) < 1e-6
        assert abs(metrics["grad_norm"] - m0["grad_norm"]) < 1e-5 * m0["grad_norm"]
        assert max(float((params[k] - p0[k]).abs().max()) for k in p0) < 1e-6


@cpu_exact
def test_fully_masked_batch_is_a_no_op(batch: dict[str, torch.Tensor]) -> None:
    worker = _worker(3)
    before = _params(worker)
    metrics = worker.train_step({**batch, "mask": torch.zeros(8, 10)}, PolicyLoss(PolicyLossConfig(correction={"mode": "seq_mis"})))
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in _params(worker).items())


def test_on_policy_keys(batch: dict[str, torch.Tensor]) -> None:
    on_policy = {k: batch[k] for k in ("tokens", "mask", "advantages")}
    metrics = _worker(3).train_step(on_policy, PolicyLoss(keys=BatchKeys(logp_old=None)))
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0
