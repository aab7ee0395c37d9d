"""Which experts the rollout engine routed each token to (router replay, "R3").

A sequence's routing is an int16 tensor ``[positions, layers, k]``: row ``p`` holds, for every MoE
layer in order, the ``k`` experts the engine sent the token at position ``p`` of prompt + response
to. Every token the engine fed through the model has a row: the prompt and every response token
but the last (the engine samples it and stops), so a sequence of ``P`` prompt and ``T`` response
tokens has ``P + T - 1`` rows. The trainer replays these rows (:mod:`megatron_quads.trainer.router_replay`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megatron_quads.rollout.engine import Generation

ROUTED_EXPERTS_DTYPE = torch.int16
"""Expert ids as recorded and shipped (up to 32767 experts)."""
NOT_ROUTED = -1
"""The expert id of a batch position no engine routed (the trainer's router replay reads it so)."""


class RoutingRecorder:
    """Records the top-k expert ids of every router of a transformers MoE model, one forward at a
    time: after a forward, :meth:`take` returns ``[tokens of the forward, layers, k]``.

    ``routers`` are the MoE layers' router modules in layer order; each must return
    ``(logits, weights, indices [tokens, k])`` (transformers' ``Qwen3MoeTopKRouter``)."""

    def __init__(self, routers: list[nn.Module]) -> None:
        if not routers:
            raise ValueError("the model has no MoE router to record")
        self._rows: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    def _hook(self, layer: int):
        def record(module: nn.Module, args: tuple, output: tuple) -> None:
            self._rows[layer] = output[2].detach().to("cpu", ROUTED_EXPERTS_DTYPE)
        return record

    def take(self) -> torch.Tensor:
        """The last forward's experts ``[tokens, layers, k]`` (every layer must have routed)."""
        if any(rows is None for rows in self._rows):
            raise RuntimeError("a router did not run in the last forward")
        out = torch.stack(self._rows, dim=1)
        self._rows = [None] * len(self._rows)
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router (``mlp.gate``) of every MoE decoder layer of a transformers Qwen3-MoE model, in order."""
    layers = model.model.layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]


@contextmanager
def recording(model: nn.Module) -> Iterator[RoutingRecorder]:
    """A :class:`RoutingRecorder` on ``model``'s routers for the block."""
    recorder = RoutingRecorder(moe_routers(model))
    try:
        yield recorder
    finally:
        recorder.remove()


class SequenceRouting:
    """Per-sequence routing buffers filled forward by forward during batched generation."""

    def __init__(self, prompt_lengths: list[int], max_new_tokens: int, layers: int, k: int) -> None:
        self.lengths = list(prompt_lengths)
        self.rows = [torch.zeros((p + max_new_tokens, layers, k), dtype=ROUTED_EXPERTS_DTYPE) for p in prompt_lengths]

    def add_prefill(self, routed: torch.Tensor, width: int) -> None:
        """Rows of a left-padded prefill ``[batch * width, layers, k]``: each prompt's own columns."""
        by_sequence = routed.view(len(self.rows), width, *routed.shape[1:])
        for i, length in enumerate(self.lengths):
            self.rows[i][:length] = by_sequence[i, width - length:]

    def add_decode(self, routed: torch.Tensor, step: int, active: list[int]) -> None:
        """Rows of decode step ``step`` (0: the first response token fed) for the ``active`` sequences."""
        for i in active:
            self.rows[i][self.lengths[i] + step] = routed[i]

    def result(self, index: int, response_tokens: int) -> torch.Tensor:
        """Sequence ``index``'s routing: ``[prompt + response_tokens - 1, layers, k]``."""
        return self.rows[index][: self.lengths[index] + response_tokens - 1].clone()


def routing_batch(generations: list[Generation], width: int) -> torch.Tensor:
    """The generations' routing as ``[b, width, layers, k]`` (int16); positions the engine did not
    route (each response's last token, padding) hold :data:`NOT_ROUTED`."""
    if any(g.routed_experts is None for g in generations):
        raise ValueError("router replay needs every generation's routed_experts; an engine returned none")
    first = generations[0].routed_experts
    layers, k = first.shape[1:]
    routed = torch.full((len(generations), width, layers, k), NOT_ROUTED, dtype=first.dtype)
    for i, g in enumerate(generations):
        expected = len(g.prompt_ids) + len(g.token_ids) - 1
        if g.routed_experts.shape[0] != expected:
            raise ValueError(f"generation {i} has routing for {g.routed_experts.shape[0]} positions; its "
                             f"{len(g.prompt_ids)} prompt and {len(g.token_ids)} response tokens need {expected}")
        routed[i, :expected] = g.routed_experts
    return routed
