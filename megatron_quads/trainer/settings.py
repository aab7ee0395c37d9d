"""The trainer's typed settings: parallel layout, architecture, optimizer, worker (torch-free).

These are the pydantic classes the run config composes, kept apart from the modules that build
the model, so validating a config imports neither torch nor Megatron-Core.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from megatron_quads.atomic_io import write_text_atomic
from megatron_quads.trainer.quads_config import QuadsTrainerConfig

if TYPE_CHECKING:
    import torch


class ParallelConfig(BaseModel):
    """Model-parallel layout of the trainer (data parallel is whatever the world size leaves)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    expert_tensor_parallel: int | None = Field(None, ge=1, description="default: tensor_parallel")
    pipeline_parallel: Literal[1] = 1
    sequence_parallel: bool = Field(False, description="required (and switched on) when TP > 1 with MoE")
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        "local",
        description="layer modules: local (Megatron-Core's own; QUADS fake-quantizes through its modules) or "
        "transformer_engine (TE layers, TEGroupedMLP experts, QUADS through TE's custom FP4 recipe; needs TE installed)",
    )


class PolicyModelConfig(BaseModel):
    """Architecture of a GPT-MoE policy (Qwen3-MoE-like: RMSNorm, SwiGLU experts, RoPE, GQA)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(128, ge=16)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups; default: one per head")
    kv_channels: int | None = Field(None, ge=1)
    ffn_hidden_size: int = Field(256, ge=16, description="dense MLP size (layers without experts)")
    num_experts: int = Field(8, ge=1)
    moe_ffn_hidden_size: int = Field(64, ge=16)
    moe_router_topk: int = Field(2, ge=1)
    moe_shared_expert_size: int | None = Field(None, description="shared-expert ffn size; None: no shared expert")
    moe_grouped_gemm: bool = Field(False, description="legacy GroupedMLP experts instead of SequentialMLP")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    moe_aux_loss_coeff: float = 0.0
    vocab_size: int = Field(64, ge=2)
    max_sequence_length: int = Field(256, ge=2)
    qk_layernorm: bool = True
    rotary_base: int = 10000
    rms_norm_eps: float = Field(1e-5, gt=0.0, description="RMSNorm epsilon (every norm, q/k norms included)")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k router probabilities to sum to 1")
    untie_embeddings: bool = True
    dtype: Literal["bf16", "fp32"] = "bf16"
    init_method_std: float = 0.02

    @model_validator(mode="after")
    def _check(self) -> PolicyModelConfig:
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk} > num_experts {self.num_experts}")
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}: set kv_channels"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype."""
        import torch

        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


class OptimConfig(BaseModel):
    """Megatron optimizer settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: str = Field("adam", pattern="^(adam|sgd)$")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0)
    use_distributed_optimizer: bool = False
    # the learning-rate schedule (Megatron-Core's OptimizerParamScheduler; megatron_quads.trainer.lr_schedule)
    lr_warmup_steps: int = Field(0, ge=0, description="steps over which the lr rises linearly to lr: step s "
                                 "(0-based) trains at lr * (s + 1) / lr_warmup_steps")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after the warm-up: constant at lr, or cosine down to min_lr at step lr_decay_steps - 1")
    min_lr: float = Field(0.0, ge=0, description="cosine: the lr the schedule ends at (and keeps after lr_decay_steps)")
    lr_decay_steps: int | None = Field(None, ge=1, description="cosine: the steps the warm-up and the decay span "
                                       "together (default: the run's grpo.steps)")

    @model_validator(mode="after")
    def _check_schedule(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} > lr {self.lr}: the schedule decays from lr down to min_lr")
        if self.lr_decay_steps is not None and self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"lr_warmup_steps {self.lr_warmup_steps} >= lr_decay_steps {self.lr_decay_steps}: the "
                             "warm-up must end before the decay does")
        return self


class PolicyWorkerConfig(BaseModel):
    """Everything one trainer rank needs to build its model and optimizer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: PolicyModelConfig = PolicyModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    quads: QuadsTrainerConfig = QuadsTrainerConfig()
    optim: OptimConfig = OptimConfig()
    micro_batch_size: int = Field(8, ge=1)
    seed: int = 1234
    router_replay: bool = Field(False, description="the routers replay given experts (batches carry routed_experts)")

    @model_validator(mode="after")
    def _check(self) -> PolicyWorkerConfig:
        problem = transformer_engine_problem(self.model, self.parallel, self.quads)
        if problem:
            raise ValueError(problem)
        return self


TE_SCOPES = ("routed_experts", "all_linears")
"""QUADS scopes the Transformer Engine path can express (TE's quantizer roles do not name shared experts)."""


def transformer_engine_problem(
    model: PolicyModelConfig, parallel: ParallelConfig, quads: QuadsTrainerConfig
) -> str | None:
    """Why ``parallel.transformer_impl=transformer_engine`` cannot build this model; None when it can."""
    if parallel.transformer_impl != "transformer_engine":
        return None
    if model.moe_grouped_gemm:
        return ("model.moe_grouped_gemm=true selects the local spec's legacy GroupedMLP; with "
                "parallel.transformer_impl=transformer_engine the experts are TEGroupedMLP: set model.moe_grouped_gemm=false")
    if quads.enabled and quads.scope.value not in TE_SCOPES:
        return (f"QUADS scope {quads.scope.value!r} is not available with parallel.transformer_impl=transformer_engine "
                f"(TE's quantizer roles do not tell shared experts from attention): use one of {', '.join(TE_SCOPES)}, "
                "or parallel.transformer_impl=local")
    if quads.enabled and quads.block_2d:
        return ("quads.block_2d is not available with parallel.transformer_impl=transformer_engine (its quantizer "
                "factories use 1x16 blocks): set quads.block_2d=false, or parallel.transformer_impl=local")
    return None


def gloo_layout_problem(model: PolicyModelConfig, parallel: ParallelConfig) -> str | None:
    """Why trainer ranks on gloo (CPU) cannot run this layout; None when they can.

    The rule: with expert parallelism and expert tensor parallelism both above 1, Megatron-Core's
    all-to-all token dispatcher all-gathers, within each expert-TP group, the tokens each rank
    received from the other expert-parallel ranks: parts whose sizes follow the routing, so they
    differ. gloo's all-gather takes equal parts only (NCCL gathers unequal ones), so that layout
    needs the allgather dispatcher on gloo, whose all-gathers take equal parts."""
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    if parallel.expert_parallel == 1 or etp == 1 or model.moe_token_dispatcher != "alltoall":
        return None
    return (f"parallel.expert_parallel={parallel.expert_parallel} with expert tensor parallel {etp} "
            "(parallel.expert_tensor_parallel, default parallel.tensor_parallel) and the alltoall token dispatcher "
            "cannot run on gloo (CPU trainer ranks): the dispatcher all-gathers each expert-TP group's tokens in "
            "parts of routing-dependent sizes, and gloo gathers equal parts only; set "
            "parallel.expert_tensor_parallel=1, or model.architecture.moe_token_dispatcher=allgather, or run the "
            "trainer on GPUs (placement.trainer_gpus_per_worker=1, NCCL)")


MODEL_CONFIG_FILE = "model_config.json"
"""The architecture a Megatron dist checkpoint holds, written beside its files (PolicyModelConfig fields)."""


def save_model_config(model: PolicyModelConfig, directory: str | os.PathLike[str]) -> Path:
    """Write ``directory/model_config.json`` (atomically)."""
    text = json.dumps(model.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"
    return write_text_atomic(Path(directory) / MODEL_CONFIG_FILE, text)


DIST_METADATA = "metadata.json"
"""The file Megatron's dist checkpointing writes into every checkpoint directory."""
RUN_CHECKPOINT_TRAINER = "trainer"
"""A GRPO run's checkpoint (``RUN_DIR/checkpoints/step_N``) keeps the trainer's dist checkpoint here."""


def dist_checkpoint_dir(directory: str | os.PathLike[str]) -> Path:
    """Where the dist checkpoint ``directory`` names lies: ``directory`` itself, or the ``trainer/``
    of a GRPO run's checkpoint (``checkpoints/step_N``); ``directory`` when neither holds one."""
    path = Path(directory)
    inner = path / RUN_CHECKPOINT_TRAINER
    return inner if not (path / DIST_METADATA).is_file() and (inner / DIST_METADATA).is_file() else path


def load_model_config(directory: str | os.PathLike[str]) -> PolicyModelConfig | None:
    """The architecture recorded beside a dist checkpoint; None when it has no ``model_config.json``."""
    path = Path(directory) / MODEL_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return PolicyModelConfig(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not a valid model config ({err}); re-create it with megatron-quads convert") from err
