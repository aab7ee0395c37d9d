"""The run configuration: one typed, validated tree, loaded from YAML with dotted overrides.

``megatron-quads train CONFIG key=value ...``: the YAML file and the overrides are merged with
OmegaConf, then validated by pydantic; an unknown key or an impossible value fails before any worker
starts, with a message that names the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megatron_quads.rl.advantages import AdvantageConfig
from megatron_quads.rl.loss import PolicyLossConfig
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig
from megatron_quads.trainer.policy import OptimConfig
from megatron_quads.trainer.quads_config import QuadsTrainerConfig

PRECISION_MODES = ("bf16", "naive-nvfp4", "aqat", "quads")
"""bf16: BF16 trainer and rollout; naive-nvfp4: BF16 trainer, W4A4 rollout; aqat: AQAT trainer, W4A4
rollout; quads: AQAT trainer, W4A4 + RAC rollout."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """Which policy to train: the embedded default, or an architecture plus an optional checkpoint."""

    embedded_default: bool = True
    architecture: PolicyModelConfig | None = None
    checkpoint: str | None = Field(None, description="Megatron dist checkpoint to start from (model only)")


class PrecisionSection(_Strict):
    """Numerics of trainer and rollout."""

    mode: Literal["bf16", "naive-nvfp4", "aqat", "quads"] = "quads"
    rac_ratio: float = Field(0.25, ge=0.0, le=1.0, description="RAC residual-channel ratio (quads mode)")


class RolloutSection(_Strict):
    """The rollout engines."""

    engine: Literal["torch", "vllm"] = "torch"
    num_workers: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(8, ge=1)
    num_gpus_per_worker: float = Field(0.0, ge=0.0)
    timeout_s: float = Field(300.0, gt=0)
    max_retries: int = Field(2, ge=0)
    sync_bucket_mb: float = Field(256.0, gt=0, description="weight-sync bucket size bound")


class GRPOSection(_Strict):
    """The RL algorithm."""

    steps: int = Field(3, ge=1)
    prompts_per_step: int = Field(8, ge=1)
    responses_per_prompt: int = Field(4, ge=2)
    micro_batch_size: int = Field(16, ge=1)
    optim: OptimConfig = OptimConfig(lr=1e-4)
    loss: PolicyLossConfig = PolicyLossConfig()
    advantages: AdvantageConfig = AdvantageConfig()


class CheckpointSection(_Strict):
    """When and where to save."""

    every: int = Field(0, ge=0, description="save every N steps (0: never)")
    keep_last: int = Field(2, ge=1)


class LoggingSection(_Strict):
    """Where metrics go."""

    wandb: Literal["disabled", "offline", "online"] = "offline"
    project: str = "megatron-quads"


class RunConfig(_Strict):
    """Everything one GRPO run needs."""

    run_dir: str = "runs/embedded_default"
    seed: int = 0
    model: ModelSection = ModelSection()
    parallel: ParallelConfig = ParallelConfig()
    trainer_world_size: int = Field(1, ge=1)
    precision: PrecisionSection = PrecisionSection()
    rollout: RolloutSection = RolloutSection()
    grpo: GRPOSection = GRPOSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        p = self.parallel
        model_parallel = p.tensor_parallel * p.pipeline_parallel
        if self.trainer_world_size % model_parallel:
            raise ValueError(
                f"trainer_world_size {self.trainer_world_size} is not divisible by tensor_parallel * "
                f"pipeline_parallel = {model_parallel}"
            )
        etp = p.expert_tensor_parallel or p.tensor_parallel
        if self.trainer_world_size % (etp * p.expert_parallel):
            raise ValueError(
                f"trainer_world_size {self.trainer_world_size} is not divisible by expert_tensor_parallel * "
                f"expert_parallel = {etp * p.expert_parallel}"
            )
        if self.rollout.engine == "vllm" and self.precision.mode in ("naive-nvfp4", "aqat", "quads"):
            raise ValueError(
                f"precision.mode={self.precision.mode!r} needs W4A4 activation quantization, which the vLLM "
                "engine of this project does not serve yet: use rollout.engine=torch"
            )
        if not self.model.embedded_default and self.model.architecture is None:
            raise ValueError("model.architecture is required when model.embedded_default is false")
        return self

    def trainer_quads(self) -> QuadsTrainerConfig:
        """The trainer's fake-quant settings for this precision mode."""
        return QuadsTrainerConfig(enabled=self.precision.mode in ("aqat", "quads"))

    def engine_precision(self) -> str:
        """The rollout engine's precision for this mode."""
        return {"bf16": "bf16", "naive-nvfp4": "w4a4", "aqat": "w4a4", "quads": "quads"}[self.precision.mode]


class ConfigError(ValueError):
    """An invalid configuration, with every problem named by its dotted key."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + ``key=value`` overrides -> a validated :class:`RunConfig`."""
    base = OmegaConf.create({})
    if path is not None:
        if not Path(path).exists():
            raise ConfigError(f"config file {path} does not exist")
        base = OmegaConf.load(path)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (dotted keys, e.g. grpo.steps=3)")
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
    try:
        return RunConfig.model_validate(OmegaConf.to_container(merged, resolve=True))
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None
