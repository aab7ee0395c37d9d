"""Each token's routed experts inside vLLM's worker, through the routers' capture hook.

vLLM's own routed-experts output (``LLM(enable_return_routed_experts=True)``) needs its second
model runner, which CPU builds lack; every router (``BaseRouter.set_capture_fn``) still hands its
``topk_ids [tokens of the step, k]`` to a callback before any expert-parallel remapping. The model
runner's buffers of the step say whose tokens these are: ``req_indices`` (the token's request in
the batch) and ``positions`` (its position in that request's sequence), valid for the step's
scheduled tokens. Recorded rows are keyed by request id and position, so chunked prefill,
preemption (a recomputed position overwrites its row) and any batch order give the same result.
Prefix caching must be off: a cached prefix is not computed, so its tokens would not be routed.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_quads.rollout.routing import NOT_ROUTED, ROUTED_EXPERTS_DTYPE


def capturable_routers(model: torch.nn.Module) -> list:
    """The routers of the model's MoE layers, in layer order (modules with a ``router`` that
    takes a capture callback)."""
    return [module.router for module in model.modules()
            if hasattr(getattr(module, "router", None), "set_capture_fn")]


class RoutingCapture:
    """Records, while :attr:`active`, per request and position, every MoE layer's ``k`` experts
    (see module docstring)."""

    def __init__(self, model_runner) -> None:
        self.runner = model_runner
        routers = capturable_routers(model_runner.get_model())
        if not routers:
            raise ValueError("the served model has no MoE router whose routing can be captured")
        self.num_layers = len(routers)
        self.active = False
        self._steps: list[dict] = []
        for layer, router in enumerate(routers):
            router.set_capture_fn(partial(self._capture, layer))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if not self.active:
            return
        if layer == 0:  # the first router of a forward: a new step, its scheduled tokens' owners and positions
            runner, batch = self.runner, self.runner.input_batch
            count = int(runner.query_start_loc.np[batch.num_reqs])
            self._steps.append({
                "requests": list(batch.req_ids), "owners": torch.from_numpy(runner.req_indices.np[:count].copy()),
                "positions": runner.positions[:count].to("cpu", torch.long, copy=True),
                "ids": torch.full((count, self.num_layers, topk_ids.shape[1]), NOT_ROUTED, dtype=ROUTED_EXPERTS_DTYPE),
            })
        step = self._steps[-1]
        step["ids"][:, layer] = topk_ids[: step["ids"].shape[0]].to("cpu", ROUTED_EXPERTS_DTYPE)

    def take(self) -> dict[str, torch.Tensor]:
        """``{request id: [positions, layers, k]}`` recorded so far (positions 0..last, every one
        recorded); recording stops and forgets them."""
        self.active = False
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for step in self._steps:
            for index in step["owners"].unique().tolist():
                rows = step["owners"] == index
                parts.setdefault(step["requests"][index], []).append((step["positions"][rows], step["ids"][rows]))
        self._steps = []
        out = {}
        for owner, pieces in parts.items():
            length = max(int(positions.max()) for positions, _ in pieces) + 1
            routed = torch.full((length, *pieces[0][1].shape[1:]), NOT_ROUTED, dtype=ROUTED_EXPERTS_DTYPE)
            for positions, ids in pieces:  # in step order: a recomputed position keeps its latest routing
                routed[positions] = ids
            missing = (routed == NOT_ROUTED).any(-1).any(-1).nonzero().flatten()
            if missing.numel():
                raise RuntimeError(f"request {owner}: no routing for positions {missing[:5].tolist()} "
                                   "(a prefix cache skips computing them: start vLLM with prefix caching off)")
            out[owner] = routed
        return out
