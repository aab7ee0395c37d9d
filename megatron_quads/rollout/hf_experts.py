"""Per-expert linear modules for Hugging Face MoE models whose experts are fused 3-D parameters.

transformers 5 stores a Qwen3-MoE layer's experts as ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` inside one module, so nothing sees one expert's input. :func:`split_experts`
replaces each such module by :class:`PerExpertLinears` (one ``gate_up`` and one ``down`` linear
per expert, the same routing arithmetic), whose linears the quantization analysis and calibration
can hook like any other. By default each is an ``nn.Linear`` holding the fused weight's slice; a
caller that computes the experts another way (the rollout engine: NVFP4 weights only) passes a
factory of the per-expert modules instead, and the fused weights are not copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == 3


ExpertLinearFactory = Callable[[str, int, int, int], nn.Module]
"""``(kind, expert, in_features, out_features) -> module`` for one expert's ``"gate_up"`` or
``"down"`` linear: any module mapping ``x [T, in_features]`` to ``[T, out_features]``."""


class PerExpertLinears(nn.Module):
    """Fused MoE experts as one linear module per expert; forward(hidden [T, H], top_k_index, top_k_weights).

    ``linears`` builds the per-expert modules; without it they are ``nn.Linear`` copies of the fused
    weights."""

    def __init__(self, fused: nn.Module, linears: ExpertLinearFactory | None = None) -> None:
        super().__init__()
        num_experts, two_i, hidden = fused.gate_up_proj.shape
        self.act_fn = fused.act_fn
        if linears is None:
            self.gate_up = nn.ModuleList(nn.Linear(hidden, two_i, bias=False) for _ in range(num_experts))
            self.down = nn.ModuleList(nn.Linear(two_i // 2, hidden, bias=False) for _ in range(num_experts))
            with torch.no_grad():
                for e in range(num_experts):
                    self.gate_up[e].weight.copy_(fused.gate_up_proj[e])
                    self.down[e].weight.copy_(fused.down_proj[e])
            self.to(device=fused.gate_up_proj.device, dtype=fused.gate_up_proj.dtype)
        else:
            self.gate_up = nn.ModuleList(linears("gate_up", e, hidden, two_i) for e in range(num_experts))
            self.down = nn.ModuleList(linears("down", e, two_i // 2, hidden) for e in range(num_experts))
        self.grouped: Callable[..., torch.Tensor] | None = None
        """A grouped forward (:class:`~megatron_quads.rollout.grouped_experts.GroupedExperts`) to use
        instead of the per-expert loop; the per-expert linears (and their hooks) are then not called."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's selected experts of ``down(act(gate) * up)``."""
        if self.grouped is not None:
            return self.grouped(hidden_states, top_k_index, top_k_weights, self.act_fn)
        out = torch.zeros_like(hidden_states)
        for e in range(len(self.gate_up)):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            gate, up = self.gate_up[e](hidden_states[token_idx]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def split_experts(model: nn.Module, linears: ExpertLinearFactory | None = None) -> int:
    """Replace every fused-experts module of ``model`` in place by :class:`PerExpertLinears` (built
    with ``linears``); returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules() if _is_fused_experts(m)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PerExpertLinears(module, linears))
    return len(targets)


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A transformers MoE model's tensors under checkpoint names (one gate/up/down tensor per expert).

    The inverse of what transformers 5 does on loading (it fuses ``experts.E.{gate,up}_proj`` into
    ``experts.gate_up_proj``): engines and converters speak checkpoint names.
    """
    out = {}
    for name, tensor in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and tensor.ndim == 3:
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and tensor.ndim == 3:
            for e, w in enumerate(tensor):
                out[f"{base}.{e}.down_proj.weight"] = w
        elif "rotary_emb" not in name:
            out[name] = tensor
    return out


def load_checkpoint_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load checkpoint-named tensors (one gate/up/down per expert) into a transformers MoE model whose
    experts are fused 3-D parameters: the inverse of :func:`checkpoint_weights`. Every parameter must
    be given (a tied ``lm_head`` by its embedding) and no other tensor."""
    state, used = {}, set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the weights lack '{name}', which the model holds")
        used.add(name)
        return tensors[name]

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, target in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and target.ndim == 3:
            state[name] = torch.stack([torch.cat([take(f"{base}.{e}.gate_proj.weight"), take(f"{base}.{e}.up_proj.weight")])
                                       for e in range(target.shape[0])])
        elif leaf == "down_proj" and target.ndim == 3:
            state[name] = torch.stack([take(f"{base}.{e}.down_proj.weight") for e in range(target.shape[0])])
        elif "rotary_emb" in name or (tied and name == "lm_head.weight" and name not in tensors):
            continue
        else:
            state[name] = take(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"the weights hold {len(extra)} tensor(s) the model has no place for, e.g. '{extra[0]}'")
    model.load_state_dict(state, strict=False)
