"""The two kinds of worker the controller drives as Ray actors: trainer ranks and rollout engines.

Plain classes (Ray wraps them with ``ray.remote``), so they are usable and testable without Ray.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_quads.controller.config import RunConfig

EXPERT_MODULE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


def policy_model_config(cfg: RunConfig):
    """The policy architecture of a run."""
    from megatron_quads import embedded
    from megatron_quads.trainer.model import PolicyModelConfig

    if cfg.model.embedded_default:
        return PolicyModelConfig(**embedded.model_config_fields())
    return cfg.model.architecture


def start_checkpoint(cfg: RunConfig) -> str | None:
    """The model-only checkpoint a fresh run starts from."""
    from megatron_quads import embedded

    if cfg.model.checkpoint:
        return cfg.model.checkpoint
    if cfg.model.embedded_default:
        embedded.verify(embedded.ASSET_DIR / "checkpoint")
        return str(embedded.ASSET_DIR / "checkpoint")
    return None


class TrainerWorker:
    """One rank of the Megatron trainer (a PolicyWorker) in the trainers' process group."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, master_port: int) -> None:
        from megatron.core import parallel_state

        from megatron_quads.rl.loss import PolicyLoss
        from megatron_quads.trainer.distributed import init_trainer_distributed
        from megatron_quads.trainer.policy import PolicyWorker, PolicyWorkerConfig

        init_trainer_distributed(world_size, rank, cfg.parallel, master_port=master_port, seed=cfg.seed)
        self.cfg = cfg
        self.rank = rank
        self.worker = PolicyWorker(PolicyWorkerConfig(
            model=policy_model_config(cfg), parallel=cfg.parallel, quads=cfg.trainer_quads(),
            optim=cfg.grpo.optim, micro_batch_size=cfg.grpo.micro_batch_size, seed=cfg.seed,
        ))
        self.loss = PolicyLoss(cfg.grpo.loss)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def data_parallel(self) -> tuple[int, int]:
        """(data-parallel rank, size): which shard of each batch this rank takes."""
        return self.dp_rank, self.dp_size

    def load(self, path: str, with_optimizer: bool) -> int:
        """Load a checkpoint; returns the steps it had done."""
        self.worker.load_checkpoint(path, with_optimizer=with_optimizer)
        return self.worker.steps_done

    def save(self, path: str) -> None:
        """Save model, optimizer and RNG (collective)."""
        self.worker.save_checkpoint(path)

    def compute_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs of this rank's shard under the current weights."""
        return self.worker.compute_logprobs(tokens, temperature=max(self.cfg.rollout.temperature, 1e-6))

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's shard with the GRPO policy loss."""
        return self.worker.train_step(batch, self.loss, temperature=max(self.cfg.rollout.temperature, 1e-6))

    def export_rollout_weights(self, version: int):
        """Weights for the rollout engines, quantized once, as object refs of bounded buckets (rank 0; others None)."""
        import ray

        from megatron_quads.controller.weight_sync import to_buckets
        from megatron_quads.rollout.weights import quantize_hf_weights

        named = ((name, tensor.float()) for name, tensor in self.worker.export_hf_weights())
        if self.rank != 0:
            for _ in named:  # the export is collective: take part in every gather, keep nothing
                pass
            return None
        if self.cfg.engine_precision() == "bf16":
            weights = {name: t.clone() for name, t in named}
        else:
            weights = quantize_hf_weights(named, lambda m: bool(EXPERT_MODULE.match(m)),
                                          weight_version=version, unquantized_dtype=torch.float32)
        bucket_bytes = int(self.cfg.rollout.sync_bucket_mb * 2**20)
        return [ray.put(bucket) for bucket in to_buckets(weights, version, bucket_bytes)]


class RolloutWorker:
    """A rollout engine that generates responses with the weights it was last sent."""

    def __init__(self, cfg: RunConfig) -> None:
        from megatron_quads.rollout.torch_engine import TorchRolloutEngine
        from megatron_quads.trainer.hf_export import qwen3_moe_config

        if cfg.rollout.engine != "torch":
            raise NotImplementedError("only the built-in torch engine is wired into the controller so far")
        device = "cuda" if torch.cuda.is_available() and cfg.rollout.num_gpus_per_worker > 0 else "cpu"
        self.engine = TorchRolloutEngine(
            qwen3_moe_config(policy_model_config(cfg)), precision=cfg.engine_precision(),
            ratio=cfg.precision.rac_ratio, device=device, dtype=torch.float32,
        )

    def load_weights(self, bucket_refs: list, version: int, calibration_prompts: list[list[int]]) -> int:
        """Fetch the buckets, check and swap in the weights; in quads mode re-choose the RAC channels."""
        import ray

        from megatron_quads.controller.weight_sync import from_buckets

        weights, sent_version = from_buckets([ray.get(ref) for ref in bucket_refs])
        if sent_version != version:
            raise ValueError(f"weight buckets have version {sent_version}, the controller expected {version}")
        self.engine.load_weights(weights, version)
        if self.engine.precision == "quads":
            self.engine.calibrate(calibration_prompts)
        return self.engine.weight_version

    def generate(self, prompts: list[list[int]], params) -> list:
        """Generations for ``prompts`` (see TorchRolloutEngine.generate)."""
        return self.engine.generate(prompts, params)

    def ping(self) -> int:
        """Liveness check: the weight version held."""
        return self.engine.weight_version


def checkpoint_dirs(run_dir: str) -> list[Path]:
    """Complete step checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists()),
                  key=lambda p: int(p.name.split("_")[1]))
