"""A GRPO step's tensors: the batch built from the generations, its mini-batches, and each trainer
rank's data-parallel part of it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_quads.rollout.routing import routing_batch


def build_batch(prompts: list[list[int]], generations: list, pad_id: int,
                advantages: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Right-padded [prompt + response] tokens, the response mask and the rollout log-probs [b, s-1];
    with routing in the generations also ``routed_experts`` [b, s, layers, k] (:func:`routing_batch`);
    with ``advantages`` (one per sequence) also those."""
    seqs = [p + g.token_ids for p, g in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    logp_rollout = torch.zeros((len(seqs), width - 1))
    for i, (p, g) in enumerate(zip(prompts, generations, strict=True)):
        tokens[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p) : len(p) + len(g.token_ids)] = 1.0
        logp_rollout[i, len(p) - 1 : len(p) - 1 + len(g.logprobs)] = torch.tensor(g.logprobs)
    batch = {"tokens": tokens, "mask": mask, "logp_rollout": logp_rollout}
    if any(g.routed_experts is not None for g in generations):
        batch["routed_experts"] = routing_batch(generations, width)
    if advantages is not None:
        batch["advantages"] = advantages
    return batch


def mini_batches(batch: dict[str, torch.Tensor], epochs: int, count: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """``epochs`` passes over ``batch``, each cut into ``count`` mini-batches of a shuffle of its
    sequences (one ``seed``-ed generator for all passes; in order when ``count`` is 1)."""
    size = batch["tokens"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(size, generator=gen) if count > 1 else torch.arange(size)
        for part in order.tensor_split(count):
            yield {k: v[part] for k, v in batch.items()}


def data_parallel_shards(batch: dict[str, torch.Tensor], dp: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """Each trainer rank's part of ``batch`` (every tensor split along its first dimension, one row per
    sequence), for ranks whose ``(data-parallel rank, data-parallel size)`` are ``dp``.

    The sequences are cut into one contiguous piece per data-parallel replica, in replica order, and
    the ranks of one replica get the same piece. When the replicas do not divide the sequences, the
    first ``sequences % replicas`` pieces hold one sequence more than the others (6 sequences over 4
    replicas: 2, 2, 1, 1). Raises ValueError when there are fewer sequences than replicas (a replica
    would get none; the run config refuses such a layout).
    """
    sizes = {size for _, size in dp}
    if len(sizes) != 1:
        raise ValueError(f"the trainer ranks disagree on the data-parallel size: {sorted(sizes)}")
    replicas = sizes.pop()
    sequences = next(iter(batch.values())).shape[0]
    if sequences < replicas:
        raise ValueError(f"{sequences} sequences cannot give each of the {replicas} data-parallel trainer replicas "
                         "one: give each update at least as many sequences as replicas (grpo.prompts_per_step x "
                         "grpo.responses_per_prompt / grpo.mini_batches), or use fewer data-parallel ranks")
    pieces = {k: v.tensor_split(replicas) for k, v in batch.items()}
    return [{k: parts[rank] for k, parts in pieces.items()} for rank, _ in dp]
