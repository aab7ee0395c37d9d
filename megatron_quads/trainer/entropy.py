"""Per-token entropy of the policy's next-token distribution, from vocab-parallel logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

ENTROPY_CHUNK_ELEMENTS = 2**25
"""Logit elements (fp32) one chunk of positions works on: bounds the working set at a large vocabulary
(a 4k-token sequence of a 151k vocabulary would take 2.4 GB a temporary at once)."""


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy in nats (fp32, ``[b, s-1]``) of ``softmax(logits[:, :-1] / temperature)`` over the whole
    vocabulary, the distribution :func:`megatron_quads.trainer.policy.token_logprobs` scores tokens under.

    ``logits`` may be split over the vocabulary across tensor-parallel ranks: the max, the partition
    sum and the logit-weighted sum are reduced across them (``H = log Z - E_p[z]``).
    """
    group = parallel_state.get_tensor_model_parallel_group()
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    body = logits[:, :-1]
    b, s, v = body.shape
    step = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, b * v))
    out = []
    for start in range(0, s, step):
        z = body[:, start:start + step].float() / temperature
        peak = z.amax(-1, keepdim=True)
        if split:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        z = z - peak
        weights = z.exp()
        sums = torch.stack([weights.sum(-1), (weights * z).sum(-1)])
        if split:
            dist.all_reduce(sums, group=group)
        total, weighted = sums
        out.append(total.log() - weighted / total)
    return torch.cat(out, dim=1) if out else body.new_zeros((b, 0), dtype=torch.float32)
