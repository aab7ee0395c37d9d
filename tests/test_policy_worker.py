"""The policy worker on one rank: log-probs, train step, micro-batching, checkpoints (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.trainer import entropy as entropy_module
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import (
    OptimConfig,
    PolicyWorker,
    PolicyWorkerConfig,
    token_logprobs,
)

# On a GPU, GEMMs of different batch shapes round differently, which flips near-tied MoE routes of a
# randomly initialised router: exact comparisons across batch shapes hold on CPU only.
cpu_exact = pytest.mark.skipif(torch.cuda.is_available(), reason="batch-shape-dependent GPU GEMM rounding flips MoE routes")

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=32, vocab_size=48)


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    from megatron_quads.trainer.distributed import init_trainer_distributed

    init_trainer_distributed(1, 0, ParallelConfig())


def _worker(dtype: str = "fp32", optimizer: str = "sgd", lr: float = 0.5, mbs: int = 2, seed: int = 3,
            **schedule) -> PolicyWorker:
    cfg = PolicyWorkerConfig(
        model=PolicyModelConfig(**MODEL, dtype=dtype),
        optim=OptimConfig(optimizer=optimizer, lr=lr, **schedule),
        micro_batch_size=mbs,
        seed=seed,
    )
    return PolicyWorker(cfg)


def _batch(n: int = 8, seq: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (n, seq), generator=torch.Generator().manual_seed(seed))


def _nll(logprobs: torch.Tensor, mb: dict) -> tuple:
    mask = mb["mask"][:, 1:] if "mask" in mb else torch.ones_like(logprobs)
    return -(logprobs * mask).sum(), mask.sum(), {"nll": -logprobs * mask}


def _params(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


@cpu_exact
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_log_softmax_of_the_model_logits(temperature: float) -> None:
    worker = _worker()
    tokens = _batch(3)
    with torch.no_grad():
        on_device = tokens.to(worker.device)
        logits = worker.ddp(on_device, torch.arange(10, device=worker.device).expand(3, 10), None).cpu()
    expected = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    got = worker.compute_logprobs(tokens, temperature=temperature)
    assert got.shape == (3, 9) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(token_logprobs(logits, tokens, temperature), expected, atol=1e-5)


@cpu_exact
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_is_that_of_the_distribution_the_logprobs_come_from(temperature: float,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _worker()
    tokens = _batch(3)
    with torch.no_grad():
        on_device = tokens.to(worker.device)
        logits = worker.ddp(on_device, torch.arange(10, device=worker.device).expand(3, 10), None).cpu()
    expected = torch.distributions.Categorical(logits=logits[:, :-1].double() / temperature).entropy()
    monkeypatch.setattr(entropy_module, "ENTROPY_CHUNK_ELEMENTS", 4 * MODEL["vocab_size"])  # chunks of 1-2 positions
    logprobs, entropy = worker.compute_logprobs_and_entropy(tokens, temperature=temperature)
    assert entropy.shape == (3, 9) and entropy.dtype == torch.float32
    assert torch.allclose(entropy.double(), expected, atol=1e-5)
    assert torch.equal(logprobs, worker.compute_logprobs(tokens, temperature=temperature))


@cpu_exact
def test_gradient_does_not_depend_on_micro_batching() -> None:
    tokens, mask = _batch(8), (torch.rand(8, 10, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    results = []
    for mbs in (1, 3, 8):  # 3 leaves a ragged last micro-batch
        worker = _worker(mbs=mbs)
        metrics = worker.train_step({"tokens": tokens, "mask": mask}, _nll)
        results.append((metrics, _params(worker)))
    (m0, p0) = results[0]
    for metrics, params in results[1:]:
        assert abs(metrics["nll"] - m0["nll"]) < 1e-5
        assert abs(metrics["grad_norm"] - m0["grad_norm"]) < 1e-5 * m0["grad_norm"]
        assert max(float((params[k] - p0[k]).abs().max()) for k in p0) < 1e-6


def test_training_lowers_the_loss_and_changes_every_weight() -> None:
    worker = _worker(dtype="bf16", optimizer="adam", lr=3e-3)
    tokens = _batch(8)
    before = _params(worker)
    losses = [worker.train_step({"tokens": tokens}, _nll)["nll"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.2
    after = _params(worker)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == [], f"weights the optimizer never changed: {unchanged}"


def test_checkpoint_resume_reproduces_the_next_step_exactly(tmp_path) -> None:
    tokens_a, tokens_b = _batch(8, seed=1), _batch(8, seed=2)
    worker = _worker(optimizer="adam", lr=1e-2)
    worker.train_step({"tokens": tokens_a}, _nll)
    path = worker.save_checkpoint(tmp_path / "step1")
    assert path.exists() and not (tmp_path / "step1.partial").exists()
    expected_metrics = worker.train_step({"tokens": tokens_b}, _nll)
    expected = _params(worker)

    resumed = _worker(optimizer="adam", lr=1e-2, seed=99)  # different init: everything must come from disk
    resumed.load_checkpoint(path)
    assert resumed.steps_done == 1
    metrics = resumed.train_step({"tokens": tokens_b}, _nll)
    assert metrics == expected_metrics
    got = _params(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_loading_an_incomplete_checkpoint_fails_clearly(tmp_path) -> None:
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete Megatron dist checkpoint"):
        _worker().load_checkpoint(tmp_path / "half")


def test_a_checkpoint_with_a_nan_parameter_fails_to_load_naming_it(tmp_path) -> None:
    worker = _worker()
    name, param = next((n, p) for n, p in worker.model.named_parameters() if "experts" in n)
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
        saved = worker.save_checkpoint(tmp_path / "nan")
        param.zero_()  # finite again: the NaN must come from the file
    with pytest.raises(ValueError, match=rf"parameter of the model loaded from .*nan '{name}' holds 1 NaN or Inf"):
        worker.load_checkpoint(saved)


def test_a_checkpoint_whose_rng_file_would_run_code_is_refused(tmp_path) -> None:
    from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError

    class OpensAFile:
        def __reduce__(self):
            return open, (str(tmp_path / "ran"), "w")

    saved = _worker().save_checkpoint(tmp_path / "ckpt")
    torch.save({"torch": OpensAFile()}, saved / "rng_rank00000.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"rng_rank00000\.pt: the RNG state is not plain data"):
        _worker().load_checkpoint(saved)
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_whose_metadata_would_run_code_is_refused(tmp_path) -> None:
    from megatron_quads.trainer.checkpoint_audit import UnsafeCheckpointError
    from pickle_payloads import poison_dcp_metadata

    saved = _worker().save_checkpoint(tmp_path / "ckpt")
    metadata = poison_dcp_metadata(saved, tmp_path / "ran")  # still unpickles to the valid metadata
    with pytest.raises(UnsafeCheckpointError, match=rf"{metadata}: its metadata pickle is not plain checkpoint metadata"):
        _worker().load_checkpoint(saved)
    assert not (tmp_path / "ran").exists()


def test_a_model_only_load_carries_the_weights_into_the_bf16_optimizer(tmp_path) -> None:
    """The optimizer's fp32 main copies follow the loaded weights: a tiny step keeps them."""
    saved = _worker(dtype="bf16", optimizer="adam", seed=3).save_checkpoint(tmp_path / "m", with_optimizer=False)
    worker = _worker(dtype="bf16", optimizer="adam", lr=1e-6, seed=99)
    worker.load_checkpoint(saved, with_optimizer=False)
    loaded = _params(worker)
    worker.train_step({"tokens": _batch(8)}, _nll)
    assert max(float((p - loaded[k]).abs().max()) for k, p in _params(worker).items()) < 1e-2


def test_exported_names_cover_every_parameter() -> None:
    worker = _worker()
    names = [name for name, _ in worker.export_hf_weights()]
    assert len(names) == len(set(names))
    assert "lm_head.weight" in names and "model.layers.1.mlp.experts.3.down_proj.weight" in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is gloo's; on a GPU the ranks use NCCL")
def test_a_layout_gloo_cannot_gather_is_refused_before_the_model_is_built() -> None:
    """EP x expert-TP with the all-to-all dispatcher all-gathers parts of unequal sizes, which gloo
    refuses mid-forward; the worker refuses the layout up front (a rule on its config, so one rank shows
    it: the model is built on this one-rank world's groups)."""
    layout = ParallelConfig(tensor_parallel=2, expert_parallel=2, sequence_parallel=True)
    alltoall = PolicyWorkerConfig(model=PolicyModelConfig(**MODEL, moe_token_dispatcher="alltoall"), parallel=layout)
    with pytest.raises(ValueError, match="cannot run on gloo .* set parallel.expert_tensor_parallel=1"):
        PolicyWorker(alltoall)
    allgather = alltoall.model_copy(update={"model": PolicyModelConfig(**MODEL, moe_token_dispatcher="allgather")})
    assert PolicyWorker(allgather).model is not None


def test_the_lr_follows_the_warm_up_then_the_cosine_and_a_resume_continues_it(tmp_path) -> None:
    schedule = dict(lr=0.4, lr_warmup_steps=2, lr_schedule="cosine", min_lr=0.1, lr_decay_steps=5)
    # step s trains at Megatron's lr after s + 1 steps: warm-up 0.2, 0.4; cosine over steps 2..4 to min_lr
    expected = [0.2, 0.4, 0.1 + 0.3 * 0.75, 0.1 + 0.3 * 0.25, 0.1, 0.1]
    worker = _worker(**schedule)
    tokens = _batch(4)
    lrs = [worker.train_step({"tokens": tokens}, _nll)["lr"] for _ in range(2)]
    path = worker.save_checkpoint(tmp_path / "step2")
    lrs += [worker.train_step({"tokens": tokens}, _nll)["lr"] for _ in range(4)]
    assert lrs == pytest.approx(expected)
    assert [g["lr"] for g in worker.optimizer.param_groups] == pytest.approx([0.1] * len(worker.optimizer.param_groups))
    resumed = _worker(**schedule)
    resumed.load_checkpoint(path)
    assert [resumed.train_step({"tokens": tokens}, _nll)["lr"] for _ in range(4)] == pytest.approx(expected[2:])
    assert worker.train_step({"tokens": tokens}, _nll, schedule_step=1)["lr"] == pytest.approx(0.4)  # a given step


def test_the_lr_decays_the_update_sgd_makes() -> None:
    tokens = _batch(4)
    moves = []
    for lr_schedule in ("constant", "cosine"):
        worker = _worker(lr=0.4, lr_schedule=lr_schedule, min_lr=0.0, lr_decay_steps=2)
        before = _params(worker)
        worker.train_step({"tokens": tokens}, _nll, schedule_step=1)  # the cosine's last step: lr 0
        after = _params(worker)
        moves.append(max(float((after[k] - before[k]).abs().max()) for k in before))
    assert moves[0] > 0 and moves[1] == 0.0
