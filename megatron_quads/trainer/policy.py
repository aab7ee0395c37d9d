"""The policy worker: one rank of the Megatron trainer, as the GRPO controller drives it.

One :class:`PolicyWorker` per rank (the controller runs them as Ray actors that form one
torch.distributed group). Its calls are collective over the model-parallel group: every rank of a
data-parallel replica gets the same batch, every replica its own shard of the global batch.

- :meth:`PolicyWorker.compute_logprobs`: per-token log-probs of given token ids (no grad;
  :meth:`PolicyWorker.compute_logprobs_and_entropy` also the policy's entropy at each of them);
- :meth:`PolicyWorker.train_step`: one optimizer step over micro-batches with a caller's loss;
- :meth:`PolicyWorker.save_checkpoint` / :meth:`PolicyWorker.load_checkpoint`: Megatron dist
  checkpoints (model, optimizer, RNG), written atomically, checked finite when loaded;
- :meth:`PolicyWorker.export_hf_weights`: full weights by Hugging Face name.

The model is Megatron-Core's GPTModel (QUADS spec when enabled) wrapped as Megatron trains it:
``Float16Module`` for bf16, Megatron DDP, and Megatron's optimizer. Losses use Megatron's
per-token loss path (``calculate_per_token_loss``): a loss function returns a *sum* and the number
of units it is normalised by, and the gradient is ``sum of sums / sum of counts`` over every
micro-batch and data-parallel rank, so a token-mean over the global batch is exact whatever the
micro-batching.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron_quads.trainer.checkpoint_audit import load_dist_checkpoint, load_plain_data
from megatron_quads.trainer.entropy import token_entropy
from megatron_quads.trainer.fake_quant import invalidate_fake_quant_caches
from megatron_quads.trainer.hf_export import export_hf_weights
from megatron_quads.trainer.lr_schedule import lr_scheduler, place_at_step
from megatron_quads.trainer.megatron_fixes import mark_expert_params_for_expert_dp, use_forked_checkpoint_result_queue
from megatron_quads.trainer.model import build_gpt_model, save_model_config
from megatron_quads.trainer.settings import gloo_layout_problem
from megatron_quads.trainer.router_replay import (
    RoutingAgreement,
    check_routing,
    local_routing,
    replay_targets,
    replaying,
    reset_router_replay,
)
from megatron_quads.trainer.sequence_padding import pad_to_multiple
from megatron_quads.trainer.settings import OptimConfig, PolicyWorkerConfig  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""(loss summed over the micro-batch, number of units it is normalised by, metrics to average)."""
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], LossOutput]
"""``loss_fn(logprobs [b, s-1], micro_batch) -> LossOutput``; ``micro_batch`` holds the caller's tensors."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probs ``[b, s-1]`` of ``tokens[:, 1:]`` under ``logits[:, :-1] / temperature``.

    ``logits`` may be split over the vocabulary across tensor-parallel ranks (Megatron's default
    ``parallel_output``); the vocab-parallel cross entropy reduces across them.
    """
    scaled = logits[:, :-1].float() / temperature  # a fresh tensor: the CE below edits it in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, tokens[:, 1:].contiguous())


def _atomic_checkpoint_dir(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


class PolicyWorker:
    """One trainer rank: a Megatron GPT-MoE with optimizer, driven by the controller."""

    def __init__(self, cfg: PolicyWorkerConfig) -> None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "PolicyWorker needs torch.distributed and Megatron parallel_state initialised first "
                "(megatron_quads.trainer.distributed.init_trainer_distributed)"
            )
        if dist.get_backend() == "gloo":
            problem = gloo_layout_problem(cfg.model, cfg.parallel)
            if problem:
                raise ValueError(problem)
        self.cfg = cfg
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        if cfg.router_replay:
            reset_router_replay()
        self.model = build_gpt_model(cfg.model, cfg.parallel, cfg.quads, routing_replay=cfg.router_replay)
        mark_expert_params_for_expert_dp(self.model)  # Megatron 0.16.1 expert-DP grad bug
        config = self.model.config
        # before DDP: it picks its gradient scaling (none: finalize_model_grads divides by tokens) from this
        config.calculate_per_token_loss = True
        if torch.cuda.is_available():
            self.model.cuda(torch.cuda.current_device())
        module = Float16Module(config, self.model) if config.bf16 else self.model
        self.ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
                average_in_collective=False,  # per-token loss: finalize_model_grads divides by tokens
            ),
            module=module,
        )
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=o.optimizer,
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                sgd_momentum=0.0,
                clip_grad=o.clip_grad,
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=o.use_distributed_optimizer,
            ),
            [self.ddp],
        )
        self.lr_scheduler = lr_scheduler(self.optimizer, o)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.steps_done = 0
        self.routing_counts = (0, 0)
        """(routed (token, layer) pairs, pairs whose own top-k differs from the replayed experts) of
        this rank's last :meth:`compute_logprobs` with ``routed_experts``."""

    @property
    def device(self) -> torch.device:
        """Device the model computes on."""
        return next(self.model.parameters()).device

    def _forward_logits(self, tokens: torch.Tensor, routed_experts: torch.Tensor | None = None,
                        agreement: RoutingAgreement | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab (this rank's part)]`` of ``tokens [b, s]``; given ``routed_experts
        [b, s, layers, k]``, every router replays them (and ``agreement`` counts where the routers' own
        top-k differs).

        Under sequence parallelism the forward runs on the sequences padded at the end to a multiple
        of the TP size (:func:`pad_to_multiple`) and the logits of the added positions are dropped.
        """
        if routed_experts is None and self.cfg.router_replay:
            raise ValueError("this worker replays routing (router_replay=True): every batch needs routed_experts")
        if routed_experts is not None:
            if not self.cfg.router_replay:
                raise ValueError("the batch carries routed_experts but the worker was built without router_replay")
            m = self.cfg.model
            check_routing(routed_experts, m.num_layers, m.moe_router_topk, m.num_experts, tokens)
        config = self.model.config
        multiple = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        padded = pad_to_multiple(tokens, multiple, routed_experts)
        positions = torch.arange(padded.tokens.shape[1], device=tokens.device).expand_as(padded.tokens)
        extra = {} if padded.padding_mask is None else {"padding_mask": padded.padding_mask}
        if routed_experts is None:
            logits = self.ddp(padded.tokens, positions, None, **extra)
        else:
            local = local_routing(padded.routed_experts, config.sequence_parallel)
            if agreement is not None:
                agreement.expect(local)
            with replaying(replay_targets(local)):
                logits = self.ddp(padded.tokens, positions, None, **extra)
        return logits[:, :padded.length]

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        size = batch["tokens"].shape[0]
        mbs = self.cfg.micro_batch_size
        return [{k: v[i : i + mbs].to(self.device) for k, v in batch.items()} for i in range(0, size, mbs)]

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor, temperature: float = 1.0,
                         routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs ``[b, s-1]`` (fp32, CPU) of ``tokens[:, 1:]``, in micro-batches;
        ``routed_experts [b, s, layers, k]``: the routing to replay (router_replay workers)."""
        return self._score(tokens, temperature, routed_experts, with_entropy=False)[0]

    @torch.no_grad()
    def compute_logprobs_and_entropy(self, tokens: torch.Tensor, temperature: float = 1.0,
                                     routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_logprobs` and, from the same forward, the entropy ``[b, s-1]`` (nats, fp32, CPU)
        of the next-token distribution each of those tokens was scored under (:func:`token_entropy`)."""
        return self._score(tokens, temperature, routed_experts, with_entropy=True)

    def _score(self, tokens: torch.Tensor, temperature: float, routed_experts: torch.Tensor | None,
               with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ddp.eval()
        batch = {"tokens": tokens} if routed_experts is None else {"tokens": tokens, "routed_experts": routed_experts}
        agreement = (None if routed_experts is None
                     else RoutingAgreement([layer.mlp.router for layer in self.model.decoder.layers]))
        logprobs, entropy = [], []
        try:
            for mb in self._micro_batches(batch):
                logits = self._forward_logits(mb["tokens"], mb.get("routed_experts"), agreement)
                logprobs.append(token_logprobs(logits, mb["tokens"], temperature).cpu())
                if with_entropy:
                    entropy.append(token_entropy(logits, temperature).cpu())
        finally:
            if agreement is not None:
                self.routing_counts = (agreement.routed, agreement.differ)
                agreement.remove()
            self.ddp.train()
        return torch.cat(logprobs), torch.cat(entropy) if with_entropy else None

    def keep_reference(self) -> int:
        """Keep a host copy of the current weights as the reference policy (the KL penalty's);
        returns its bytes (one copy of this rank's parameters)."""
        self._reference = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}
        return sum(t.nbytes for t in self._reference.values())

    @torch.no_grad()
    def compute_reference_logprobs(self, tokens: torch.Tensor, temperature: float = 1.0,
                                   routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`compute_logprobs` under the weights :meth:`keep_reference` kept: they are copied
        into the parameters for the call and the current weights copied back after it."""
        reference = getattr(self, "_reference", None)
        if reference is None:
            raise RuntimeError("no reference policy: call keep_reference first")
        params = dict(self.model.named_parameters())
        current = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        try:
            for name, p in params.items():
                p.copy_(reference[name])
            invalidate_fake_quant_caches(self.model)
            return self.compute_logprobs(tokens, temperature, routed_experts)
        finally:
            for name, p in params.items():
                p.copy_(current[name])
            invalidate_fake_quant_caches(self.model)

    def train_step(
        self, batch: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float = 1.0,
        schedule_step: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's ``batch`` (must hold ``tokens [b, s]``; router_replay
        workers also ``routed_experts [b, s, layers, k]``) at the lr schedule's lr of ``schedule_step``
        (default: this worker's optimizer steps so far).

        The gradient is ``sum(loss_sum) / sum(count)`` over all micro-batches and data-parallel
        ranks. Returns the averaged metrics, ``grad_norm``, ``update_successful`` and ``lr``.
        """
        lr = place_at_step(self.lr_scheduler, self.steps_done if schedule_step is None else schedule_step)
        self.ddp.train()
        micro_batches = self._micro_batches(batch)

        def forward_step(data_iterator: Iterator, model: torch.nn.Module):
            mb = next(data_iterator)
            logits = self._forward_logits(mb["tokens"], mb.get("routed_experts"))
            return token_logprobs(logits, mb["tokens"], temperature), partial(loss_fn_wrapper, mb)

        def loss_fn_wrapper(mb: dict[str, torch.Tensor], logprobs: torch.Tensor):
            loss_sum, count, metrics = loss_fn(logprobs, mb)
            reported = {k: torch.stack([v.detach().float().sum(), count.detach().float()]) for k, v in metrics.items()}
            return loss_sum, count.detach().to(torch.int), reported

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=batch["tokens"].shape[1] - 1,
            micro_batch_size=self.cfg.micro_batch_size,
            forward_only=False,
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        invalidate_fake_quant_caches(self.model)  # the optimizer wrote new weights via param.data
        self.steps_done += 1
        return {**_average_metrics(reduced), "grad_norm": float(grad_norm or 0.0), "update_successful": float(update_ok),
                "lr": lr}

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full BF16 master weights by Hugging Face name (collective over the model-parallel group)."""
        return export_hf_weights(self.model)

    def _sharded_state(self, is_loading: bool = False, with_optimizer: bool = True) -> dict:
        model_sd = self.model.sharded_state_dict()
        state = {"model": model_sd}
        # SGD here has no momentum, hence no state (and Megatron cannot build a loading template for it)
        if with_optimizer and self.cfg.optim.optimizer != "sgd":
            # 0.16.1's default distributed-optimizer format fails ("flattened_range is not supported")
            metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        return state

    def save_checkpoint(self, path: str | os.PathLike, with_optimizer: bool = True) -> Path:
        """Save model, optimizer (unless ``with_optimizer`` is False), RNG state and the architecture
        (``model_config.json``) to ``path``, atomically.

        Everything is written to ``<path>.partial`` first and renamed once all ranks finished, so
        ``path`` either holds a complete checkpoint or does not exist.
        """
        path = Path(path)
        partial_dir = _atomic_checkpoint_dir(path)
        if dist.get_rank() == 0:
            shutil.rmtree(partial_dir, ignore_errors=True)
            partial_dir.mkdir(parents=True)
        dist.barrier()
        if not torch.cuda.is_available():
            use_forked_checkpoint_result_queue()
        dist_checkpointing.save(self._sharded_state(with_optimizer=with_optimizer), str(partial_dir))
        rng = {
            "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
            "steps_done": self.steps_done,
        }
        torch.save(rng, partial_dir / f"rng_rank{dist.get_rank():05d}.pt")
        if dist.get_rank() == 0:
            save_model_config(self.cfg.model, partial_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            if path.exists():
                shutil.rmtree(path)
            os.replace(partial_dir, path)
        dist.barrier()
        return path

    def load_checkpoint(self, path: str | os.PathLike, with_optimizer: bool = True) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` (any TP/EP layout for the model).

        ``with_optimizer=False`` loads model weights (and RNG, if present) only, e.g. to start
        training from a model-only checkpoint such as the embedded default. Every loaded parameter
        and optimizer tensor must be finite: a NaN or Inf raises ValueError naming the first one.
        Its pickles are audited first (:func:`load_dist_checkpoint`): one that could run code is
        refused with :class:`UnsafeCheckpointError`.
        """
        path = Path(path)
        if not (path / "metadata.json").exists():
            raise FileNotFoundError(f"{path} is not a complete Megatron dist checkpoint (no metadata.json)")
        state = self._sharded_state(is_loading=True, with_optimizer=with_optimizer)
        loaded = load_dist_checkpoint(state, path)
        self.model.load_state_dict(loaded["model"])
        _require_finite(self.model.named_parameters(), f"parameter of the model loaded from {path}")
        if "optimizer" in loaded:
            _require_finite(_tensor_leaves(loaded["optimizer"], "optimizer"), f"optimizer tensor loaded from {path}")
            with torch.no_grad():  # the optimizer copies into views of leaf params
                self.optimizer.load_state_dict(loaded["optimizer"])
        else:  # the optimizer's fp32 main copies (bf16) must follow the loaded weights
            self.optimizer.reload_model_params()
        rng_file = path / f"rng_rank{dist.get_rank():05d}.pt"
        if rng_file.exists():
            rng = load_plain_data(rng_file, rng_file, "the RNG state")
            torch.set_rng_state(rng["torch"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
            self.steps_done = rng["steps_done"]
        invalidate_fake_quant_caches(self.model)


def _tensor_leaves(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts / lists / tuples, named by its path (``optimizer/state/0/exp_avg``)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensor_leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensor_leaves(value, f"{prefix}/{i}")


def _require_finite(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise ValueError naming the first floating-point tensor that holds a NaN or Inf.

    One pass: every tensor's check is queued, then read back once per device.
    """
    items = [(name, t) for name, t in named if t.is_floating_point()]
    flags = [torch.isfinite(t.detach()).all() for _, t in items]
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    bad = [i for indices in by_device.values()
           for i, ok in zip(indices, torch.stack([flags[i] for i in indices]).tolist(), strict=True) if not ok]
    if bad:
        name, t = items[min(bad)]
        count = int((~torch.isfinite(t.detach())).sum())
        raise ValueError(f"{what} '{name}' holds {count} NaN or Inf values ({len(bad)} tensor(s) in all): the "
                         "checkpoint is damaged or was saved from a diverged run; load an older checkpoint")


def _average_metrics(reduced: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average each metric over micro-batches (weighted by their counts) and data-parallel ranks."""
    names = list(reduced[0].keys()) if reduced else []
    if not names:
        return {}
    totals = torch.stack([torch.stack([mb[k] for mb in reduced]).sum(0) for k in names])  # [metrics, 2]
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return {k: float(total[0] / total[1].clamp(min=1)) for k, total in zip(names, totals, strict=True)}
