"""Router replay ("R3"): the trainer routes each token to the experts the rollout engine used.

Megatron-Core's routing replay (``TransformerConfig.moe_enable_routing_replay``) gives every
router a ``RouterReplay`` that, when set to replay, takes its top-k expert ids from given
tensors instead of its own top-k; the routing weights are still the router's own scores at those
experts, so gradients reach the router as usual. This module turns a batch's recorded routing
``[b, s, layers, k]`` into those per-layer tensors (Megatron's token order: sequence-major,
this rank's sequence chunk under sequence parallelism) and sets them for one forward.

A position the rollout did not route (``-1``: each response's last token, padding) replays experts
``0..k-1``; under causal attention nothing it computes reaches an earlier position's log-prob.
:class:`RoutingAgreement` counts, over the routed positions, how often a router's own top-k would
have chosen other experts than the replayed ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import nn

NOT_ROUTED = -1
"""The expert id of a position the rollout engine did not route (``rollout.routing.NOT_ROUTED``)."""


def local_routing(routed_experts: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """This rank's part of ``routed_experts [b, s, layers, k]``: its chunk of the sequence under
    sequence parallelism (each tensor-parallel rank routes its own; ``s`` must be a multiple of the
    TP size, as Megatron requires of the sequence), else all of it."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not (sequence_parallel and tp > 1):
        return routed_experts
    if routed_experts.shape[1] % tp:
        raise ValueError(f"routed_experts covers {routed_experts.shape[1]} positions, not a multiple of the tensor-"
                         f"parallel size {tp} that sequence parallelism splits the sequence into: pad the batch first "
                         "(megatron_quads.trainer.sequence_padding.pad_to_multiple)")
    chunk = routed_experts.shape[1] // tp
    rank = parallel_state.get_tensor_model_parallel_rank()
    return routed_experts[:, rank * chunk:(rank + 1) * chunk]


def replay_targets(routed_experts: torch.Tensor) -> list[torch.Tensor]:
    """Per MoE layer, the experts ``[s * b, k]`` (int64, Megatron's sequence-major token order) the
    routers replay for this rank's ``routed_experts [b, s, layers, k]``; unrouted positions get ``0..k-1``."""
    k = routed_experts.shape[-1]
    filler = torch.arange(k, device=routed_experts.device)
    routed = torch.where(routed_experts == NOT_ROUTED, filler, routed_experts.long())
    return [routed[:, :, layer].transpose(0, 1).reshape(-1, k) for layer in range(routed.shape[2])]


def check_routing(routed_experts: torch.Tensor, num_layers: int, topk: int, num_experts: int, tokens: torch.Tensor) -> None:
    """Raise ValueError unless ``routed_experts`` is ``[b, s, num_layers, topk]`` for ``tokens [b, s]``
    with expert ids in ``[0, num_experts)`` or :data:`NOT_ROUTED`."""
    expected = (*tokens.shape, num_layers, topk)
    if tuple(routed_experts.shape) != expected:
        raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}; the tokens and the model need "
                         f"{expected} ([batch, sequence, MoE layers, moe_router_topk])")
    if routed_experts.numel() and (int(routed_experts.min()) < NOT_ROUTED or int(routed_experts.max()) >= num_experts):
        raise ValueError(f"routed_experts holds expert ids outside [0, {num_experts}) (and {NOT_ROUTED}, not routed): "
                         "the routing is not this model's")


@contextmanager
def replaying(targets: list[torch.Tensor]) -> Iterator[None]:
    """Every router replays ``targets`` (one per MoE layer, in layer order) during the block."""
    RouterReplay.set_replay_data(targets)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


class RoutingAgreement:
    """Counts, while attached, the routed (token, layer) pairs of replaying forwards and those where
    the router's own top-k differs from the replayed experts. ``routers`` are Megatron's MoE routers
    in layer order; :meth:`expect` gives the next forward's local routing ``[b, s, layers, k]``."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routed = 0
        self.differ = 0
        self._valid: torch.Tensor | None = None
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    def expect(self, local_routed: torch.Tensor) -> None:
        """The next forward replays ``local_routed``; its routed positions are counted."""
        self._valid = (local_routed != NOT_ROUTED).all(-1)  # [b, s, layers]

    def _hook(self, layer: int):
        def count(router: nn.Module, args: tuple, output: tuple) -> None:
            if self._valid is None:
                return
            with torch.no_grad():
                own = router.gating(args[0]).topk(router.topk, dim=-1).indices
                own_map = torch.zeros_like(output[1]).scatter_(1, own.view(-1, router.topk), True)
                differs = (own_map != output[1]).any(-1)  # [s * b]
                valid = self._valid[:, :, layer].transpose(0, 1).reshape(-1).to(differs.device)
            self.routed += int(valid.sum())
            self.differ += int((differs & valid).sum())
        return count

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()


def reset_router_replay() -> None:
    """Forget the routers of models built before (Megatron keeps them in one process-wide list, in
    build order); call before building the one model whose routers will replay."""
    RouterReplay.clear_global_router_replay_instances()
